"""The sliced evaluation of a whole-tree jaxpr (`zinfjax.program.slicing`), tested on its own: tags and phases
(`analyze`), what it refuses, and the `SlicedEvaluator` run unit by unit with `combine` between sweeps, bitwise
the whole-tree computation where the arithmetic is exact.

`tests/program/test_optimizers.py` holds real optax transformations to their whole-tree update through
`UpdatePlan`; these tests take the module's rules one at a time, on jaxprs of a line or two."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from zinfjax.program import jaxpr as jx
from zinfjax.program.slicing import (
    UNTAGGED,
    Info,
    NotStreamableError,
    SlicedEvaluator,
    Tag,
    Window,
    analyze,
    combine,
    cond_operands,
)

G = "s:blocks"  # a streamed group; messages name it without its prefix
STREAMED = Tag(G, 0)


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def analyzed(fn, args, tags):
    """``fn`` traced on ``args``, analysed with ``tags`` on its inputs: (closed jaxpr, info, crosses, outputs' Info)."""
    closed = jax.make_jaxpr(fn)(*args)
    known = {v: Info(t) for v, t in zip(closed.jaxpr.invars, tags, strict=True)}
    crosses = []
    info = analyze(closed.jaxpr.eqns, known, crosses)
    outs = [info.get(v, UNTAGGED) if jx.is_var(v) else UNTAGGED for v in closed.jaxpr.outvars]
    return closed, info, crosses, outs


def by_units(fn, args, tags, windows):
    """``fn`` run as the engine runs an update: sweep by sweep, each unit on its window, the partials of each
    sweep's cross eqns combined into totals before the next. Returns (sweeps, each unit's outputs of the last)."""
    closed, info, crosses, outs = analyzed(fn, args, tags)
    jaxpr = closed.jaxpr
    sweeps = 1 + max(o.phase for o in outs)
    totals = {}
    for sweep in range(sweeps):
        partials, results = {}, []
        for window in windows:
            env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
            env.update({v: x if t is None else window.cut(x, t.dim)
                        for v, x, t in zip(jaxpr.invars, args, tags, strict=True)})
            ev = SlicedEvaluator(info, window, dict(totals), sweep, G)
            env = ev.run(jaxpr.eqns, env)
            # A unit records the partials of this sweep's cross eqns, and only those.
            assert set(ev.partials) == {c.out for c in crosses if c.phase == sweep}
            for var, value in ev.partials.items():
                partials.setdefault(var, []).append(value)
            results.append([ev.as_tagged(jx.read(env, v), o.tag) for v, o in zip(jaxpr.outvars, outs, strict=True)])
        totals.update({c.out: combine(c.how, partials[c.out]) for c in crosses if c.phase == sweep})
    return sweeps, results


def layers(n):
    return [Window(i, 1, n) for i in range(n)]


def chunks(full, rows):
    return [Window(s, min(rows, full - s), full) for s in range(0, full, rows)]


def ints(*shape, seed=0):
    """Small integers as float32: sums and maxima of them are exact in any order."""
    return jnp.asarray(np.random.default_rng(seed).integers(-4, 5, shape), jnp.float32)


# ---- tags and phases -------------------------------------------------------------------------------------------


def test_an_elementwise_update_keeps_the_streamed_axis_and_needs_one_sweep():
    _, _, crosses, (out,) = analyzed(lambda w, g: w - 0.1 * jnp.sign(g) * jnp.sqrt(jnp.abs(g)), [f32(4, 3)] * 2,
                                     [STREAMED, STREAMED])
    assert out == Info(STREAMED, 0) and crosses == []


@pytest.mark.parametrize(("reduce", "how"), [(jnp.sum, "sum"), (jnp.max, "max"), (jnp.min, "min"),
                                             (jnp.prod, "prod"), (jnp.all, "and"), (jnp.any, "or")])
def test_a_reduction_over_the_streamed_axis_is_a_cross_combined_by_its_own_operation(reduce, how):
    _, _, (cross,), (out,) = analyzed(lambda w: reduce(w), [f32(4, 3)], [STREAMED])
    assert (cross.group, cross.phase, cross.how) == (G, 0, how)
    assert out == Info(None, 1)  # the same for every unit, once combined: it waits for the next sweep


def test_a_reduction_over_another_axis_keeps_the_streamed_axis_where_it_lands():
    _, _, crosses, (kept, shifted) = analyzed(lambda w, v: (jnp.sum(w, axis=2), jnp.sum(v, axis=0)),
                                              [f32(4, 3, 5), f32(3, 5, 4)], [STREAMED, Tag(G, 2)])
    assert crosses == [] and kept.tag == Tag(G, 0) and shifted.tag == Tag(G, 1)


def test_a_whole_group_reduced_to_a_scalar_is_a_cross_one_unit_holds_whole():
    whole = Tag("w:embed", None)
    _, _, crosses, (total, rows) = analyzed(lambda w: (jnp.sum(w * w), jnp.sum(w, axis=0)), [f32(4, 3)], [whole])
    assert [(c.group, c.how) for c in crosses] == [("w:embed", "only")] and total == Info(None, 1)
    assert rows == Info(whole, 0)  # not a scalar: still the group's data, no cross


def test_each_reduction_that_depends_on_another_adds_a_sweep():
    def twice(w):
        y = w / jnp.sqrt(jnp.sum(w * w))
        return y / jnp.max(jnp.abs(y))

    _, _, crosses, (out,) = analyzed(twice, [f32(4, 3)], [STREAMED])
    assert [(c.how, c.phase) for c in crosses] == [("sum", 0), ("max", 1)]
    assert out == Info(STREAMED, 2)  # three sweeps


@pytest.mark.parametrize(("fn", "shape", "dim", "moved"), [
    (lambda w: w.T, (4, 3), 0, 1),
    (lambda w: w.T, (4, 3), 1, 0),
    (lambda w: w[:, None, :], (4, 3), 0, 0),  # broadcast_in_dim
    (lambda w: w[:, None, :], (4, 3), 1, 2),
    (lambda w: lax.squeeze(w, (1,)), (4, 1, 3), 2, 1),
    (lambda w: lax.squeeze(w, (1,)), (4, 1, 3), 0, 0),
    (lambda w: w.reshape(4, 2, 3), (4, 6), 0, 0),  # a reshape of the axes after the streamed one
])
def test_a_layout_change_moves_the_streamed_axis_with_it(fn, shape, dim, moved):
    _, _, crosses, (out,) = analyzed(fn, [f32(*shape)], [Tag(G, dim)])
    assert out == Info(Tag(G, moved), 0) and crosses == []


def test_a_matrix_product_keeps_a_free_or_batch_streamed_axis_and_crosses_a_contracted_one():
    x = jnp.ones((3, 2))
    _, _, _, (free,) = analyzed(lambda w: w @ x, [f32(4, 3)], [STREAMED])
    _, _, _, (rhs_free,) = analyzed(lambda w: jnp.ones((2, 3)) @ w.T, [f32(4, 3)], [STREAMED])
    _, _, _, (batch,) = analyzed(lambda w, v: lax.dot_general(w, v, (((2,), (1,)), ((0,), (0,)))),
                                 [f32(4, 3, 5), f32(4, 5, 2)], [STREAMED, STREAMED])
    assert (free.tag, rhs_free.tag, batch.tag) == (Tag(G, 0), Tag(G, 1), Tag(G, 0))
    _, _, crosses, (dot,) = analyzed(lambda w, g: jnp.tensordot(w, g, axes=([0, 1], [0, 1])), [f32(4, 3)] * 2,
                                     [STREAMED, STREAMED])
    assert dot == Info(None, 1) and [(c.group, c.how) for c in crosses] == [(G, "sum")]


def test_a_cond_on_a_total_is_computed_a_sweep_later():
    """``apply_if_finite``'s shape: every unit takes the branch the whole tree's gradients choose."""
    _, _, crosses, (out,) = analyzed(lambda w, g: lax.cond(jnp.all(jnp.isfinite(g)), lambda a, b: a - b,
                                                           lambda a, b: a, w, g), [f32(4, 3)] * 2,
                                     [STREAMED, STREAMED])
    assert out == Info(STREAMED, 1) and [c.how for c in crosses] == ["and"]


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "shape", "named"), [
    (lambda w: jnp.cumsum(w, axis=0), (4, 3), "cumsum"),
    (lambda w: jnp.flip(w, axis=0), (4, 3), "rev"),
    (lambda w: jnp.argmax(w, axis=0), (4, 3), "argmax"),
    (lambda w: w.reshape(12), (4, 3), "reshape"),
    (lambda w: jnp.concatenate([w, w], axis=0), (4, 3), "concatenate"),
    (lambda w: lax.squeeze(w, (0,)), (1, 3), "squeeze"),
])
def test_what_mixes_the_layers_is_refused_by_the_operation_and_the_group(fn, shape, named):
    with pytest.raises(NotStreamableError, match=rf"^{named} mixes the slices of blocks along its streamed axis"):
        analyzed(fn, [f32(*shape)], [STREAMED])


