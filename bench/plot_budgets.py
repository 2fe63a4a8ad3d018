"""Draws `zinfjax bench budgets` output: each model's step, floor and predicted step against memory_limit.

Reads the JSON lines the benchmark printed (one file per model) and writes one PNG with a panel per model.

Example:
    $ python bench/plot_budgets.py runs/budgets-gpt2-large.jsonl runs/budgets-llama-1b.jsonl -o docs/budgets.png
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zinfjax.benchmarks.io import parse_size  # noqa: E402


def points(path: str) -> list[dict]:
    """The sweep's runs placed by tiers=auto (not the all-host one), in budget order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    auto = [r for r in rows if "step_s" in r and not all(t == "host" for t in r["tiers"].values())]
    return sorted(auto, key=lambda r: parse_size(r["memory_limit"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="JSON lines of zinfjax bench budgets, one file per model")
    p.add_argument("-o", "--out", default="docs/budgets.png")
    args = p.parse_args(argv)
    fig, axes = plt.subplots(1, len(args.files), figsize=(6 * len(args.files), 4.2), squeeze=False)
    for ax, path in zip(axes[0], args.files, strict=True):
        rows = points(path)
        x = [parse_size(r["memory_limit"]) / 2**30 for r in rows]
        ax.plot(x, [r["step_s"] for r in rows], "o-", label="step (measured)")
        floors = [r["floor_s"] or r["step_s"] for r in rows]  # the in-memory loop, with no NVMe bytes, is its own floor
        ax.plot(x, floors, "s--", label="floor: max(compute alone, NVMe bytes at disk rates)")
        ax.plot(x, [r["predicted_step_s"] for r in rows], "^:", label="step (the plan's prediction)")
        ax.set_title(f"{rows[0]['model']}" if rows else path)
        ax.set_xlabel("memory_limit (GiB)")
        ax.set_ylabel("seconds per step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
