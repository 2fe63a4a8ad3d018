"""Invariant 1 across ZeRO stages, device counts and tensor parallelism; bandwidth-centric offload; memory figures.

Every run is compared with the reference trainer on one device (the plain in-memory optax
loop). The stage-0 and stage-3 runs on the data axis keep parameters and optimizer state on
the nvme tier, so the stages are shown to compose with the tiers, and their telemetry gives the
per-device nvme bytes.
"""

import collections

import jax
import optax
import pytest

from tests.support.engine_helpers import (
    assert_bitwise,
    batches,
    config,
    engine_run,
    exact_run,
    expected_state_bytes,
    make_engine,
    reference_run,
)
from tests.support.tolerances import assert_run_no_farther
from zinfjax.benchmarks.state_table import abstract_params
from zinfjax.sharding import PERSISTENCE_THRESHOLD

STEPS = 10
# One run per stage by default (1, 2 and 8 devices are run by the per-device tests below); the rest of the
# matrix is ``wide`` (make test-all).
REPRESENTATIVE = {("data:2", 1), ("data:4", 2), ("data:2,model:4", 3)}
DATA_MESHES = ["data:1", "data:2", "data:4", "data:8"]
MESHES = [*DATA_MESHES, "data:2,model:4"]
NVME_STAGES = (0, 3)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(model="gpt2-tiny", **numerics):
        key = (model, tuple(sorted(numerics.items())))
        if key not in cache:
            c = config(model=model, mesh="data:1", **numerics)
            cache[key] = exact_run(c, STEPS), reference_run(c, STEPS)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Engine runs by (mesh, stage, model), each computed once."""
    cache = {}

    def get(mesh, stage, model="gpt2-tiny"):
        if (mesh, stage, model) not in cache:
            tiers = {}
            if stage in NVME_STAGES and mesh in DATA_MESHES:
                tiers = dict(params="nvme", optimizer="nvme", nvme_path=str(tmp_path_factory.mktemp("nvme")))
            cache[mesh, stage, model] = engine_run(config(mesh=mesh, stage=stage, model=model, **tiers), STEPS)
        return cache[mesh, stage, model]

    return get


def assert_matches(exact_and_reference, run) -> None:
    """``run`` is no farther from the float64 loop than the fp32 loop on one device is (tests/support/tolerances.py)."""
    losses, params, _ = run
    assert_run_no_farther(*exact_and_reference, (losses, params))
    assert losses[-1] < losses[0]


@pytest.mark.numeric
@pytest.mark.parametrize("mesh,stage", [
    pytest.param(mesh, stage, marks=() if (mesh, stage) in REPRESENTATIVE else pytest.mark.wide)
    for mesh in MESHES for stage in range(4)])
def test_every_stage_on_every_mesh_equals_the_reference(reference, runs, mesh, stage):
    assert_matches(reference(), runs(mesh, stage))


@pytest.mark.numeric
@pytest.mark.wide
def test_llama_with_tensor_parallelism_at_stage3_equals_the_reference(reference, runs):
    assert_matches(reference("llama-tiny"), runs("data:2,model:4", 3, "llama-tiny"))


@pytest.mark.numeric
@pytest.mark.slow
def test_stage3_on_nvme_with_spooled_clipping_and_accumulation(reference, tmp_path):
    """Sharded gradients go through the gradient tier and the second sweep."""
    numerics = dict(grad_clip=0.05, grad_accum=2)
    tiers = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme", nvme_path=str(tmp_path))
    run = engine_run(config(mesh="data:4", stage=3, **numerics, **tiers), STEPS)
    assert_matches(reference(**numerics), run)
    assert run[2][-1]["read_bytes_nvme"] > 0


@pytest.mark.wide
def test_tiers_do_not_change_a_sharded_run(runs, tmp_path):
    """Stage 3 on nvme is bitwise the same run as stage 3 in device memory: the operation order is unchanged."""
    losses, params, _ = runs("data:4", 3)
    device = engine_run(config(mesh="data:4", stage=3), STEPS)
    assert device[0] == losses
    assert_bitwise(device[1], params)


def _per_device(runs, stage: int, op: str, counts) -> dict[int, int]:
    return {n: runs(f"data:{n}", stage)[2][-1][f"{op}_bytes_nvme_per_device"] for n in counts}


# make test checks 1, 2 and 8 devices, whose runs the tests above share but for two (data:1 at stage 3, data:8 at
# stage 0); the wide form adds 4 devices, two runs of their own, for make test-all.
@pytest.mark.parametrize("counts", [(1, 2, 8), pytest.param((1, 2, 4, 8), marks=pytest.mark.wide)])
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.slow
def test_nvme_bytes_per_device_fall_as_one_over_n_at_stage3(runs, op, counts):
    """Bandwidth-centric partitioning: each device moves only its own shard of each layer.

    Per-device bytes must follow b(N) = R + S/N: S bytes split over the devices and a small
    replicated remainder R (leaves under the persistence threshold). S and R come from N=1, 2;
    every larger N must then land on the curve. At stage 0 every device moves every byte.
    """
    b = _per_device(runs, 3, op, counts)
    split = 2 * (b[1] - b[2])
    rest = b[1] - split
    assert 0 <= rest < 0.1 * b[1]
    for n in counts[2:]:
        assert b[n] == pytest.approx(rest + split / n, rel=1e-12)
    assert len(set(_per_device(runs, 0, op, counts).values())) == 1
    # The process still reads every shard once: no device's shard is read twice, none skipped.
    totals = {runs(f"data:{n}", 3)[2][-1][f"{op}_bytes_nvme"] for n in counts}
    assert len(totals) == 1


def _device_bytes(stores) -> collections.Counter:
    """Bytes of each device's addressable shards, over every layer of ``stores``."""
    per_device: collections.Counter = collections.Counter()
    for store in stores:
        for i in range(store.num_layers):
            for x in jax.tree.leaves(store.read(i).result()):
                for shard in x.addressable_shards:
                    per_device[shard.device] += shard.data.nbytes
    return per_device