def test_an_argmax_or_a_concatenation_along_another_axis_is_not_refused():
    for fn in (lambda w: jnp.argmax(w, axis=1), lambda w: jnp.concatenate([w, w], axis=1)):
        _, _, crosses, (out,) = analyzed(fn, [f32(4, 3)], [STREAMED])
        assert out.tag == STREAMED and crosses == []


def test_two_groups_combined_element_by_element_are_refused_by_name():
    with pytest.raises(NotStreamableError, match=r"add combines parameters of different groups \(s:a, s:b\)"):
        analyzed(lambda w, v: w + v, [f32(4, 3)] * 2, [Tag("s:a", 0), Tag("s:b", 0)])


def test_operands_streamed_along_different_axes_are_refused():
    with pytest.raises(NotStreamableError, match="streamed along different axes"):
        analyzed(lambda w, v: w * v, [f32(4, 4)] * 2, [Tag(G, 0), Tag(G, 1)])


def test_a_cond_that_branches_on_a_leafs_data_or_reduces_inside_a_branch_is_refused():
    with pytest.raises(NotStreamableError, match="branches on data of the leaf"):
        analyzed(lambda s, w: lax.cond(s > 0, lambda a: a, lambda a: -a, w), [f32(), f32(4, 3)],
                 [Tag("w:scale", None), STREAMED])
    with pytest.raises(NotStreamableError, match="reduces over a streamed axis inside a branch"):
        analyzed(lambda p, w: lax.cond(p > 0, lambda a: a / jnp.sum(a), lambda a: a, w), [f32(), f32(4, 3)],
                 [None, STREAMED])
    with pytest.raises(NotStreamableError, match="stream a value along different axes"):
        analyzed(lambda p, w, v: lax.cond(p > 0, lambda a, b: a, lambda a, b: b, w, v), [f32(), f32(4, 4), f32(4, 4)],
                 [None, Tag(G, 0), Tag(G, 1)])


