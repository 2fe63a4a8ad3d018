"""One rank of a real DeepSpeed ZeRO run on the CPU, for tests/interop/test_deepspeed.py.

Run as ``python -m tests.support.deepspeed_child OUT RUN [RUN ...]`` in every rank, with MASTER_ADDR,
MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE set (gloo). Each RUN is ``NAME:STAGE:DTYPE``, e.g.
``zero2-bf16:2:bf16``; the runs go one after another in the same processes (one import of
DeepSpeed). Each trains a tiny GPT-2 (random weights, no download) with AdamW for `STEPS` steps,
saves a checkpoint to ``OUT/NAME``, and rank 0 writes beside it:

- ``config.json``: the model's HF config;
- ``reference.pt``: what DeepSpeed itself says the state is, read from the live engine and its own
  consolidation: ``zero_to_fp32`` (get_fp32_state_dict_from_zero_checkpoint of the saved
  checkpoint, or its error message where it cannot read it); ``state``, per parameter, ``fp32``,
  ``exp_avg`` and ``exp_avg_sq`` (safe_get_full_fp32_param, safe_get_full_optimizer_state at
  save time); ``after``, the fp32 weights after one more step on ``batch`` (that step's tokens:
  both ranks' micro-batches); ``loss``, that step's loss;
- ``ds_config.json``: the DeepSpeed config the run trained with, as a DeepSpeed user keeps it.

`launch` starts the ranks from a test and waits for them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import transformers

# The test imports this module for its constants; only the ranks import DeepSpeed (in `main`).

STEPS = 3
MICRO_BATCH = 2
SEQ = 16
LR = 2e-3
WEIGHT_DECAY = 0.1


def model_config() -> transformers.GPT2Config:
    # Odd widths: every flat partition and every ZeRO-3 parameter partition carries padding.
    return transformers.GPT2Config(vocab_size=97, n_positions=33, n_embd=27, n_layer=2, n_head=3,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
                                   bos_token_id=0, eos_token_id=0)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def train(out: str, stage: int, dtype: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = model_config()
    model = transformers.GPT2LMHeadModel(cfg)
    ds = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
    }
    if stage == 1 and dtype == "bf16":  # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    for step in range(STEPS):
        engine.backward(engine(input_ids=tokens(100 * step + rank), labels=tokens(100 * step + rank)).loss)
        engine.step()
    engine.save_checkpoint(out)
    named = list(engine.module.named_parameters())
    state = {n: {"fp32": safe_get_full_fp32_param(p).clone(),
                 "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                 "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()} for n, p in named}
    consolidated = None
    if rank == 0:
        try:
            consolidated = {k: v.detach().clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(out).items()}
        except ValueError as e:  # zero_to_fp32 does not read BF16_Optimizer (ZeRO-1 bf16) checkpoints
            consolidated = str(e)
    batch = [tokens(10_000 + r) for r in range(dist.get_world_size())]
    loss = engine(input_ids=batch[rank], labels=batch[rank]).loss
    engine.backward(loss)
    engine.step()
    losses = [torch.zeros(()) for _ in batch]
    dist.all_gather(losses, loss.detach().float())
    after = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
    if rank == 0:
        torch.save({"zero_to_fp32": consolidated, "state": state, "after": after, "batch": torch.cat(batch),
                    "loss": float(sum(losses) / len(losses)), "global_steps": engine.global_steps - 1},
                   os.path.join(out, "reference.pt"))
        cfg.save_pretrained(out)
        with open(os.path.join(out, "ds_config.json"), "w") as f:
            json.dump(ds, f, indent=1)
    engine.destroy()
    dist.barrier()


def launch(out, runs: list[str], world: int = 2, timeout_s: float = 300) -> None:
    """Every run of ``runs`` (``NAME:STAGE:DTYPE``) trained and saved under ``out`` by ``world`` DeepSpeed ranks on
    the CPU (gloo), in child processes of this one; raises AssertionError with rank 0's log when a rank fails."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        log = open(os.path.join(out, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.support.deepspeed_child", str(out), *runs],
                                       cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    try:  # a rank that fails leaves the other waiting in a collective: stop both
        while any(p.poll() is None for p, _ in procs) and not any(p.poll() for p, _ in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    codes = [p.returncode for p, _ in procs]
    if any(codes):
        with open(os.path.join(out, "rank0.log")) as f:
            raise AssertionError(f"the DeepSpeed ranks exited with {codes}:\n{f.read()[-3000:]}")


def main(out: str, runs: list[str]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce (C++) when it can; plain
    # gloo needs no compiler and is all this test needs.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    for run in runs:
        name, stage, dtype = run.split(":")
        train(os.path.join(out, name), int(stage), dtype)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
