"""Torch interop: convert Hugging Face, DeepSpeed and torch checkpoints to zinfjax and back.

This package imports torch. The zinfjax library never imports it; only the
``zinfjax convert`` command does, lazily, so torch stays an optional extra.
"""