# ---- the sliced evaluator ------------------------------------------------------------------------------------------


def test_a_norm_over_the_layers_runs_in_two_sweeps_bitwise_the_whole():
    fn = lambda w: w / jnp.sqrt(jnp.sum(w * w))  # noqa: E731 - lars' and lamb's shape
    w = ints(4, 3)
    sweeps, units = by_units(fn, [w], [STREAMED], layers(4))
    assert sweeps == 2
    np.testing.assert_array_equal(jnp.concatenate([u[0] for u in units]), fn(w))


def test_a_chain_of_reductions_runs_in_three_sweeps_bitwise_the_whole():
    def fn(w):
        y = w / jnp.sqrt(jnp.sum(w * w))
        return y / jnp.max(jnp.abs(y))

    w = ints(4, 3, seed=1)
    sweeps, units = by_units(fn, [w], [STREAMED], layers(4))
    assert sweeps == 3
    np.testing.assert_array_equal(jnp.concatenate([u[0] for u in units]), fn(w))


def test_row_chunks_cut_a_value_that_spans_the_whole_axis_to_their_own_rows():
    """A constant of the update with the leaf's full streamed axis (a per-row scale) is cut to each unit's rows,
    the last chunk shorter than the others."""
    scale = jnp.arange(5.0)[:, None] * jnp.ones((5, 3))
    fn = lambda w: w * scale + jnp.max(jnp.abs(w))  # noqa: E731
    w = ints(5, 3, seed=2)
    sweeps, units = by_units(fn, [w], [STREAMED], chunks(5, 2))
    assert sweeps == 2 and [u[0].shape for u in units] == [(2, 3), (2, 3), (1, 3)]
    np.testing.assert_array_equal(jnp.concatenate([u[0] for u in units]), fn(w))


