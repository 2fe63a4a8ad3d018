"""Prints, as JSON, how far each ZeRO stage and mesh lands from the reference trainer (3 steps, fp32).

The figures behind tests/engine/test_stages.py, for the record (docs/sharding.md):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m tests.support.stage_equality
"""

from __future__ import annotations

import json

from tests.support.engine_helpers import config, engine_run, reference_run, relative_error

STEPS = 3
RUNS = [(mesh, stage, "gpt2-tiny") for mesh in ("data:1", "data:2", "data:4", "data:8", "data:2,model:4")
        for stage in range(4)] + [("data:2,model:4", 3, "llama-tiny")]


def main() -> None:
    references = {}
    rows = []
    for mesh, stage, model in RUNS:
        if model not in references:
            references[model] = reference_run(config(model=model, mesh="data:1"), STEPS)
        ref_losses, ref_params = references[model]
        losses, params, _ = engine_run(config(mesh=mesh, stage=stage, model=model), STEPS)
        rows.append({
            "mesh": mesh, "stage": stage, "model": model,
            "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "params_rel_error": relative_error(ref_params, params),
        })
    print(json.dumps({"steps": STEPS, "reference": "reference trainer, 1 device", "runs": rows}))


if __name__ == "__main__":
    main()
