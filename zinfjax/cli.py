"""The ``zinfjax`` command.

User mistakes (`zinfjax.errors.UserError`) print one line and exit with status 2. Anything else
is a bug: it prints a short report, writes the full traceback to a file it names, and exits 1.

The commands import their modules inside the function that runs them: ``zinfjax --help`` and
``zinfjax launch`` start without importing JAX, and ``convert`` alone needs torch (``zinfjax_interop``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import traceback
from dataclasses import fields

from zinfjax.errors import ConfigError, UserError

DESCRIPTION = """\
zinfjax: ZeRO-Infinity for JAX. Train models larger than accelerator and host memory
by sharding the model state over devices and streaming each layer from host memory or NVMe.
"""


def _config_keys_help() -> str:
    from zinfjax.config import KEY_DOCS, Config

    rows = [f"  {f.name:<18} {KEY_DOCS.get(f.name, '')} (default: {f.default!r})" for f in fields(Config)]
    return "config keys (set in the config file or with --set key=value):\n" + "\n".join(rows)


def add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a config file and overrides",
        description="Train a model. Shows a progress bar with step, loss and tokens/s; at the end writes "
        "the JSON log given by `log` and a PNG loss curve beside it.",
        epilog=_config_keys_help()
        + "\n\nexamples:\n  zinfjax train --set model=gpt2-tiny --set steps=50 --set log=runs/demo.json\n"
        "  zinfjax train run.yaml --set stage=3 --set params=nvme --set nvme_path=/mnt/nvme/run1\n"
        "  zinfjax train ds_config.json   # a DeepSpeed config: zero_optimization is mapped",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of compute and every read and "
                   "write per layer to FILE (JSON), and a PNG timeline beside it; needs an offloaded tier")
    p.set_defaults(func=_train)


def add_config_args(p) -> None:
    """The config file and ``--set`` overrides, as ``zinfjax train`` and ``zinfjax plan`` take them."""
    p.add_argument("config", nargs="?", help="JSON or YAML config file, or a DeepSpeed config JSON")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (the keys: `zinfjax train --help`); repeat for several")


def _train(args) -> int:
    from zinfjax.config import Config
    from zinfjax.runtime.allocator import tune_allocator
    from zinfjax.runtime.distributed import is_main_process
    from zinfjax.training.loop import run

    config = Config.load(args.config, args.overrides)
    if config.may_use_nvme:  # before any thread allocates (an arena each otherwise): zinfjax/runtime/allocator.py
        tune_allocator()
    log = run(config, progress=not args.quiet, trace=args.trace)
    if not is_main_process():
        return 0
    if not log["steps"]:
        print(f"nothing to train: the checkpoint is already at step {config.steps}")
        return 0
    first, last = log["steps"][0]["loss"], log["steps"][-1]["loss"]
    print(f"trained {len(log['steps'])} steps: loss {first:.4f} -> {last:.4f}"
          + (f"; log {config.log}" if config.log else ""))
    return 0


def add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="bytes of each part of the state, which placements fit this machine, and their predicted step time",
        description="Plan a run before starting it: for the config's model, batch, precision, stage and mesh, the "
        "bytes of the parameters, fp32 master weights, optimizer state, gradients and activation checkpoints; for "
        "each placement of params, optimizer, gradients and activations on device, host or nvme whether it fits "
        "device memory, the host budget (memory_limit, else the cgroup or available memory) and the free space "
        "under nvme_path; and a predicted step time. On the CPU backend device memory is host memory, so the "
        "device and host tiers share the host budget. The prediction times a few steps of the engine on a few "
        "layers of the model (compute, scaled by FLOPs to every layer), probes the disk under nvme_path (256 MiB of "
        "O_DIRECT I/O), and times the same steps with every tier on host, and on nvme in a scratch directory under "
        "nvme_path: the host tier priced at what it adds to a step per byte it moves, the nvme tier at the CPU "
        "seconds its I/O threads took per byte, and the disk at how near its own time that run came; it prices "
        "the placement at what the "
        "engine will choose for it (recomputing the forward, returning freed pages). On the CPU backend, where "
        "copies and the "
        "I/O threads share the cores with compute, step = max(compute + host copies + NVMe traffic at those "
        "rates, the disk's own time); elsewhere the largest of compute, host copies and the disk's time. It "
        "recommends the fastest placement that fits; `zinfjax train --set tiers=auto` trains with it. With "
        "--machine FILE it plans for the machine the file describes instead (nodes, devices, memories, NVMe, link "
        "rates and peak FLOP/s, each with its source; examples/machines/ holds three): nothing is probed or traced, "
        "the figures come from the model's shapes and the file. It prints the model states by kind, each device's "
        "working memory (the ZeRO-Infinity paper's, and zinfjax's with the tile count it would pick), which "
        "placements fit how many nodes, the fewest nodes for GPU only, GPU+CPU and GPU+CPU+NVMe, and each "
        "placement's predicted step and fraction of peak FLOP/s (docs/planning.md, \"Planning for another "
        "machine\").",
        epilog="examples:\n  zinfjax plan --set model=gpt2-small --set batch_size=4 --set seq_len=512\n"
        "  zinfjax plan run.yaml --set nvme_path=/mnt/nvme/run1 --set memory_limit=8GiB --json\n"
        "  zinfjax train run.yaml --set tiers=auto --set nvme_path=/mnt/nvme/run1\n"
        "  zinfjax plan --machine examples/machines/dgx2-v100.yaml --set model=examples/models/zero-infinity-1t.yaml "
        "--set precision=fp16 --set stage=3 --set micro_batch_size=2 --set batch_size=0 --set seq_len=1024\n"
        "  zinfjax plan --machine examples/machines/h100-8x.yaml --nodes 4 --set model=llama-7b --set precision=bf16 "
        "--set stage=3 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the whole plan as one JSON object")
    p.add_argument("--no-probe", action="store_true", help="no timing runs: nominal compute, disk and copy rates "
                   "(fast; the fit figures are the same)")
    p.add_argument("--all", action="store_true", help="show every placement, not the 12 fastest")
    p.add_argument("--machine", metavar="FILE", help="plan for the machine FILE describes (YAML or JSON: nodes, "
                   "devices, memories, NVMe, link rates, peak FLOP/s and their sources; see examples/machines/), "
                   "not this one; nothing is probed")
    p.add_argument("--nodes", type=int, metavar="N", help="with --machine: the nodes available (default: the "
                   "file's nodes, else no limit)")
    p.set_defaults(func=_plan)


def _plan(args) -> int:
    import json

    from zinfjax.config import Config

    if args.nodes is not None and (not args.machine or args.nodes < 1):
        raise ConfigError(f"--nodes {args.nodes}: " + ("give it with --machine FILE" if not args.machine
                                                        else "must be 1 or more"))
    config = Config.load(args.config, args.overrides)
    if args.machine:
        from zinfjax.planning.machine_plan import load_machine, plan_for_machine
        from zinfjax.planning.report import format_machine_plan

        plan = plan_for_machine(config, load_machine(args.machine), args.nodes)
        print(json.dumps(plan) if args.json else format_machine_plan(plan, top=10**6 if args.all else 12))
        return 0
    from zinfjax.planning.recommend import make_plan
    from zinfjax.planning.report import format_plan

    plan = make_plan(config, probe=not args.no_probe)
    print(json.dumps(plan) if args.json else format_plan(plan, top=10**6 if args.all else 12))
    return 0


def add_launch(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a command as N processes joined by jax.distributed (CPU: gloo on localhost)",
        description="Start N copies of COMMAND on this machine, each told its rank, the process count and the "
        "coordinator address through ZINFJAX_* environment variables (see docs/sharding.md). Output is "
        "prefixed [rank i]. If any process fails, the others are stopped and launch exits with its code.",
        epilog="examples:\n  zinfjax launch -n 2 -- zinfjax train run.yaml\n"
        "  zinfjax launch -n 2 --devices-per-process 4 -- zinfjax train --set params=nvme --set nvme_path=/tmp/nv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--nproc", type=int, required=True, metavar="N", help="number of processes")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--devices-per-process", type=int, metavar="K",
                   help="simulated CPU devices per process (default: the XLA_FLAGS of the environment)")
    p.add_argument("--connect-timeout", type=int, default=60, metavar="S",
                   help="seconds each process waits for all peers to connect (default: 60)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    p.set_defaults(func=_launch)


def _launch(args) -> int:
    from zinfjax.runtime.launch import LaunchError, launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch(command, args.nproc, port=args.port, devices_per_process=args.devices_per_process,
                      connect_timeout=args.connect_timeout)
    except LaunchError as err:
        print(f"zinfjax: error: {err}", file=sys.stderr)
        return err.exit_code


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON (io, step, capacity, memory, budgets, lora, "
                       "generate, versus-ds)",
                       description="Benchmarks. Each prints one JSON object; see docs/BENCHMARKS.md.")
    p.add_argument("name", choices=["io", "step", "capacity", "memory", "budgets", "lora", "generate",
                                    "versus-deepspeed", "soak", "integrity"],
                   help="io: the nvme tier against raw O_DIRECT disk throughput; step: reference vs engine on "
                   "device, host and nvme tiers against the I/O floor; capacity: a state far larger than memory; "
                   "memory: gpt2-small, gpt2-large and llama-1b through zinfjax train in memory cgroups; "
                   "budgets: one model through zinfjax train at several memory_limit values (tiers=auto), each step "
                   "against its floor; "
                   "lora: llama-7b's rank-16 adapters in a 3 GiB cgroup against the step's floor; "
                   "generate: tokens/s with parameters in memory, on host and on nvme at batch sizes 1, 8, 64; "
                   "versus-deepspeed: GPT-2 small under DeepSpeed ZeRO-3 and zinfjax train, NVMe, CPU and memory; "
                   "soak: gpt2-mini for 2,000 steps on NVMe, its RSS, descriptors, threads, disk and step time; "
                   "integrity: the step with and without the crc32c check of every chunk read back (verify_chunks)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (see `zinfjax bench io -h`)")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    module = importlib.import_module(f"zinfjax.benchmarks.{args.name.replace('-', '_')}")
    return module.main(args.rest) or 0


def add_ckpt(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect and export checkpoints",
                       description="Inspect a checkpoint directory, or export a checkpoint's parameters for inference.",
                       epilog="examples:\n  zinfjax ckpt info runs/demo/ckpt\n"
                       "  zinfjax ckpt info runs/demo/ckpt --verify\n"
                       "  zinfjax ckpt export runs/demo/ckpt runs/demo/params-bf16 --dtype bf16",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = actions.add_parser("info", help="steps, leaf shapes, bytes per tier and the training config")
    info.add_argument("dir", help="a save_dir, or one checkpoint (<save_dir>/<step>)")
    info.add_argument("--json", action="store_true", help="print the newest checkpoint's metadata as JSON")
    info.add_argument("--verify", action="store_true", help="check every checkpoint's metadata and every chunk's "
                      "crc32c, and say which steps are complete, corrupt or partial (exit status 1 if any is not "
                      "complete)")
    export = actions.add_parser("export", help="parameters only, in the compute dtype, as an orbax checkpoint")
    export.add_argument("dir", help="a save_dir (its newest checkpoint) or one checkpoint")
    export.add_argument("out", help="the new directory (an orbax PyTree checkpoint of numpy arrays)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                        help="dtype of the exported parameters (default: the run's precision)")
    p.set_defaults(func=_ckpt)


def _ckpt(args) -> int:
    from zinfjax.checkpoint import inspect

    if args.action == "info" and args.verify:
        text, all_complete = inspect.verify_text(args.dir)
        print(text)
        return 0 if all_complete else 1
    if args.action == "info":
        print(inspect.info_text(args.dir, as_json=args.json))
        return 0
    out = inspect.export_params(args.dir, args.out, args.dtype)
    print(f"exported the parameters of {out['source']} ({out['dtype']}, {out['leaves']} leaves, "
          f"{out['bytes']} bytes) to {args.out}")
    return 0


def _tier_overrides(p) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key, e.g. params=nvme, kv_cache=host, nvme_path=/mnt/nvme/gen, precision=bf16, "
                   "prefetch_depth=2 (see `zinfjax train --help` for every key)")


def add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a checkpoint, parameters streamed from their tier",
        description="Generate tokens after a prompt with the parameters streamed from their tier (params=...) for "
        "every decoding step and a KV cache per layer on its own tier (kv_cache=...). The sequences of a batch pass "
        "through each layer together (batch-major), so one read of a layer serves the whole batch.",
        epilog="examples:\n  zinfjax generate runs/ckpt --prompt 'The ' --max-new-tokens 40\n"
        "  zinfjax generate runs/ckpt --prompt-ids 1,2,3 --json --batch-size 8 --temperature 0.8 --top-p 0.9 "
        "--set params=nvme --set nvme_path=/mnt/nvme/gen",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a zinfjax checkpoint: a save_dir (its newest step) or <save_dir>/<step>; "
                   "`zinfjax convert` makes one from a Hugging Face model")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (tokenized by the model's tokenizer)")
    prompt.add_argument("--prompt-ids", help="the prompt as comma-separated token ids")
    p.add_argument("--tokenizer", help="'bytes', or a Hugging Face tokenizer directory; the same as --set "
                   "tokenizer=... (default: the one kept beside the checkpoint or beside the base it names, else "
                   "bytes for a byte vocabulary; docs/data.md)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (the prompt repeated)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within the nucleus of probability p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--json", action="store_true", help="print the token ids and the figures as JSON")
    _tier_overrides(p)
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    from zinfjax.config import Config
    from zinfjax.inference import Sampling, generate
    from zinfjax.inference.generate import check_counts, parse_ids

    config = _with_tokenizer(Config.load(None, args.overrides), args.tokenizer)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    check_counts(args.max_new_tokens, args.batch_size)
    ids = parse_ids(args.prompt_ids) if args.prompt_ids else None
    tokenizer = _prompt_tokenizer(args, config) if ids is None or not args.json else None
    ids = ids if ids is not None else tokenizer.encode(args.prompt)
    result = generate(args.checkpoint, [ids] * args.batch_size, args.max_new_tokens, config, sampling)
    if args.json:
        print(json.dumps({"tokens": result.tokens, "metrics": result.metrics}))
    else:
        for row in result.tokens:
            print(tokenizer.decode(row))
        m = result.metrics
        print(f"[{m['sequences']} x {m['new_tokens']} tokens, {m['tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
    return 0


def _with_tokenizer(config, tokenizer: str | None):
    """``--tokenizer X`` is ``--set tokenizer=X``; given both, they must name the same tokenizer."""
    if tokenizer is None:
        return config
    if config.tokenizer not in (None, tokenizer):
        raise ConfigError(f"--tokenizer {tokenizer} and --set tokenizer={config.tokenizer} name different "
                          "tokenizers; give one")
    return config.replace(tokenizer=tokenizer)


def _prompt_tokenizer(args, config):
    """The tokenizer of the checkpoint's text (`zinfjax.checkpoint.tokenizer.model_tokenizer`): the prompt's ids
    and the output's text."""
    from zinfjax.checkpoint.model import checkpoint_model
    from zinfjax.checkpoint.tokenizer import model_tokenizer

    _, model = checkpoint_model(args.checkpoint)
    return model_tokenizer(config.tokenizer, args.checkpoint, model.vocab_size,
                           instead="the prompt as --prompt-ids with --json (ids in, ids out)")


