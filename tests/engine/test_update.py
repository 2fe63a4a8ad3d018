"""A step's optimizer side (`zinfjax.engine._update`), on its own: what an update reads, which buffers it donates,
the gradients it is given and what it writes back, the sweeps and the step's end.

`Updates` acts on an engine through the attributes a `StepEngine` has and the calls of a `StepIO`: here a real
2-layer program and its `UpdatePlan`, with stores, unit functions and I/O that record what they are asked.
The engine's own tests (tests/engine/) hold the same code to the in-memory reference through whole steps."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zinfjax import Config
from zinfjax.engine._step_io import StepIO
from zinfjax.engine._update import Updates, on_host
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.parts import Part
from zinfjax.engine.reuse import Held
from zinfjax.program import UpdatePlan, split
from zinfjax.store.base import done_future

BLOCKS, EMBED, HEAD = "s:blocks", "w:embed", "w:head"
B, W, E, H = 0, 1, 2, 3  # leaves: blocks/b (2x3), blocks/w (2x3x3), embed (4x3), head (3x2)


def _layer(h, wb):
    return jnp.tanh(h @ wb["w"] + wb["b"][None]), None


def _lm(p, x):
    h, _ = jax.lax.scan(_layer, x @ p["embed"], p["blocks"])
    return jnp.sum(h @ p["head"])


@functools.cache
def _program():
    params = {"embed": jnp.ones((4, 3)), "blocks": {"w": jnp.ones((2, 3, 3)), "b": jnp.ones((2, 3))},
              "head": jnp.ones((3, 2))}
    return split(_lm, params, jnp.ones((2, 4)))


@functools.cache
def _plan(name: str = "adam") -> UpdatePlan:
    return UpdatePlan({"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-3)}[name], _program())


class PlanWith:
    """A plan with some leaves frozen, or more sweeps and crosses than it has: the rest is the real plan's."""

    def __init__(self, plan, frozen=(), sweeps=None, crosses=()):
        self._plan, self.frozen, self._crosses = plan, frozenset(frozen), list(crosses)
        self.sweeps = plan.sweeps if sweeps is None else sweeps
        self.crosses = self._crosses or plan.crosses

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def frozen_group(self, group: str) -> bool:
        return all(k in self.frozen for k in _program().groups[group].leaves)

    def crosses_of(self, group: str, sweep: int) -> list:
        return [c for c in self.crosses if c.group == group and c.phase == sweep]

    def totals_before(self, sweep: int) -> list:
        return [c.out for c in self.crosses if c.phase < sweep]


class Store:
    """A store that says what its tier does with a read's buffers, and serves fixed slices."""

    def __init__(self, tier: str = "nvme", hands: bool = True, slices: dict | None = None):
        self.tier, self.hands, self.slices = tier, hands, slices or {}

    def tier_at(self, i: int) -> str:
        return self.tier

    def hands_over(self, i: int) -> bool:
        return self.hands

    def part_nbytes(self, keys=None) -> int:
        return 0

    def read(self, i: int, keys=None, memory_kind: str = "device"):
        return done_future(self.slices[i])


class Units:
    """Unit functions that record their calls: the update subtracts the gradient from the master."""

    def __init__(self, plan, mixed: bool):
        self.plan, self.mixed, self.updates = plan, mixed, []

    def paths(self, group: str, part=None):
        leaves = [leaf for leaf in _program().leaves_of(group) if part is None or leaf.index in part]
        return [leaf.path for leaf in leaves], [s.path for s in self.plan.part_state(group, part)]

    def size(self, group: str, i: int):
        return None if group.startswith("w:") else 1

    def start(self, group: str, i: int) -> int:
        return 0 if group.startswith("w:") else i

    def spool(self, group: str):
        return lambda grads: ([g.astype(jnp.float32) for g in grads], jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                                                                                        for g in grads])))

    def update(self, group: str, sweep: int, size, donate=(), part=None):
        self.updates.append(SimpleNamespace(group=group, sweep=sweep, size=size, donate=donate, part=part))

        def f(master, grads, state, globals_, totals, start, grad_div):
            new = [m - g / grad_div for m, g in zip(master, grads, strict=True)]
            partials = [jnp.float32(sweep + 1)] * len(self.plan.crosses_of(group, sweep))
            return partials, new, new if self.mixed else [], [s + 1 for s in state]

        return f


