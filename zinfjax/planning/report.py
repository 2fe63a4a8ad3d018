"""The plan as text, for ``zinfjax plan`` (this machine) and ``zinfjax plan --machine`` (a described one)."""

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
    lines.append(f"  {'tiles':<24}{plan.get('tiles', 1):>12}  (each block's MLP and attention; tiles=auto: the fewest "
                 "whose largest operation fits the budget, chosen before the placement)")
    lines += ["", f"machine: host budget {format_bytes(m['host_bytes'])} ({m['host_source']}), device {device}, "
              f"nvme {nvme}",
              f"rates{'' if plan['probed'] else ' (nominal)'}: compute {r['engine_s']:.3f} s/step (engine), "
              f"{r['reference_s']:.3f} s/step (in-memory), host copy {_rate(r['host_copy_GBps'])}, "
              f"disk read {r['disk_read_GBps']:.2f} / write {r['disk_write_GBps']:.2f} GB/s, nvme tier in a step "
              f"{r['nvme_step_GBps']:.2f} GB/s (the bytes per CPU second of its I/O path), the disk reached "
              f"{100 * r.get('disk_efficiency', 1.0):.0f}% where it bound", ""]
    shown = shown_placements(plan["placements"], top)
    keys = ("params", "optimizer", "gradients", "activations")
    width = {k: 2 + max(len(k), *(len(r["tiers"][k]) for r in shown)) for k in keys}  # a split is longer
    lines.append("".join(f"{k:<{width[k]}}" for k in keys) + f"{'fits':<6}{'step s':>8}{'compute':>9}{'host':>8}"
                 f"{'nvme':>8}  short")
    for row in shown:
        t = row["tiers"]
        short = ", ".join(f"{k} {format_bytes(v)}" for k, v in row["short"].items())
        lines.append("".join(f"{t[k]:<{width[k]}}" for k in keys) +
                     f"{'yes' if row['fits'] else 'no':<6}{row['step_s']:>8.3f}{row['compute_s']:>9.3f}"
                     f"{row['host_copy_s']:>8.3f}{row['nvme_io_s']:>8.3f}  {short}")
    lines += more_placements(plan["placements"], shown)
    rec = plan["recommended"]
    lines += ["", "recommended: " + " ".join(f"params={rec['tiers']['params']} optimizer={rec['tiers']['optimizer']} "
                                              f"gradients={rec['tiers']['gradients']} "
                                              f"activations={rec['tiers']['activations']}".split())
              + f" (predicted {rec['step_s']:.3f} s/step; zinfjax train --set tiers=auto uses it)"]
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


# ---- zinfjax plan --machine -------------------------------------------------------------------

KIND_LABELS = (("params", "params ({p})"), ("grads", "gradients ({p})"), ("master", "fp32 master"),
               ("opt", "optimizer state ({o})"), ("acts", "activation checkpoints"))


def _tiers(tiers: dict | None) -> str:
    if tiers is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in tiers.items())


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f}" if s >= 10 else f"{s:.3f}"


def _machine_lines(plan: dict) -> list[str]:
    m, mc = plan["model_config"], plan["machine"]
    nvme = (f"NVMe {format_bytes(mc['nvme_capacity'])} ({mc['nvme_read_GBps']:g} / {mc['nvme_write_GBps']:g} GB/s "
            "read / write)" if mc["nvme_capacity"] else "no NVMe")
    dtype = f" {mc['peak_flops_dtype']}" if mc["peak_flops_dtype"] else ""
    available = "no limit" if plan["nodes_available"] is None else str(plan["nodes_available"])
    return [f"model {plan['model']}: {plan['parameters']:,} parameters ({m['arch']}: {m['n_layers']} layers, d_model "
            f"{m['d_model']}, d_ff {m['d_ff']}, {m['n_heads']} heads), batch {plan['batch_size']} x {plan['seq_len']}, "
            f"{plan['precision']}, stage {plan['stage']}",
            f"machine {mc['name']}: per node {mc['devices']} devices x {format_bytes(mc['device_memory'])} at "
            f"{mc['peak_flops'] / 1e12:g} TFLOP/s{dtype} x {mc['matmul_efficiency']:g}, host "
            f"{format_bytes(mc['host_memory'])}, {nvme}, device-host {mc['device_host_GBps']:g} GB/s a device, "
            f"node-node {mc['node_to_node_GBps']:g} GB/s; nodes available: {available}",
            f"planned on {plan['nodes']} node(s), {plan['nodes'] * mc['devices']} devices: the fewest any placement "
            "fits", ""]