def test_a_broadcast_and_a_reshape_are_rewritten_to_the_units_size():
    fn = lambda w: (jnp.broadcast_to(w[:, None, :], (5, 2, 3)) * 2.0).reshape(5, 6)  # noqa: E731
    w = ints(5, 3, seed=3)
    _, units = by_units(fn, [w], [STREAMED], chunks(5, 2))
    assert [u[0].shape for u in units] == [(2, 6), (2, 6), (1, 6)]
    np.testing.assert_array_equal(jnp.concatenate([u[0] for u in units]), fn(w))


@pytest.mark.parametrize("finite", [True, False])
def test_a_cond_on_a_total_takes_the_whole_trees_branch_in_every_unit(finite):
    """One layer's inf sends every layer down the skipping branch, as on the whole tree: a unit that branched on
    its own slice would update the three finite layers."""
    fn = lambda w, g: lax.cond(jnp.all(jnp.isfinite(g)), lambda a, b: a - b, lambda a, b: a, w, g)  # noqa: E731
    w, g = ints(4, 3, seed=4), ints(4, 3, seed=5)
    if not finite:
        g = g.at[2, 1].set(jnp.inf)
    sweeps, units = by_units(fn, [w, g], [STREAMED, STREAMED], layers(4))
    assert sweeps == 2
    np.testing.assert_array_equal(jnp.concatenate([u[0] for u in units]), fn(w, g))
    np.testing.assert_array_equal(fn(w, g), w - g if finite else w)


def test_an_untagged_computation_runs_whole_in_every_unit():
    closed, info, _, _ = analyzed(lambda c, w: (c * 2.0, w + c), [f32(), f32(4, 3)], [None, STREAMED])
    jaxpr = closed.jaxpr
    ev = SlicedEvaluator(info, Window(1, 1, 4), {}, 0, G)
    env = ev.run(jaxpr.eqns, {jaxpr.invars[0]: jnp.float32(3), jaxpr.invars[1]: jnp.ones((1, 3))})
    doubled, shifted = (jx.read(env, v) for v in jaxpr.outvars)
    assert float(doubled) == 6.0 and shifted.tolist() == [[4.0, 4.0, 4.0]] and ev.partials == {}


# ---- windows, totals, cond operands ----------------------------------------------------------------------------------


def test_a_window_cuts_only_what_spans_the_whole_axis():
    whole = jnp.arange(12.0).reshape(6, 2)
    window = Window(2, 3, 6)
    np.testing.assert_array_equal(window.cut(whole, 0), whole[2:5])
    np.testing.assert_array_equal(window.cut(whole.T, 1), whole.T[:, 2:5])
    part = whole[:3]
    assert window.cut(part, 0) is part  # already the unit's size
    assert window.cut(whole, None) is whole and window.cut(whole, 2) is whole  # no streamed axis, or none that deep
    assert Window(0, 6, 6).cut(whole, 0) is whole  # the unit is the whole axis


@pytest.mark.parametrize(("how", "parts", "total"), [
    ("sum", [1.0, 2.0, 4.0], 7.0), ("max", [1.0, 5.0, 4.0], 5.0), ("min", [3.0, 2.0, 4.0], 2.0),
    ("prod", [2.0, 3.0, 4.0], 24.0), ("and", [True, False, True], False), ("or", [False, True, False], True),
])
def test_totals_combine_every_units_partial(how, parts, total):
    assert combine(how, [jnp.asarray(p) for p in parts]).item() == total


def test_a_total_one_unit_holds_is_that_units_value_and_no_other():
    assert combine("only", [jnp.float32(3)]).item() == 3.0
    with pytest.raises(ValueError):
        combine("only", [jnp.float32(3), jnp.float32(4)])


def test_a_conds_outputs_need_only_the_operands_some_branch_reads_for_them():
    fn = lambda p, a, b, c: lax.cond(p > 0, lambda a, b, c: (a + b, c), lambda a, b, c: (a, c * 2.0), a, b, c)  # noqa: E731
    closed = jax.make_jaxpr(fn)(*[f32()] * 4)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    assert cond_operands(eqn, [0]) == [0, 1]  # a + b in one branch, a in the other
    assert cond_operands(eqn, [1]) == [2]
    assert cond_operands(eqn, [0, 1]) == [0, 1, 2]