def make_engine(plan=None, mixed: bool = False, on_host_: bool = False, spools: bool = False,
                hands: bool | dict = True, opt_tier: str = "nvme", **config):
    """An engine as `Updates` sees it, and the writes its `StepIO` recorded. ``hands``: whether its stores' reads
    may be taken over (`LayerStore.hands_over`), or that by kind (the others: True)."""
    plan = plan or _plan()
    by_kind = hands if isinstance(hands, dict) else {}
    kinds = {kind: {g: Store(opt_tier if kind == "opt" else "nvme", by_kind.get(kind, hands if not by_kind else True))
                    for g in _program().groups}
             for kind in ("params", "opt", "grads") + (("master",) if mixed else ())}
    stores = SimpleNamespace(master=kinds.get("master"), kind=lambda kind: kinds.get(kind, {}), flushed=0)
    stores.flush = lambda: setattr(stores, "flushed", stores.flushed + 1)
    engine = SimpleNamespace(
        program=_program(), update_plan=plan, spools_gradients=spools, on_host=on_host_, host_kind="pinned_host",
        settings=Config(**{"optimizer": opt_tier, "nvme_path": "/nv", **config}).engine_settings(),
        budget=SimpleNamespace(prefetch_depth=config.get("prefetch_depth", 1)), stores=stores,
        units=Units(plan, mixed), handoff=frozenset(), handed_over=Held(), globals=plan.init_globals(),
        loss_scale=LossScale(config.get("precision") == "fp16"), compute_dtype=jnp.bfloat16 if mixed else jnp.float32)
    writes = []
    telemetry = SimpleNamespace(links=[], add_link=lambda n: telemetry.links.append(n), add_reads=lambda reads: None)
    io = StepIO(dispatch=lambda name, layer, fn, *args: fn(*args),
                write=lambda track, store, i, tree, keys=None, from_host=False: writes.append(
                    (track, i, dict(tree), keys, from_host)),
                tied={}, telemetry=telemetry)
    return engine, Updates(engine, io), writes


def part(*leaves: int) -> Part:
    program, plan = _program(), _plan()
    return Part(leaves, tuple(program.leaves[k].path for k in leaves),
                tuple(s.path for s in plan.part_state(BLOCKS, leaves)))


def calls(updates: Updates) -> list:
    """Replaces ``updates.update_unit`` with a recorder of its calls."""
    got = []
    updates.update_unit = lambda group, i, params, grads, upd, part=None: got.append((group, i, params, grads, upd,
                                                                                      part))
    return got


# ---- what an update reads ------------------------------------------------------------------------------------------


def test_a_fused_update_reads_its_units_state_and_master_in_that_order():
    engine, updates, _ = make_engine(mixed=True)
    opt, master = updates.reads(BLOCKS, 1)
    assert (opt.track, opt.store, opt.layer, opt.keys) == ("opt_blocks", engine.stores.kind("opt")[BLOCKS], 1, None)
    assert (master.track, master.store, master.keys) == ("master_blocks", engine.stores.master[BLOCKS], None)
    assert opt.memory_kind == master.memory_kind == "device"
    p = part(W)
    opt, master = updates.reads(BLOCKS, 1, p)
    assert (opt.keys, master.keys) == (("0/mu/blocks/w", "0/nu/blocks/w"), ("blocks/w",))  # the part's own leaves


def test_an_update_without_a_master_or_without_state_reads_only_what_there_is():
    _, fp32, _ = make_engine(mixed=False)
    assert [r.track for r in fp32.reads(BLOCKS, 0)] == ["opt_blocks"]  # the compute copy is the master
    _, sgd, _ = make_engine(plan=_plan("sgd"), mixed=True)
    assert [r.track for r in sgd.reads(BLOCKS, 0)] == ["master_blocks"]  # plain sgd keeps no state


def test_spooled_gradients_and_frozen_groups_read_nothing_for_an_update():
    _, spooled, _ = make_engine(mixed=True, spools=True)
    _, frozen, _ = make_engine(plan=PlanWith(_plan(), frozen={B, W}), mixed=True)
    assert spooled.reads(BLOCKS, 0) == [] and frozen.reads(BLOCKS, 0) == []
    assert [r.track for r in frozen.reads(EMBED, 0)] == ["opt_embed", "master_embed"]


@pytest.mark.parametrize(("host", "tier", "kind"), [(True, "nvme", "pinned_host"), (True, "host", "pinned_host"),
                                                    (False, "nvme", "device")])
