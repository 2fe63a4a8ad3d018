"""`zinfjax.planning.scale`: the tile counts the planners offer are counts ``zinfjax train`` takes.

Both planners choose among `zinfjax.models.configs.tile_counts`: ``zinfjax plan --machine`` through
`pick_tiles` (and its shortfall at the most tiles), and ``tiles=auto`` through
`zinfjax.trainers.streaming.choose_tiles`. Each count they can choose is given to the check ``zinfjax
train`` runs on ``tiles=N`` (`zinfjax.trainers.build.run_model`).
"""

import dataclasses
import math
import pathlib

import pytest

from zinfjax.config import Config
from zinfjax.errors import ConfigError
from zinfjax.models.configs import NAMED, ModelConfig
from zinfjax.planning import machine_plan, scale
from zinfjax.planning.machine import load_machine
from zinfjax.planning.machine_plan import WORKING_FRACTION, plan_for_machine
from zinfjax.planning.recommend import PlanError
from zinfjax.trainers.build import run_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "models").glob("*.yaml"))
MODELS = [*NAMED, *EXAMPLES]
H100 = str(ROOT / "examples" / "machines" / "h100-8x.yaml")


def _accepted(spec: str, tiles: int) -> bool:
    """Whether ``zinfjax train`` takes ``tiles=<tiles>`` for model ``spec``: its own check, nothing copied."""
    try:
        _, model_config = run_model(Config.load(None, [f"model={spec}", f"tiles={tiles}"]))
    except ConfigError:
        return False
    return model_config.tiles == tiles


def _seq_len(m: ModelConfig) -> int:
    return min(64, m.max_seq_len)


def _budgets(m: ModelConfig) -> list[int]:
    """Working-memory budgets at which each count that could split the heads is the fewest that fits, and
    budgets below and above them all: every choice `pick_tiles` can make for this model."""
    heads = [t for t in range(1, m.n_heads + 1) if m.n_heads % t == 0]
    need = {scale.largest_unit(m, t, 1, _seq_len(m), "bf16")[1] for t in heads}
    return sorted(need | {1, 10 * max(need)})


def _picks(m: ModelConfig) -> set[int]:
    """The tile counts `zinfjax.planning.scale.pick_tiles` picks for ``m`` over every budget."""
    return {t for b in _budgets(m) if (t := scale.pick_tiles(m, 1, _seq_len(m), "bf16", b)) is not None}


def _machine_picks(spec: str, m: ModelConfig) -> set[int]:
    """The tile counts ``zinfjax plan --machine`` reports for ``m`` on an H100 node whose device memory is cut to
    each budget (a plan that fits nowhere reports none)."""
    config = Config.load(None, [f"model={spec}", "precision=bf16", "stage=3", "micro_batch_size=1",
                                "batch_size=0", f"seq_len={_seq_len(m)}"])
    picks = set()
    for budget in _budgets(m)[1:-1]:
        machine = dataclasses.replace(load_machine(H100), device_memory=math.ceil(budget / WORKING_FRACTION))
        try:
            tiles = plan_for_machine(config, machine)["working"]["tiles"]
        except PlanError:
            continue
        if tiles is not None:
            picks.add(tiles)
    return picks


def _refused(spec: str) -> list[int]:
    m = ModelConfig.resolve(spec)
    offered = set(scale.tile_counts(m)) | _picks(m) | {machine_plan.tile_counts(m)[-1]}
    return sorted(t for t in offered if not _accepted(spec, t))


@pytest.mark.parametrize("spec", MODELS)
def test_every_tile_count_the_planner_offers_is_one_train_takes(spec):
    assert _refused(spec) == []


@pytest.mark.parametrize("spec", ["llama-tiny", "llama-1b"])
def test_plan_machine_tiles_grouped_query_attention_as_train_takes(spec):
    """Grouped-query attention: llama-tiny has 16 query heads over 8 key-value heads, llama-1b 32 over 4. The plan
    for a machine tiles at most that many ways, and each count it reports is one train takes."""
    m = ModelConfig.resolve(spec)
    picks = _machine_picks(spec, m)
    assert picks and max(picks) == m.kv_heads
    assert all(_accepted(spec, t) for t in picks)


def _old_rule(m: ModelConfig) -> list[int]:
    """The planners' rule before: the common divisors of d_ff and n_heads, the key-value heads left out."""
    g = math.gcd(m.d_ff, m.n_heads)
    return [t for t in range(1, g + 1) if g % t == 0]


def test_the_check_catches_the_old_planner_rule(monkeypatch):
    """Under the old rule ``zinfjax plan --machine`` offered llama-1b 8, 16 and 32 tiles (and llama-tiny 16), which
    train refuses: 32 query heads share 4 key-value heads, and a tile takes whole key-value heads."""
    monkeypatch.setattr(scale, "tile_counts", _old_rule)
    monkeypatch.setattr(machine_plan, "tile_counts", _old_rule)
    assert _refused("llama-1b") == [8, 16, 32]
    assert _refused("llama-tiny") == [16]
    assert 8 in _machine_picks("llama-1b", ModelConfig.resolve("llama-1b"))
    with pytest.raises(ConfigError, match="tiles=8 does not divide n_kv_heads=4"):
        run_model(Config.load(None, ["model=llama-1b", "tiles=8"]))
    assert [spec for spec in MODELS if _refused(spec)] == ["llama-tiny", "llama-1b"]


def test_bert_takes_one_tile_alone(tmp_path):
    """BERT's blocks are not tiled: 1 is the only count offered and the only one train takes."""
    path = tmp_path / "bert.yaml"
    path.write_text("arch: bert\nvocab_size: 1000\nmax_seq_len: 64\nd_model: 64\nn_layers: 2\nn_heads: 4\n"
                    "d_ff: 256\n")
    assert scale.tile_counts(ModelConfig.resolve(str(path))) == [1]
    assert _refused(str(path)) == []
    assert not _accepted(str(path), 2)
