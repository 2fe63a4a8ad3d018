"""The DeepSpeed run's optimizer, checked to be the AdamW that zinfjax's ``adamw`` computes.

zinfjax's ``adamw`` is ``optax.adamw(lr, weight_decay=wd)``: b1 0.9, b2 0.999, eps 1e-8 added
after the square root, bias correction, decoupled weight decay. torch's ``AdamW`` and DeepSpeed's
``Adam``/``AdamW`` (``adam_w_mode``, the default) compute the same update from the same
``exp_avg`` (optax's ``mu``), ``exp_avg_sq`` (``nu``) and ``step`` (``count``). Anything else is
refused, naming the setting, rather than converted into a run that would train differently.

Example (the torch optimizer's parameter groups, as a DeepSpeed checkpoint holds them, and the run's config):
    >>> param_groups = [{"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "params": [0]}]
    >>> ds_config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}}
    >>> adam = adam_settings(param_groups, ds_config, source="runs/ds/global_step100")
    >>> adam.lr, adam.weight_decay
    (0.0003, 0.1)
    >>> adam_settings([{**param_groups[0], "betas": (0.8, 0.999)}], ds_config, source="runs/ds/global_step100")
    Traceback (most recent call last):
    zinfjax_interop.ds_adam.UnsupportedOptimizerError: runs/ds/global_step100, parameter group 0: ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zinfjax_interop.errors import ConversionError

BETAS = (0.9, 0.999)
EPS = 1e-8


class UnsupportedOptimizerError(ConversionError):
    """The DeepSpeed run's optimizer is not the AdamW that zinfjax's ``adamw`` computes."""


@dataclass(frozen=True)
class AdamSettings:
    lr: float
    weight_decay: float


def adam_settings(param_groups: list[dict], ds_config: dict, source: str, lr: float | None = None,
                  weight_decay: float | None = None) -> AdamSettings:
    """The learning rate and weight decay of an AdamW run; raises `UnsupportedOptimizerError` otherwise.

    ``param_groups`` are the torch optimizer's (empty for an elastic checkpoint: then the DeepSpeed
    config's ``optimizer.params`` is used). ``lr`` / ``weight_decay`` override differing groups.
    """
    section = ds_config.get("optimizer") or {}
    kind = str(section.get("type", "")).lower()
    if kind and kind not in ("adam", "adamw"):
        raise UnsupportedOptimizerError(f"{source} was trained with the DeepSpeed optimizer {section.get('type')!r}; "
                                        "zinfjax converts Adam/AdamW state only")
    for i, g in enumerate(param_groups):
        if not {"betas", "eps"} <= set(g):
            raise UnsupportedOptimizerError(f"{source}, parameter group {i}: not an Adam optimizer (its settings "
                                            f"are {', '.join(sorted(k for k in g if k != 'params'))})")
    groups = param_groups or [dict(section.get("params") or {})]
    for i, g in enumerate(groups):
        _check_group(g, f"{source}, parameter group {i}", _decoupled(g, kind, section.get("params") or {}))
    return AdamSettings(_one(groups, "lr", lr, source), _one(groups, "weight_decay", weight_decay, source))


def _check_group(g: dict[str, Any], where: str, decoupled: bool | None) -> None:
    betas = tuple(float(b) for b in g.get("betas", BETAS))
    problems = []
    if betas != BETAS:
        problems.append(f"betas={betas} (zinfjax's adamw uses {BETAS})")
    if float(g.get("eps", EPS)) != EPS:
        problems.append(f"eps={g['eps']} (zinfjax's adamw uses {EPS})")
    for key in ("amsgrad", "maximize"):
        if g.get(key):
            problems.append(f"{key}=True")
    if g.get("bias_correction") is False:
        problems.append("bias_correction=False")
    if float(g.get("weight_decay", 0.0)) and decoupled is not True:
        problems.append("L2 weight decay (torch.optim.Adam); zinfjax's adamw decays decoupled, as AdamW"
                        if decoupled is False else "weight decay of unknown kind (is it AdamW?)")
    if problems:
        raise UnsupportedOptimizerError(f"{where}: {'; '.join(problems)}. zinfjax's Config has no key for these, "
                                        "so the converted run would train differently")


def _decoupled(g: dict, kind: str, params: dict) -> bool | None:
    """Whether weight decay is AdamW's (decoupled); None where nothing in the checkpoint says."""
    if "decoupled_weight_decay" in g:  # torch >= 2.6: Adam and AdamW say which they are
        return bool(g["decoupled_weight_decay"])
    if kind == "adamw":
        return True
    if kind == "adam":  # DeepSpeed's FusedAdam / CPUAdam: adam_w_mode defaults to True
        return bool(params.get("adam_w_mode", True))
    return None


def _one(groups: list[dict], key: str, override: float | None, source: str) -> float:
    if override is not None:
        return float(override)
    values = sorted({float(g[key]) for g in groups if key in g})
    if not values:
        raise UnsupportedOptimizerError(f"{source} records no optimizer {key} (an elastic checkpoint without "
                                        f"an optimizer section in its DeepSpeed config): pass {key}=")
    if len(values) > 1:
        raise UnsupportedOptimizerError(f"{source}: the parameter groups use {key} {values}; zinfjax has one "
                                        f"{key} for all parameters: pass {key}= to choose it")
    return values[0]
