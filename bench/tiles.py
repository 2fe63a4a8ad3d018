"""What tiles cost where they are not needed: gpt2-small on NVMe through ``zinfjax train``, tiled and untiled.

Runs ``zinfjax train`` (every tier on NVMe, the user's defaults otherwise) in alternating triples, each
run in its own process with a JSON log: ``tiles=1``; ``--tiles`` as a user gets it (``stream_tiles=auto``,
which streams a layer that fits whole, its tiles computed in turn); and ``--tiles`` with
``stream_tiles=always`` (every tile read, written and updated alone, as a layer too large for memory is).
Prints one JSON object: each run's median step time after the first two (compilation and first-touch)
steps, and the tiled runs' ratios to the untiled one of their triple. Also ``tiles=auto``'s choice for
the model on this machine (from the log of a one-step run).

Example:
    $ python bench/tiles.py --dir runs/tiles --tiles 4 --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def train(directory: str, tiles: str, args, stream_tiles: str = "auto") -> dict:
    """One ``zinfjax train`` run; its median step time after the first, and its log's tile facts."""
    nvme, log = os.path.join(directory, "nvme"), os.path.join(directory, "log.json")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    sets = [f"model={args.model}", f"tiles={tiles}", f"steps={args.steps}", f"batch_size={args.batch_size}",
            f"seq_len={args.seq_len}", f"precision={args.precision}", f"nvme_path={nvme}", f"log={log}",
            f"stream_tiles={stream_tiles}",
            "params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme"]
    argv = [sys.executable, "-m", "zinfjax.cli", "train", "--quiet"] + [a for s in sets for a in ("--set", s)]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    with open(log) as f:
        data = json.load(f)
    steps = [s["step_s"] for s in data["steps"]]
    return {"tiles": data["tiles"], "streamed_tiles": data["streamed_tiles"],
            "largest_operation_bytes": data["largest_operation_bytes"],
            "step_s": statistics.median(steps[2:]) if len(steps) > 2 else steps[-1], "steps_s": steps}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/tiles")
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--tiles", default="4")
    p.add_argument("--pairs", type=int, default=2, help="alternating untiled/tiled/tile-streamed triples")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--precision", default="fp32")
    args = p.parse_args(argv)
    runs = []
    for k in range(args.pairs):
        untiled = train(os.path.join(args.dir, f"untiled{k}"), "1", args)
        tiled = train(os.path.join(args.dir, f"tiled{k}"), args.tiles, args)
        streamed = train(os.path.join(args.dir, f"streamed{k}"), args.tiles, args, stream_tiles="always")
        runs.append({"untiled": untiled, "tiled": tiled, "tile_streamed": streamed,
                     "ratio": tiled["step_s"] / untiled["step_s"],
                     "tile_streamed_ratio": streamed["step_s"] / untiled["step_s"]})
    auto = train(os.path.join(args.dir, "auto"), "auto", argparse.Namespace(**{**vars(args), "steps": 1}))
    print(json.dumps({"model": args.model, "batch": [args.batch_size, args.seq_len], "precision": args.precision,
                      "tiles": int(args.tiles), "pairs": runs, "ratios": [r["ratio"] for r in runs],
                      "tile_streamed_ratios": [r["tile_streamed_ratio"] for r in runs],
                      "auto_tiles": auto["tiles"]}))


if __name__ == "__main__":
    main()
