"""The records a program is made of (`zinfjax.program.ir`): how a leaf is cut into store slices, and what the
engine reads of a scan (its `Loop`) and of a nested scan's body instead of their equations."""

import dataclasses

import jax
import jax.extend.core as jc
import jax.numpy as jnp
import numpy as np
import pytest

from zinfjax.program import split
from zinfjax.program.ir import Group, Leaf, Loop, Output, Stream, store_slice, unslice
from zinfjax.program.split import _loop

CUTS = [  # (stream, leaf shape, slice shape)
    (Stream(3), (3, 4, 5), (4, 5)),
    (Stream(3, rows=4, pad=2), (10, 5), (4, 5)),
    (Stream(6, tiles=2), (3, 2, 4, 5), (4, 5)),
    (Stream(6, tiles=2, axis=1), (3, 4, 8), (4, 4)),
]


def _leaf(stream, shape) -> Leaf:
    return Leaf(0, "w", shape, np.dtype(np.float32), "s:w", stream)


@pytest.mark.parametrize(("stream", "shape", "cut"), CUTS)
def test_a_streams_slice_shape_is_what_store_slice_cuts(stream, shape, cut):
    leaf = _leaf(stream, shape)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert stream.slice_shape(shape) == leaf.slice_shape == cut
    assert [np.shape(store_slice(leaf, x, i)) for i in range(stream.length)] == [cut] * stream.length


@pytest.mark.parametrize(("stream", "shape", "cut"), CUTS)
def test_unslice_rebuilds_the_leaf_bitwise_from_its_store_slices(stream, shape, cut):
    leaf = _leaf(stream, shape)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(unslice(leaf, [store_slice(leaf, x, i) for i in range(stream.length)]), x)


def test_a_whole_leaf_is_its_own_one_slice():
    x = np.ones((2, 3), np.float32)
    leaf = _leaf(None, (2, 3))
    assert leaf.slice_shape == leaf.opt_shape == (2, 3)
    assert store_slice(leaf, x, 0) is x and unslice(leaf, [x]) is x


def test_the_last_row_chunk_is_padded_with_zero_rows_that_are_not_the_leafs():
    stream, x = Stream(3, rows=4, pad=2), np.ones((10, 5), np.float32)
    last = np.asarray(store_slice(_leaf(stream, (10, 5)), x, 2))
    assert [stream.valid_rows(i, 10) for i in range(3)] == [4, 4, 2]
    assert last[:2].tolist() == x[:2].tolist() and not last[2:].any()
    assert Stream(3).valid_rows(1, 3) == 0  # a stacked leaf has no rows to count


def test_a_tiled_leafs_optimizer_shape_merges_its_layer_and_tile_axes():
    assert _leaf(Stream(6, tiles=2), (3, 2, 4, 5)).opt_shape == (6, 4, 5)
    assert _leaf(Stream(3), (3, 4, 5)).opt_shape == (3, 4, 5)


def test_a_group_is_streamed_by_its_name():
    assert Group("s:blocks", 1, (0,), 12).streamed
    assert not Group("w:embed", 0, (1,), 1).streamed


def test_a_loop_runs_its_iterations_backwards_when_reversed():
    assert Loop(3, False, 0, 1, (), ()).order() == [0, 1, 2]
    assert Loop(3, True, 0, 1, (), ()).order() == [2, 1, 0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Loop(3, False, 0, 1, (), ()).length = 4


def _loss(p, x):
    bias = jnp.sum(x)  # a const of the scan, computed before it

    def layer(h, a):
        w, scale = a
        h = jnp.tanh(h @ w) * scale + bias
        return h, (jnp.sum(h), jnp.int32(3))

    h, (s, _) = jax.lax.scan(layer, x, (p["w"], jnp.arange(3.0)), reverse=True)
    return jnp.sum(h) + jnp.sum(s)


def _scan():
    return split(_loss, {"w": jnp.ones((3, 4, 4))}, jnp.ones((2, 4))).scans()[0]


def test_a_scans_loop_is_its_equation_read_once():
    scan = _scan()
    loop, params = scan.loop, scan.eqn.params
    assert (loop.length, loop.reverse, loop.num_consts, loop.num_carry) == (
        params["length"], params["reverse"], params["num_consts"], params["num_carry"])
    assert [o.var for o in (*loop.carry, *loop.ys)] == list(scan.eqn.outvars)
    assert [o.like for o in loop.ys] == [jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)]
    assert not any(o.dropped for o in (*loop.carry, *loop.ys))
    assert (scan.length, scan.reverse, scan.num_consts, scan.num_carry, scan.order()) == (
        3, True, loop.num_consts, 1, [2, 1, 0])


def test_a_loops_carry_type_is_the_type_of_the_carry_entering_each_iteration():
    """What the engine's activation store holds per iteration (`zinfjax.engine.stores.acts_spec`)."""
    scan = _scan()
    body = scan.eqn.params["jaxpr"].jaxpr
    entering = body.invars[scan.num_consts : scan.num_consts + scan.num_carry]
    assert [c.like for c in scan.loop.carry] == [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in entering]


def test_a_scans_operands_divide_into_consts_carry_and_xs_by_its_loop():
    scan = _scan()
    assert (scan.num_consts, scan.num_carry) == (1, 1)
    assert [kind for kind, _ in scan.operands] == ["var", "var", "stream", "var"]  # bias; x; w's layer, the scales
    (_, bias), (_, x), _, (_, scales) = scan.operands
    assert (scan.const_vars, scan.carry_init, scan.xs_vars) == ([bias], [("var", x)], [scales])
    assert scan.inputs == [bias, x, scales] and scan.streams == [0]


def test_a_dropped_output_keeps_its_type_for_its_zero_cotangent():
    eqn = _scan().eqn
    y = eqn.outvars[-1]
    loop = _loop(eqn.replace(outvars=[*eqn.outvars[:-1], jc.DropVar(y.aval)]))
    assert loop.ys[-1].dropped and loop.ys[-1].like == jax.ShapeDtypeStruct((3,), jnp.int32)
    assert loop.ys[-1] == Output(loop.ys[-1].var, loop.ys[-1].like, True) and not loop.ys[0].dropped


def _tiled(p, x):
    def layer(h, w):
        def tile(acc, wt):
            return acc + jnp.tanh(h @ wt).sum(-1, keepdims=True), 1.0

        acc, _ = jax.lax.scan(tile, jnp.zeros_like(h[:, :1]), w)
        return h + acc, 2.0  # a literal ys output

    h, _ = jax.lax.scan(layer, x, p["w"])
    return jnp.sum(h)


def test_a_nested_bodys_inputs_and_results_stand_for_its_jaxprs_variables_and_literals():
    scan = split(_tiled, {"w": jnp.ones((2, 3, 4, 4))}, jnp.ones((2, 4))).scans()[0]
    body, jaxpr = scan.body, scan.body.closed.jaxpr
    assert body.inputs == tuple(jaxpr.invars) and len(body.inputs) == len(scan.operands)
    (kind, carry), (literal, value) = body.results
    assert (kind, literal, float(value)) == ("var", "literal", 2.0) and carry is jaxpr.outvars[0]
    tiles = [s for s in body.stages if s.kind == "scan"]
    assert [(s.loop.length, s.loop.num_consts, s.loop.num_carry) for s in tiles] == [(3, 1, 1)]