def test_the_update_on_the_host_reads_state_off_the_device_into_host_memory(host, tier, kind):
    _, updates, _ = make_engine(mixed=True, on_host_=host, opt_tier=tier, update_on="host" if host else "device")
    assert {r.memory_kind for r in updates.reads(BLOCKS, 0)} == {kind}


def test_the_update_on_the_host_reads_what_lives_on_the_device_into_device_memory():
    _, updates, _ = make_engine(on_host_=True, update_on="host", params="device", gradients="nvme")
    assert (updates._kind("params"), updates._kind("gradients"), updates._kind("optimizer")) == (
        "device", "pinned_host", "pinned_host")


# ---- donation --------------------------------------------------------------------------------------------------------


BF16 = [jnp.zeros(3, jnp.bfloat16)]
FP32 = [jnp.zeros(3, jnp.float32)]


@pytest.mark.parametrize(("mixed", "hands", "grads", "donated"), [
    (False, True, FP32, (0, 2)),  # fp32: the master (the compute copy) and the state, read fresh
    (False, False, FP32, (1,)),  # a tier whose arrays a snapshot holds: the gradient takes the master's place
    (True, True, BF16, (0, 1, 2)),  # the bf16 gradient becomes the compute copy, the master and state their own
    (True, True, FP32, (0, 2)),  # a tied parameter's fp32 gradient would take the master's place: kept
    (True, False, BF16, (1,)),  # neither read may be taken over: the gradient alone
    (True, {"master": False}, BF16, (1,)),  # the state goes only where the master does: it would land in its buffer
    (False, {"params": False}, FP32, (1, 2)),  # fp32: the state goes with the gradient in the master's place
])
def test_an_update_donates_only_what_each_output_takes_over_from_its_own_input(mixed, hands, grads, donated):
    _, updates, _ = make_engine(mixed=mixed, hands=hands)
    assert updates._donated(BLOCKS, 0, True, grads) == donated
    assert updates._donated(BLOCKS, 0, False, grads) == tuple(k for k in donated if k != 2)  # no state, none given


@pytest.mark.parametrize(("tier", "donated"), [("nvme", (2,)), ("host", ())])
def test_the_update_on_the_host_donates_only_state_read_fresh_from_nvme(tier, donated):
    _, updates, _ = make_engine(mixed=True, on_host_=True, opt_tier=tier, update_on="host")
    assert updates._donated(BLOCKS, 0, True, BF16) == donated


# ---- the gradients given, and the updates run ------------------------------------------------------------------------


def test_whole_groups_gradients_add_up_over_stages_and_a_group_without_one_updates_on_zeros():
    engine, updates, _ = make_engine()
    got = calls(updates)
    updates.reads = lambda group, i, part=None: [f"{group}:opt"]
    updates.add_grads({E: jnp.ones((4, 3))})
    updates.add_grads({E: 2 * jnp.ones((4, 3))})  # a tied leaf's share from a later stage
    groups = [engine.program.groups[EMBED], engine.program.groups[HEAD]]
    updates.update_whole(groups, {EMBED: "embed tree", HEAD: "head tree"}, ["w:embed:opt", "w:head:opt"])
    (embed, head) = got
    assert embed[:3] == (EMBED, 0, "embed tree") and embed[4] == ["w:embed:opt"]
    np.testing.assert_array_equal(embed[3][0], 3 * np.ones((4, 3)))
    assert head[:3] == (HEAD, 0, "head tree") and head[4] == ["w:head:opt"]
    assert head[3][0].dtype == jnp.float32 and not np.any(head[3][0]) and head[3][0].shape == (3, 2)
    updates.add_grads({E: jnp.ones((4, 3)), H: jnp.ones((3, 2))})
    updates.discard(EMBED)  # a frozen whole group's gradient is let go
    updates.update_whole(groups, {EMBED: 0, HEAD: 0}, ["a", "b"])
    assert not np.any(got[2][3][0]) and np.all(got[3][3][0] == 1)