# ZeRO's bytes per parameter: p params, g grads, K optimizer state (with the fp32 master under bf16).
PRECISION_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 4, 12)}  # gradients stay fp32 in the gradient tier


# make test takes each stage once and each precision twice (bf16, whose fp32 master counts in K, at stages 1 and
# 3); the other four corners of stage x precision are wide, for make test-all.
FORMULA_CASES = {(3, "bf16")}


@pytest.mark.parametrize("stage,precision", [
    pytest.param(stage, precision, marks=() if (stage, precision) in FORMULA_CASES else pytest.mark.wide)
    for precision in ("fp32", "bf16") for stage in range(4)])
def test_model_state_per_device_follows_zero_formulas(stage, precision):
    """Adam on 8 devices: ZeRO's stage formulas on the shardable part, plus the leaves under the
    persistence threshold whole on every device, plus Adam's step counts.

    fp32: params 4Ψ, grads 4Ψ, K = 8 (m, v). bf16: params 2Ψ, grads 4Ψ, K = 12 (master, m, v).
    """
    n = 8
    c = config(mesh="data:8", stage=stage, grad_clip=1e6, precision=precision)  # clipping spools gradients
    engine = make_engine(c)
    try:
        engine.train_step(next(batches(c)))
        s = engine.stores
        kinds = [s.params, s.grads, s.opt, *([s.master] if precision == "bf16" else [])]
        per_device = _device_bytes([store for kind in kinds for store in kind.values()])
        held = sum(x.nbytes for x in engine.globals)  # the global optimizer state (Adam's count), whole in memory
        per_device = collections.Counter({d: b + held for d, b in per_device.items()})
    finally:
        engine.close()
    assert len(per_device) == n and len(set(per_device.values())) == 1
    abstract = abstract_params(c.model)
    p, g, k = PRECISION_BYTES[precision]
    expected = expected_state_bytes(abstract, optax.adamw(c.lr), stage, n, p, g, k, PERSISTENCE_THRESHOLD)
    assert per_device.most_common(1)[0][1] == expected