def add_evaluate(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="loss and perplexity of a checkpoint, parameters streamed from their tier",
        description="Compute the mean token loss and the perplexity of a checkpoint on a token source. Each batch of "
        "sequences streams every layer once from its tier (params=...).",
        epilog="examples:\n  zinfjax evaluate runs/ckpt --data demo\n"
        "  zinfjax evaluate runs/ckpt --data corpus.txt --batches 20 --set params=nvme --set nvme_path=/mnt/nv",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a zinfjax checkpoint (a save_dir or <save_dir>/<step>)")
    p.add_argument("--data", default="demo", help="'demo', a text file or directory, or a .bin token file")
    p.add_argument("--batches", type=int, default=8, help="batches to evaluate (batch_size x seq_len tokens each)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    _tier_overrides(p)
    p.set_defaults(func=_evaluate)


def _evaluate(args) -> int:
    from zinfjax.config import Config
    from zinfjax.inference import evaluate

    if args.batches < 1:
        raise ConfigError(f"--batches {args.batches} must be 1 or more")
    out = evaluate(args.checkpoint, args.data, Config.load(None, args.overrides), args.batches)
    print(json.dumps(out) if args.json else f"loss {out['loss']:.4f}, perplexity {out['perplexity']:.3f} over "
          f"{out['tokens']} tokens ({out['tokens_per_s']:.0f} tokens/s)")
    return 0


def add_convert(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert Hugging Face, DeepSpeed and torch checkpoints to zinfjax, and back",
        description="Convert the checkpoint SRC into a zinfjax checkpoint (--to zinfjax, the default: parameters in "
        "fp32 and an optimizer state, under DST/<step>) or a Hugging Face model directory (--to hf: config.json and "
        "model.safetensors, which transformers' from_pretrained loads). The source format is found from its files: "
        "a Hugging Face model directory (safetensors, sharded or not, or pytorch_model.bin), a DeepSpeed ZeRO save "
        "dir (stage 1, 2 or 3, any world size; its Adam state and step come along), a zinfjax checkpoint or "
        "save_dir, or a torch.save'd state_dict with --model (and --mapping when its names are not Hugging Face's). "
        "Tensors stream one at a time, so a checkpoint larger than memory converts. LoRA: a zinfjax checkpoint with "
        "adapters goes --to peft (adapter_config.json and adapter_model.safetensors, which peft's "
        "PeftModel.from_pretrained loads onto the Hugging Face base) or --to hf --merge (the adapters folded into the "
        "weights); a PEFT adapter directory converts to a zinfjax checkpoint of its adapters with --base, the zinfjax "
        "checkpoint of its base model. Needs the torch extra (pip install 'zinfjax[torch]').",
        epilog="examples:\n"
        "  zinfjax convert path/to/gpt2 runs/gpt2          # then zinfjax.wrap(state, config, restore='runs/gpt2')\n"
        "  zinfjax convert runs/gpt2 out/gpt2-hf --to hf --dtype bf16\n"
        "  zinfjax convert ds_run/ runs/from-ds            # DeepSpeed: latest, global_stepN/*_optim_states.pt\n"
        "  zinfjax convert ckpt.pt runs/nano --model model.json --mapping examples/mapping_nanogpt.yaml\n"
        "  zinfjax convert runs/lora out/adapter --to peft       # LoRA adapters, for peft.PeftModel.from_pretrained\n"
        "  zinfjax convert runs/lora out/merged --to hf --merge  # the adapters folded into the weights\n"
        "  zinfjax convert out/adapter runs/lora2 --base runs/llama   # a PEFT adapter on a converted base",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="the checkpoint to read (a directory, or a .pt/.pth/.bin/.safetensors file)")
    p.add_argument("dst", help="--to zinfjax: the save_dir to write into; --to hf: the model directory; --to peft: "
                   "the adapter directory")
    p.add_argument("--to", choices=["zinfjax", "hf", "peft"], default="zinfjax",
                   help="the format to write (default zinfjax); peft: a zinfjax checkpoint's LoRA adapters")
    p.add_argument("--from", dest="source_format", choices=["hf", "deepspeed", "zinfjax", "torch", "peft"],
                   help="the source's format, when the guess from its files is not wanted")
    p.add_argument("--model", help="the model of a torch state_dict (or of a DeepSpeed run without a config.json "
                   "beside it): a named size (gpt2-tiny), a ModelConfig JSON/YAML, or a Hugging Face config.json")
    p.add_argument("--mapping", help="a torch state_dict's names to zinfjax leaves, as JSON or YAML "
                   "(see interop/mapping.py and examples/mapping_nanogpt.yaml)")
    p.add_argument("--lr", type=float, help="learning rate recorded with the optimizer state (default 3e-4; for "
                   "DeepSpeed: the run's own)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="--to hf: the dtype of the written tensors "
                   "(default: the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="--to hf: past this size the tensors go into shards "
                   "with a model.safetensors.index.json, as transformers writes (default 5GB)")
    p.add_argument("--merge", action="store_true", help="--to hf from a checkpoint with LoRA adapters: fold them "
                   "into the weights, W + (lora_alpha / lora_rank) A B")
    p.add_argument("--base", help="a PEFT adapter's base model, as a zinfjax checkpoint or save_dir (zinfjax convert "
                   "HF_BASE_DIR runs/base makes one); the new checkpoint holds the adapters and names this base")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    try:
        from zinfjax_interop.convert import convert  # lazy: interop needs torch, an optional extra
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "safetensors", "zinfjax_interop"):
            raise
        raise ConfigError(f"zinfjax convert needs {e.name}, which is not installed: "
                          "pip install 'zinfjax[torch]'") from e

    out = convert(args.src, args.dst, args.to, source_format=args.source_format, model=args.model,
                  mapping=args.mapping, lr=args.lr, dtype=args.dtype, max_shard_size=args.max_shard_size,
                  progress=not args.quiet, base=args.base, merge=args.merge)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"converted {out['source']} ({out['format']}) to {out['to']} at {out['path']}: {out['tensors']} "
              f"tensors, {out['bytes']} bytes, {out['dtype']}" + (f", step {out['step']}" if out.get("step") else ""))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    add_train(sub)
    add_plan(sub)
    add_bench(sub)
    add_launch(sub)
    add_ckpt(sub)
    add_generate(sub)
    add_evaluate(sub)
    add_convert(sub)
    return p


