"""Conversion of torch, Hugging Face and DeepSpeed checkpoints (zinfjax_interop)."""
