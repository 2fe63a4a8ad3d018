"""What a step costs beyond its arithmetic: no second copy of the state, no slow dispatch.

**Donation.** The device tier, and the host tier on the CPU backend, hand the update the arrays they hold; the
update takes those buffers over (JAX donation) and its outputs replace them in the store, so a step
needs no second copy of a layer's master and optimizer state. Checked by buffer address: after a
step the stores hold their state in the buffers they held before. Without donation only the
buffers the allocator happened to hand back again match (measured: 6-33 of 142 state buffers).
`test_checkpoint_memory` checks the other side: a layer a save still holds is not taken over, and
the save writes the state it took.

**No copies.** JAX pairs each output of the update with the first donated argument of its shape and
dtype, in argument order. A donation that pairs an output with another role's input (the new master
with Adam's old m) makes XLA copy that input before the update may overwrite it; so does a second
output of the same values (the compute copy beside the master in fp32). Every update a step runs
compiles without a copy.

**No donated reads in place.** On the CPU backend the nvme tier reads a chunk into an array XLA then
adopts. XLA cannot take such memory over: donated, it is copied into a fresh buffer before the update
runs (Adam's m and v of 64 MB: 77 ms against 34 ms undonated). No update is handed one.

**Dispatch.** JAX dispatches a compiled function from C++ when every output is an array; a float0
output (the cotangent of an integer input, such as a vocabulary chunk's index) sends each call down
the slower Python path instead. The stage backwards return None for those
(`zinfjax.program.stages.without_float0`), so every function a step runs has its C++ entry: one
per signature, which `_cache_size` counts (0 when the call went the Python way).
"""

import re

import jax
import pytest

from tests.support.engine_helpers import batches, config, make_engine
from zinfjax.program.stages import StageFunctions


def _addresses(engine, kind: str) -> set[int]:
    found = set()
    for store in engine.stores.kind(kind).values():
        for i in range(store.num_layers):
            found |= {x.unsafe_buffer_pointer() for x in jax.tree.leaves(store.read(i).result())}
    return found


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_update_keeps_master_and_optimizer_state_in_their_buffers(tier, precision):
    c = config(mesh="data:1", precision=precision, params=tier, optimizer=tier, gradients=tier, activations=tier)
    engine = make_engine(c)
    data = batches(c)
    master = "master" if precision == "bf16" else "params"  # in fp32 the parameters are the master
    try:
        engine.train_step(next(data))
        before = {kind: _addresses(engine, kind) for kind in (master, "opt")}
        engine.train_step(next(data))
        after = {kind: _addresses(engine, kind) for kind in (master, "opt")}
    finally:
        engine.close()
    for kind, old in before.items():
        kept = len(old & after[kind]) / len(old)
        assert kept >= 0.9, (kind, len(old), len(old & after[kind]))  # measured: 71 of 71, 138 of 142


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_every_stage_function_a_step_runs_dispatches_from_cpp(recompute):
    c = config(mesh="data:1", params="host", optimizer="host", gradients="host", activations="host",
               recompute=recompute)
    engine = make_engine(c)
    data = batches(c)
    try:
        for _ in range(2):
            engine.train_step(next(data))
        fns = engine.stage_fns
        names = [n for n in vars(StageFunctions) if n.startswith(("whole_", "scan_"))]
        ran = {(n, s.position): getattr(fns, n)(s.position) for s in engine.program.stages for n in names
               if n.startswith(s.kind) and (n.endswith(("saving", "saved")) == engine.saves_residuals)}
        sizes = {key: fn._cache_size() for key, fn in ran.items()}
    finally:
        engine.close()
    assert len(sizes) == 2 * len(engine.program.stages), sizes  # a forward and a backward per stage
    assert all(n == 1 for n in sizes.values()), sizes


def _compiled_copies(fn, args) -> int:
    """``copy`` instructions in ``fn`` compiled for ``args``' shapes, dtypes and shardings (donated arrays are
    deleted by then; their avals remain)."""
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, args)
    return len(re.findall(r"= \S+ copy\(", fn.lower(*like).compile().as_text()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_update_is_handed_an_array_the_nvme_tier_read_in_place(tmp_path, precision):
    c = config(mesh="data:1", precision=precision, params="nvme", optimizer="nvme", activations="nvme",
               nvme_path=str(tmp_path / "nvme"))
    engine = make_engine(c)
    data = batches(c)
    given = []  # (update, array) for each array an update took that the nvme tier read in place
    dispatch = engine._dispatch

    def recorded(name, layer, fn, *args):
        if name.startswith("update_"):
            in_place = _read_in_place(engine)
            given.extend((name, x) for x in jax.tree.leaves(args)
                         if isinstance(x, jax.Array) and not x.is_deleted() and x.unsafe_buffer_pointer() in in_place)
        return dispatch(name, layer, fn, *args)

    try:
        engine.train_step(next(data))
        engine._dispatch = recorded
        engine.train_step(next(data))
        taken = [name for name, x in given if x.is_deleted()]  # a donated array is deleted once dispatched
    finally:
        engine.close()
    assert len(given) >= 10, len(given)  # master and optimizer state of every layer read in place
    assert not taken, taken


def _read_in_place(engine) -> set[int]:
    """The addresses of the arrays the engine's nvme stores read into (`zinfjax.store.recycle.ReadBuffers`)."""
    return {v.ctypes.data for store in engine.stores.pieces() if store.tier == "nvme"
            for views in store._read_buffers._views.values() for v in views}


# make test takes each tier and each precision once (bf16 on nvme: the master and its compute copy in stores of
# their own); fp32 on nvme and bf16 on host are wide, for make test-all.
@pytest.mark.parametrize("precision,tier", [("fp32", "host"), ("bf16", "nvme"),
                                            pytest.param("fp32", "nvme", marks=pytest.mark.wide),
                                            pytest.param("bf16", "host", marks=pytest.mark.wide)])
def test_every_update_a_step_runs_compiles_without_a_copy(tmp_path, tier, precision):
    c = config(mesh="data:1", precision=precision, params=tier, optimizer=tier, activations=tier,
               nvme_path=str(tmp_path / "nvme"))
    engine = make_engine(c)
    data = batches(c)
    updates = []
    dispatch = engine._dispatch

    def recorded(name, layer, fn, *args):
        if name.startswith("update_"):
            updates.append((name, fn, args))
        return dispatch(name, layer, fn, *args)

    try:
        engine.train_step(next(data))
        engine._dispatch = recorded
        engine.train_step(next(data))
        copies = {name: _compiled_copies(fn, args) for name, fn, args in updates}
    finally:
        engine.close()
    assert len(copies) >= 3, copies  # the layers, the vocabulary chunks and the whole groups
    assert not any(copies.values()), copies