def test_a_unit_updated_in_parts_hands_each_part_its_gradients_and_forgets_the_unit_after_the_last():
    _, updates, _ = make_engine()
    got = calls(updates)
    gb, gw = jnp.full((3,), 1.0), jnp.full((3, 3), 2.0)
    updates.hold(BLOCKS, 1, "tree", {B: gb, W: gw})
    updates.update_part(BLOCKS, 1, part(W), ["w reads"])
    updates.update_part(BLOCKS, 1, part(B), ["b reads"])
    assert [(g, i, t, u, p.leaves) for g, i, t, _, u, p in got] == [
        (BLOCKS, 1, "tree", ["w reads"], (W,)), (BLOCKS, 1, "tree", ["b reads"], (B,))]
    assert got[0][3][0] is gw and got[1][3][0] is gb
    with pytest.raises(KeyError):
        updates.update_part(BLOCKS, 1, part(B), [])


def test_a_frozen_leafs_gradient_waits_for_no_part():
    _, updates, _ = make_engine(plan=PlanWith(_plan(), frozen={W}))
    got = calls(updates)
    updates.hold(BLOCKS, 0, None, {B: jnp.ones(3), W: jnp.ones((3, 3))})
    updates.update_part(BLOCKS, 0, part(B), [])
    assert len(got) == 1 and (BLOCKS, 0) not in updates._pending  # nothing left for the frozen leaf


def test_a_fused_update_writes_the_new_compute_copy_and_state_and_hands_it_over_where_planned():
    engine, updates, writes = make_engine()
    engine.handoff = frozenset({(BLOCKS, 1)})
    params = {"blocks/b": jnp.full((3,), 5.0), "blocks/w": jnp.full((3, 3), 5.0)}
    opt = {s.path: jnp.zeros(np.shape(params[s.path.split("/", 2)[2]])) for s in _plan().state_of(BLOCKS)}
    updates.update_unit(BLOCKS, 1, params, [jnp.ones(3), jnp.ones((3, 3))], [opt])
    (call,) = engine.units.updates
    assert (call.group, call.sweep, call.size, call.donate, call.part) == (BLOCKS, 0, 1, (0, 2), None)
    assert [(track, i, keys) for track, i, _, keys, _ in writes] == [("params_blocks", 1, None),
                                                                      ("opt_blocks", 1, None)]
    assert writes[0][2]["blocks/w"].tolist() == [[4.0] * 3] * 3  # 5 - 1: the update ran on the master it was given
    assert all(np.all(x == 1) for x in writes[1][2].values())
    handed = engine.handed_over.slot((BLOCKS, 1), 0).read(1).result()
    assert handed.keys() == writes[0][2].keys()
    updates.update_unit(BLOCKS, 0, params, [jnp.ones(3), jnp.ones((3, 3))], [opt])
    assert not engine.handed_over.has((BLOCKS, 0))  # not planned: the next forward reads it from its store


def test_under_mixed_precision_the_master_is_read_and_written_beside_the_compute_copy():
    engine, updates, writes = make_engine(mixed=True)
    master = {"embed": jnp.full((4, 3), 2.0)}
    opt = {s.path: jnp.zeros((4, 3)) for s in _plan().state_of(EMBED)}
    updates.update_unit(EMBED, 0, {"embed": "the compute copy, not read"}, [jnp.ones((4, 3))], [opt, master])
    assert [w[0] for w in writes] == ["params_embed", "master_embed", "opt_embed"]
    assert np.all(writes[1][2]["embed"] == 1.0)


def test_spooled_gradients_go_to_the_gradient_tier_and_a_frozen_group_writes_nothing():
    engine, updates, writes = make_engine(spools=True)
    updates.update_unit(BLOCKS, 1, None, [jnp.ones(3, jnp.bfloat16), jnp.full((3, 3), jnp.inf)], [])
    assert [(track, i, sorted(tree)) for track, i, tree, _, _ in writes] == [
        ("grads_blocks", 1, ["blocks/b", "blocks/w"])]
    assert writes[0][2]["blocks/b"].dtype == jnp.float32 and engine.units.updates == []
    assert [bool(f) for f in updates._finite] == [False]
    _, frozen, frozen_writes = make_engine(plan=PlanWith(_plan(), frozen={B, W}))
    frozen.update_unit(BLOCKS, 0, None, [], [])
    assert frozen_writes == [] and frozen.engine.units.updates == []