def _state_lines(plan: dict) -> list[str]:
    n = plan["nodes"]
    lines = [f"{'model states':<38}{'whole':>12}{f'per node ({n})':>16}{'per device':>14}"]
    total = {"whole": 0.0, "per_node": 0.0, "per_device": 0.0}
    for kind, label in KIND_LABELS:
        row = plan["state"][kind]
        if kind == "master" and not row["whole"]:
            continue
        if kind == "acts":
            lines.append(f"  {'total':<36}{format_bytes(total['whole']):>12}{format_bytes(total['per_node']):>16}"
                         f"{format_bytes(total['per_device']):>14}")
        else:
            total = {k: total[k] + row[k] for k in total}
        text = label.format(p=plan["precision"], o=plan["optimizer_name"])
        mark = "" if row["partitioned"] else "  (whole on every device: the stage does not split it)"
        lines.append(f"  {text:<36}{format_bytes(row['whole']):>12}{format_bytes(row['per_node']):>16}"
                     f"{format_bytes(row['per_device']):>14}{mark}")
    return lines + [""]


def _working_lines(plan: dict) -> list[str]:
    w, mc = plan["working"], plan["machine"]
    name, rows, cols = w["paper_matrix"]
    tiles = w["tiles"]
    picked = (f"zinfjax, tiles={tiles} (the fewest that keep it within {100 * w['fraction']:g}% of "
              f"{format_bytes(mc['device_memory'])}): {format_bytes(w['tiled']['bytes'])}, the {w['tiled']['unit']}"
              if tiles else f"zinfjax: no tile count keeps it within {100 * w['fraction']:g}% of the device's memory")
    return ["working memory per device:",
            f"  the paper's (params + gradients of the largest matrix, {name} = {rows} x {cols}, untiled): "
            f"{format_bytes(w['paper'])}",
            f"  zinfjax, untiled: {format_bytes(w['untiled']['bytes'])}, the {w['untiled']['unit']} "
            f"({w['untiled']['params']:,} parameters; {w['samples_per_device']} sequence(s) a device)",
            f"  {picked}", ""]


def _class_lines(plan: dict) -> list[str]:
    lines = [f"{'fewest nodes that hold the state':<34}{'nodes':>6}{'step s':>10}{'peak':>7}  placement"]
    for c in plan["classes"]:
        peak = "-" if c["peak_fraction"] is None else f"{100 * c['peak_fraction']:.1f}%"
        nodes = "-" if c["nodes"] is None else str(c["nodes"])
        lines.append(f"  {c['class']:<32}{nodes:>6}{_seconds(c['step_s']):>10}{peak:>7}  {_tiers(c['tiers'])}")
    if any(c["nodes"] is None for c in plan["classes"]):
        limit = plan["nodes_available"]
        lines.append(f"  (-: no number of nodes{f' up to {limit}' if limit else ''} holds it in that class: what a "
                     "device or node must keep whatever the nodes, such as its own activation checkpoints, is too "
                     "large)")
    return lines + [""]


def format_machine_plan(plan: dict, top: int = 12) -> str:
    """The plan for a described machine as text: the model states, the working memory, the fewest nodes of each
    placement class, and the fastest placements that fit on the plan's nodes."""
    lines = _machine_lines(plan) + _state_lines(plan) + _working_lines(plan) + _class_lines(plan)
    lines.append(f"placements on {plan['nodes']} node(s):")
    lines.append(f"{'params':<8}{'optimizer':<10}{'gradients':<10}{'activations':<12}{'fits':<6}{'step s':>9}"
                 f"{'compute':>9}{'host':>9}{'nvme':>9}{'network':>9}{'peak':>7}  short")
    shown = shown_placements(plan["placements"], top)
    for r in shown:
        t = r["tiers"]
        short = ", ".join(f"{k} {format_bytes(v)}" for k, v in r["short"].items())
        lines.append(f"{t['params']:<8}{t['optimizer']:<10}{t['gradients']:<10}{t['activations']:<12}"
                     f"{'yes' if r['fits'] else 'no':<6}{_seconds(r['step_s']):>9}{_seconds(r['compute_s']):>9}"
                     f"{_seconds(r['host_copy_s']):>9}{_seconds(r['nvme_io_s']):>9}{_seconds(r['network_s']):>9}"
                     f"{100 * r['peak_fraction']:>6.1f}%  {short}")
    lines += more_placements(plan["placements"], shown)
    rec = plan["recommended"]
    lines += ["", f"recommended: {_tiers(rec['tiers'])} (predicted {_seconds(rec['step_s'])} s/step, "
              f"{100 * rec['peak_fraction']:.1f}% of peak)"]
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def shown_placements(placements: list, top: int) -> list:
    """The placements a table shows: those that fit first, then those that do not, ``top`` in all."""
    shown = [r for r in placements if r["fits"]][:top]
    return shown + [r for r in placements if not r["fits"]][:max(0, top - len(shown))]


def more_placements(placements: list, shown: list) -> list[str]:
    """The line that counts the placements a table leaves out (none when it shows them all)."""
    more = len(placements) - len(shown)
    return [f"... {more} more placements (--all shows them, --json gives every figure)"] if more else []