HUGE_PAGE_COMMANDS = ("train", "plan", "generate")  # those that run steps: see zinfjax/runtime/allocator.py


def console() -> int:
    """Entry point of the ``zinfjax`` console script (and ``python -m zinfjax.cli``): the commands that run
    steps start again once with malloc on transparent huge pages
    (`zinfjax.runtime.allocator.restart_with_huge_pages`)."""
    if len(sys.argv) > 1 and sys.argv[1] in HUGE_PAGE_COMMANDS and "-h" not in sys.argv and "--help" not in sys.argv:
        from zinfjax.runtime.allocator import restart_with_huge_pages

        restart_with_huge_pages()
    return main()


def main(argv: list[str] | None = None) -> int:
    """The ``zinfjax`` command on ``argv`` (default: ``sys.argv[1:]``); returns its exit status."""
    args = parser().parse_args(argv)
    if not getattr(args, "func", None):
        parser().print_help()
        return 2
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, where it is handled, not when Python exits
    except UserError as err:
        print(f"zinfjax: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("zinfjax: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        code = _reader_left()
    except Exception as err:  # a bug, not the user's mistake: a short report, the traceback in a file
        _stop_if_peer_lost()  # unless a peer of a multi-process run died: one line naming it, and exit
        print(f"zinfjax: internal error: {type(err).__name__}: {_first_line(err)}\n"
              f"zinfjax: this is a bug in zinfjax; the full traceback is in {_write_traceback(err)}", file=sys.stderr)
        code = 1
    if code:
        _exit_now_if_distributed(code)
    return code


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _write_traceback(err: BaseException) -> str:
    """Writes ``err``'s full traceback to a new file (``$TMPDIR/zinfjax-traceback-*.txt``) and returns its path."""
    fd, path = tempfile.mkstemp(prefix="zinfjax-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"zinfjax {' '.join(sys.argv[1:])}\n\n")
        f.write("".join(traceback.format_exception(err)))
    return path


def _reader_left() -> int:
    """The reader of our output went away (``zinfjax ckpt info D | head``): stop quietly, as ``cat`` does."""
    # Python would report the broken pipe again when it flushes stdout at exit; point stdout at /dev/null.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _stop_if_peer_lost() -> None:
    peers = sys.modules.get("zinfjax.runtime.peers")  # loaded by a multi-process run only
    if peers is not None:
        peers.stop_if_peer_lost()


def _exit_now_if_distributed(code: int) -> None:
    """A failed process of a multi-process run leaves at once: its peers may wait for it in a collective."""
    distributed = sys.modules.get("zinfjax.runtime.distributed")
    if distributed is not None and distributed.jax.distributed.is_initialized():
        distributed.exit_now(code)


if __name__ == "__main__":
    sys.exit(console())
