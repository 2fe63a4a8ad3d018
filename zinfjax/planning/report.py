"""The plan as text, for ``zinfjax plan``."""

from __future__ import annotations

from zinfjax._util.byte_sizes import format_bytes


def _rate(gbps: float | None) -> str:
    return "none" if gbps is None else f"{gbps:.2f} GB/s"


def format_plan(plan: dict, top: int = 12) -> str:
    """The plan as a readable table: the parts, the machine, and the fastest placements that fit."""
    p, m, r = plan["parts"], plan["machine"], plan["rates"]
    lines = [f"model {plan['model']}: {p['parameters']:,} parameters, batch {plan['batch_size']} x {plan['seq_len']}, "
             f"{plan['precision']}, stage {plan['stage']}, mesh {plan['mesh']}", "", "state:"]
    for key, label in (("params", f"params ({plan['precision']})"), ("master", "fp32 master"),
                       ("optimizer", "optimizer state"), ("gradients", "gradients (fp32)"),
                       ("activations", "activation checkpoints"), ("activation_transient", "largest transient")):
        if key == "master" and not p["master"]:
            continue
        extra = ""
        if key == "gradients":
            extra = f"  (stored: {format_bytes(p['gradients_stored'])}; the rest is applied as it is made)"
        if key == "activations":
            extra = f"  ({format_bytes(p['activation_per_layer'])} per layer)"
        lines.append(f"  {label:<24}{format_bytes(p[key]):>12}{extra}")
    nvme = "not set" if m["nvme_free_bytes"] is None else f"{format_bytes(m['nvme_free_bytes'])} free"
    device = "= host memory (CPU backend)" if m["device_bytes"] is None else format_bytes(m["device_bytes"])
    lines += ["", f"machine: host budget {format_bytes(m['host_bytes'])} ({m['host_source']}), device {device}, "
              f"nvme {nvme}",
              f"rates{'' if plan['probed'] else ' (nominal)'}: compute {r['engine_s']:.3f} s/step (engine), "
              f"{r['reference_s']:.3f} s/step (in-memory), host copy {_rate(r['host_copy_GBps'])}, "
              f"disk read {r['disk_read_GBps']:.2f} / write {r['disk_write_GBps']:.2f} GB/s, nvme tier in a step "
              f"{r['nvme_step_GBps']:.2f} GB/s", ""]
    header = f"{'params':<8}{'optimizer':<10}{'gradients':<10}{'activations':<12}{'fits':<6}{'step s':>8}" \
             f"{'compute':>9}{'host':>8}{'nvme':>8}  short"
    lines.append(header)
    shown = [row for row in plan["placements"] if row["fits"]][:top]
    shown += [row for row in plan["placements"] if not row["fits"]][:max(0, top - len(shown))]
    for row in shown:
        t = row["tiers"]
        short = ", ".join(f"{k} {format_bytes(v)}" for k, v in row["short"].items())
        lines.append(f"{t['params']:<8}{t['optimizer']:<10}{t['gradients']:<10}{t['activations']:<12}"
                     f"{'yes' if row['fits'] else 'no':<6}{row['step_s']:>8.3f}{row['compute_s']:>9.3f}"
                     f"{row['host_copy_s']:>8.3f}{row['nvme_io_s']:>8.3f}  {short}")
    more = len(plan["placements"]) - len(shown)
    if more:
        lines.append(f"... {more} more placements (--all shows them, --json gives every figure)")
    rec = plan["recommended"]
    lines += ["", "recommended: " + " ".join(f"params={rec['tiers']['params']} optimizer={rec['tiers']['optimizer']} "
                                              f"gradients={rec['tiers']['gradients']} "
                                              f"activations={rec['tiers']['activations']}".split())
              + f" (predicted {rec['step_s']:.3f} s/step; zinfjax train --set tiers=auto uses it)"]
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)
