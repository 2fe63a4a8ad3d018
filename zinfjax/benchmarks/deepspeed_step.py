"""The DeepSpeed side of `zinfjax bench versus-deepspeed`: one ZeRO-3 configuration in its own process.

Hugging Face's ``GPT2LMHeadModel`` (random initialisation, nothing downloaded) trains under
DeepSpeed ZeRO-3 with the CPU accelerator (``DS_ACCELERATOR=cpu``), one process (gloo on
localhost), AdamW (DeepSpeed's CPU Adam when the optimizer is offloaded), on one batch of random
tokens, every step. Each step (forward, ``engine.backward``, ``engine.step``) is timed. The result
is one JSON object on the last line of stdout; a configuration that raises prints
``{"error": "<type>: <first line of its message>"}`` there and exits 1.

``ds_config`` builds the DeepSpeed JSON config; it imports nothing, so the parent records the
configs without importing torch. ``--probe`` reports whether DeepSpeed imports and whether its
async I/O op (libaio, needed by every NVMe offload) can be built.

Example:
    $ DS_ACCELERATOR=cpu python -m zinfjax.benchmarks.deepspeed_step --config ds.json --steps 5 \
        --vocab-size 50257 --n-positions 1024 --n-embd 768 --n-layer 12 --n-head 12 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from zinfjax.benchmarks.process import peak_rss_bytes, seconds_since_start

LR = 3e-4  # zinfjax train's default learning rate; weight decay 0 and no clipping, also its defaults
AIO = {"block_size": 1 << 20, "queue_depth": 16, "thread_count": 1, "single_submit": False, "overlap_events": True}


def ds_config(tier: str, precision: str, batch_size: int, nvme_path: str | None = None,
              max_in_cpu: int | None = None, sub_group_size: int | None = None) -> dict:
    """The DeepSpeed JSON config of one run: ZeRO-3, params and optimizer offloaded to ``tier``.

    Args:
        tier: ``"nvme"`` or ``"cpu"`` (DeepSpeed's offload devices).
        precision: ``"fp32"`` or ``"bf16"`` (the ``bf16`` section: bf16 compute, fp32 master and Adam).
        batch_size: micro batch of the one process.
        nvme_path: the swap directory of both offloads (``tier="nvme"``).
        max_in_cpu: ``offload_param.max_in_cpu`` (parameter elements kept in RAM); None: DeepSpeed's default.
        sub_group_size: ``zero_optimization.sub_group_size`` (parameter elements the optimizer steps, and swaps in
            from NVMe, at once); None: DeepSpeed's default of 1e9, which holds the whole optimizer state of a
            model under 1e9 parameters in RAM at its step (GPT-2 large on NVMe: killed at 24 GB here).

    Example:
        >>> ds_config("cpu", "bf16", 4)["zero_optimization"]["offload_param"]
        {'device': 'cpu', 'pin_memory': False}
    """
    if tier not in ("nvme", "cpu"):
        raise ValueError(f"tier must be nvme or cpu, not {tier!r}")
    param = {"device": tier, "pin_memory": False}
    optimizer = {"device": tier, "pin_memory": False}
    if tier == "nvme":
        param["nvme_path"] = optimizer["nvme_path"] = nvme_path
        if max_in_cpu is not None:
            param["max_in_cpu"] = max_in_cpu
    config = {
        "train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": optimizer},
        "bf16": {"enabled": precision == "bf16"},
    }
    if tier == "nvme":
        config["aio"] = dict(AIO)
    if sub_group_size is not None:
        config["zero_optimization"]["sub_group_size"] = sub_group_size
    return config


# ---- probing the installation ------------------------------------------------------------------


def probe() -> dict:
    """Whether DeepSpeed imports on the CPU accelerator, and whether its async I/O op can be built.

    Builds (JIT, cached under ~/.cache/torch_extensions) the CPU Adam op, and the async I/O op
    when libaio is there, so that no run's initialisation time holds their compilation.
    """
    try:
        import deepspeed
        import torch
        import transformers
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name in ("deepspeed", "torch", "transformers"):
            return {"importable": False, "reason": f"{e.name} is not installed (pip install -e '.[dev]')"}
        return {"importable": False, "reason": f"DeepSpeed cannot be imported: {first_line(e)}"}
    accelerator = get_accelerator()
    aio = accelerator.create_op_builder("AsyncIOBuilder")
    async_io = bool(aio is not None and aio.is_compatible(verbose=False))
    t0 = time.perf_counter()
    for builder in [accelerator.create_op_builder("CPUAdamBuilder")] + ([aio] if async_io else []):
        builder.load(verbose=False)
    return {"importable": True, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerator": accelerator.device_name(),
            "async_io": async_io, "ops_load_s": time.perf_counter() - t0,
            "async_io_reason": None if async_io else "DeepSpeed's async I/O op cannot be built: libaio's headers "
            "and library were not found (apt-get install libaio-dev)"}


# ---- one run -----------------------------------------------------------------------------------


def init_single_process() -> None:
    """``deepspeed.init_distributed`` over gloo as rank 0 of 1 on localhost."""
    import deepspeed
    import deepspeed.ops

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    # The CPU accelerator JIT-compiles a shared-memory allreduce when it can; one process needs none.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def gpt2_config(args):
    """HF GPT-2 of zinfjax's shape: no dropout (zinfjax's GPT-2 has none), tied head, layer norm eps 1e-5."""
    import transformers

    return transformers.GPT2Config(vocab_size=args.vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                                   n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, layer_norm_epsilon=1e-5)


CONSTRUCTIONS = ("zero-init", "plain")


def build_model(args, config: dict):
    """``GPT2LMHeadModel`` of ``gpt2_config(args)``, built as ``args.construct`` says, with transformers' weights.

    - ``zero-init``: inside ``deepspeed.zero.Init(config)`` (DeepSpeed's way for ZeRO-3: each
      parameter is partitioned and offloaded as it is created), then initialised by transformers'
      ZeRO-3 initialisation, one gathered module at a time: what ``from_config`` does under
      ``HfDeepSpeedConfig`` (``no_init_weights``, ``zero.Init``, ``initialize_weights_zero3``),
      which needs ``accelerate``, not installed here;
    - ``plain``: ``GPT2LMHeadModel(config)`` in RAM (0.5 GB in fp32 for GPT-2 small), which
      ``deepspeed.initialize`` partitions.
    """
    import deepspeed
    import transformers
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import initialize_weights_zero3

    gpt2 = transformers.GPT2LMHeadModel  # imported lazily by transformers, with torch._dynamo, which
    if args.construct == "plain":  # refuses the torch.Tensor.__new__ that zero.Init patches in: import it first
        return gpt2(gpt2_config(args))
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=config):
        model = gpt2(gpt2_config(args))
    initialize_weights_zero3(model)
    model.tie_weights()
    return model


def train(args, config: dict) -> dict:
    """Builds the model, initialises the engine (``deepspeed.initialize``) and times ``args.steps`` steps."""
    import deepspeed
    import torch

    startup_s = seconds_since_start()
    init_single_process()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(args, config)
    model_build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    initialize_s = time.perf_counter() - t0
    init_s = seconds_since_start()
    tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len),
                           generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(json.dumps({"step": len(times), "loss": losses[-1], "step_s": times[-1]}), file=sys.stderr, flush=True)
    params = sum(p.ds_numel for p in engine.module.parameters())
    engine.destroy()
    return {"step_times_s": times, "losses": losses, "params": params, "startup_s": startup_s,
            "model_build_s": model_build_s, "initialize_s": initialize_s, "init_s": init_s,
            "peak_rss_bytes": peak_rss_bytes(), "torch_threads": torch.get_num_threads()}


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message.

    Example:
        >>> first_line(ValueError("\\nNot enough buffers\\nmore"))
        'Not enough buffers'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zinfjax.benchmarks.deepspeed_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", action="store_true", help="print what DeepSpeed can run here, and exit")
    p.add_argument("--config", help="the DeepSpeed JSON config")
    p.add_argument("--construct", choices=CONSTRUCTIONS, default="zero-init",
                   help="build the model inside deepspeed.zero.Init (default), or plainly in RAM")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--n-positions", type=int, default=1024)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    return p


def main(argv: list[str] | None = None) -> int:
    """Prints one JSON object: the probe, the run's figures, or ``{"error": ...}`` (exit 1)."""
    args = parser().parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: a download is a bug
    if args.probe:
        print(json.dumps(probe()))
        return 0
    with open(args.config) as f:
        config = json.load(f)
    try:
        result = train(args, config)
    except Exception as e:  # noqa: BLE001 - the benchmark records a configuration that crashes
        import traceback

        traceback.print_exc()
        print(json.dumps({"error": f"{type(e).__name__}: {first_line(e)}"}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