def test_a_sweep_before_the_last_collects_its_partials_and_writes_nothing():
    cross = SimpleNamespace(out="norm", group=BLOCKS, phase=0, how="sum")
    engine, updates, writes = make_engine(plan=PlanWith(_plan(), sweeps=2, crosses=[cross]))
    unit = [jnp.ones(3), jnp.ones((3, 3))]
    state = [jnp.zeros(3), jnp.zeros((3, 3))] * 2  # adam's mu and nu of b and w
    for i in (0, 1):
        updates._apply(BLOCKS, i, unit, unit, state, 0, [], np.float32(1))
    assert writes == [] and [float(x) for x in updates._partials["norm"]] == [1.0, 1.0]  # one per unit
    updates._apply(BLOCKS, 0, unit, unit, state, 1, [], np.float32(1))
    assert [w[0] for w in writes] == ["params_blocks", "opt_blocks"]  # the last sweep writes


# ---- the step's end --------------------------------------------------------------------------------------------------


def test_the_steps_end_returns_the_optimizers_next_global_state():
    engine, updates, _ = make_engine()
    assert [int(x) for x in updates.finish()] == [1]  # adam's count, one step on
    assert engine.stores.flushed == 0  # fused updates: nothing spooled to wait for


def test_an_fp16_overflow_skips_the_step_and_halves_the_loss_scale():
    engine, updates, _ = make_engine(spools=True, precision="fp16")
    updates._sweep = lambda sweep: pytest.fail("a skipped step runs no sweep")
    updates._finite = [jnp.bool_(True), jnp.bool_(False)]
    scale = engine.loss_scale.value
    assert updates.finish() is None
    assert engine.loss_scale.value == scale / 2 and engine.stores.flushed == 0


def test_spooled_gradients_land_before_the_sweeps_read_them():
    engine, updates, _ = make_engine(plan=PlanWith(_plan(), sweeps=2), spools=True, precision="fp16")
    swept = []
    updates._sweep = lambda sweep: swept.append((sweep, engine.stores.flushed))
    updates._finite = [jnp.bool_(True)]
    assert [int(x) for x in updates.finish()] == [1]
    assert swept == [(0, 1), (1, 1)] and engine.loss_scale.good == 1


def test_a_sweep_reads_every_trainable_units_master_gradient_and_state_and_divides_by_the_loss_scale():
    plan = PlanWith(_plan(), frozen={E})  # the embedding is frozen: no sweep reads or updates it
    engine, updates, _ = make_engine(plan=plan, mixed=True, spools=True, precision="fp16", prefetch_depth=2)
    for kind in ("master", "grads", "opt"):
        for g in (BLOCKS, HEAD):
            n = engine.program.groups[g].length
            paths = ([s.path for s in plan.state_of(g)] if kind == "opt"
                     else [leaf.path for leaf in engine.program.leaves_of(g)])
            engine.stores.kind(kind)[g].slices = {i: {p: f"{kind}{i}:{p}" for p in paths} for i in range(n)}
    applied = []
    updates._apply = lambda group, i, master, grads, state, sweep, totals, grad_div, **kw: applied.append(
        (group, i, master, grads, state, sweep, grad_div))
    updates._sweep(0)
    assert [(g, i) for g, i, *_ in applied] == [(BLOCKS, 0), (BLOCKS, 1), (HEAD, 0)]
    group, i, master, grads, state, sweep, grad_div = applied[1]
    assert master == ["master1:blocks/b", "master1:blocks/w"] and grads == ["grads1:blocks/b", "grads1:blocks/w"]
    assert state == [f"opt1:{s.path}" for s in plan.state_of(BLOCKS)] and sweep == 0
    assert float(grad_div) == engine.loss_scale.value == 2.0**16


# ---- the host link -------------------------------------------------------------------------------------------------


def test_an_array_is_on_the_host_only_in_a_host_memory_kind():
    x = jnp.ones(3)
    host = jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    assert on_host(host) and not on_host(x) and not on_host(np.ones(3))


def test_the_update_on_the_host_moves_what_is_on_the_device_down_and_the_compute_copy_up_on_the_last_sweep():
    engine, updates, _ = make_engine(mixed=True, on_host_=True, update_on="host", params="device")
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    master = [jax.device_put(jnp.ones((4, 3)), host)]  # 48 bytes, in host memory already
    grads, state = [jnp.ones((4, 3), jnp.bfloat16)], [jnp.ones((4, 3))]  # 24 and 48 bytes on the device
    assert updates._link_bytes(master, grads, state, sweep=0) == 24 + 48 + 12 * 2  # and 12 bf16 parameters up
    engine.settings = engine.settings.replace(tiering=engine.settings.tiering.replace(params="host"))
    assert updates._link_bytes(master, grads, state, sweep=0) == 24 + 48  # the copy stays in host memory
