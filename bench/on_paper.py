"""The ZeRO-Infinity paper's model configurations planned on its DGX-2 node: one Markdown row each.

Runs ``zinfjax plan --machine examples/machines/dgx2-v100.yaml --json`` for each row (0.1T to 100T,
examples/models/zero-infinity-*.yaml; fp16, stage 3, two sequences of 1024 tokens a GPU) and prints
the row docs/BENCHMARKS.md, "On paper", shows: parameters, layers, hidden, heads, model states at 16
bytes a parameter (TB), activation checkpoints a node (TiB), the paper's working memory (GiB),
zinfjax's untiled (GiB), the tiles it picks and its working memory at them, the fewest nodes GPU only
/ GPU+CPU / GPU+CPU+NVMe, and the ZeRO-Infinity placement's step and fraction of peak.

Example:
    $ python bench/on_paper.py
"""

from __future__ import annotations

import json
import subprocess
import sys

ROWS = ("0.1t", "0.5t", "1t", "10t", "100t")
G = 2**30


def plan(row: str) -> dict:
    argv = [sys.executable, "-m", "zinfjax.cli", "plan", "--machine", "examples/machines/dgx2-v100.yaml",
            "--set", f"model=examples/models/zero-infinity-{row}.yaml", "--set", "precision=fp16", "--set", "stage=3",
            "--set", "micro_batch_size=2", "--set", "batch_size=0", "--set", "seq_len=1024", "--json"]
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


def row(p: dict) -> str:
    m, w = p["model_config"], p["working"]
    c = {x["class"].split(" (")[0]: x for x in p["classes"]}
    nodes = " / ".join(str(c[k]["nodes"] or "-") for k in ("GPU only", "GPU+CPU", "GPU+CPU+NVMe"))
    inf = c["GPU+CPU+NVMe"]
    return (f"| {p['parameters'] / 1e12:.2f}T | {m['n_layers']} | {m['d_model']} | {m['n_heads']} | "
            f"{16 * p['parameters'] / 1e12:.1f} | {p['state']['acts']['per_node'] / 2**40:.2f} | "
            f"{w['paper'] / G:.2f} | "
            f"{w['untiled']['bytes'] / G:.1f} | {w['tiles']} ({w['tiled']['bytes'] / G:.1f}) | {nodes} | "
            f"{inf['step_s']:.0f} s, {100 * inf['peak_fraction']:.1f}% |")


if __name__ == "__main__":
    for r in ROWS:
        print(row(plan(r)))
