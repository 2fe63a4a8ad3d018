"""Journeys: whole user paths through the ``zinfjax`` command, as README.md and docs/*.md write them.

Each journey types the commands the docs show, with the defaults a user leaves alone, on real parts: models that
transformers builds from tiny configs, a byte-level BPE trained here by ``tokenizers``, DeepSpeed's own checkpoint,
real files. It asserts what a user would look at: exit codes, the files written, the text printed, and numbers
that the reference tool (transformers, peft) computes too. The commands run in the test's process
(`zinfjax.cli.main`), which has the suite's 8 simulated CPU devices.
"""
