"""A user's NNX model with Flax's own LoRA, its optimizer on ``nnx.LoRAParam`` alone, through `zinfjax.wrap`.

The blocks (``nnx.vmap``-made, run by ``nnx.scan``) each hold an ``nnx.LoRALinear`` and an
``nnx.LoRA`` around an ``nnx.Linear``. ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` trains the
adapters; zinfjax runs ``tx`` on those and gives the base no update (`zinfjax.trainers.frozen`). Against
the user's own NNX loop (``nnx.value_and_grad`` with ``nnx.DiffState(0, nnx.LoRAParam)`` and
``optimizer.update``), on NVMe: losses and adapters no farther from the same loop run in float64 than the fp32
loop is (tests/support/tolerances.py), the base bit for bit as it started.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from tests.support.engine_helpers import relative_error
from tests.support.float64_twin import assert_float64, assert_products_in_float64, nnx_in_float64
from tests.support.nnx_models import StackedLM, next_token_loss
from tests.support.tolerances import assert_no_farther, loss_distance
from zinfjax.trainers.frozen import FrozenError
from zinfjax.wrap import WrapError

LAYERS, D, VOCAB, STEPS = 3, 32, 64, 6


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.LoRALinear(D, 2 * D, lora_rank=4, rngs=rngs)
        self.down = nnx.LoRA(2 * D, 4, D, base_module=nnx.Linear(2 * D, D, rngs=rngs), rngs=rngs)

    def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(self.norm(h))))


def lora_lm(rngs: nnx.Rngs):
    return StackedLM(Block, LAYERS, VOCAB, D, rngs)


def data():
    rng = np.random.default_rng(3)
    return [jax.numpy.asarray(rng.integers(0, VOCAB, (8, 17)), jax.numpy.int32) for _ in range(STEPS)]


def own_loop(batches, exact=False):
    """The user's NNX loop: gradients of the LoRA params alone, ``optimizer.update``; in float64 from the same fp32
    initial params where ``exact``."""
    model = lora_lm(nnx.Rngs(0))
    if not exact:
        return _loop(model, batches)
    with jax.enable_x64(True):
        model = nnx_in_float64(model)
        assert_products_in_float64(next_token_loss, model, batches[0])
        losses, params = _loop(model, batches)
    assert_float64(params)
    return losses, params


def _loop(model, batches):
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(next_token_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, b)) for b in batches]
    return losses, nnx.state(model, nnx.Param).to_pure_dict()


def split(params) -> tuple[dict, dict]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    key = jax.tree_util.keystr
    lora = {key(p): np.asarray(x) for p, x in flat if "lora" in key(p)}
    return lora, {key(p): np.asarray(x) for p, x in flat if "lora" not in key(p)}


@pytest.mark.numeric
def test_nnx_lora_params_train_and_the_base_stays_through_wrap(tmp_path):
    batches = data()
    ref_losses, ref = own_loop(batches)
    model = lora_lm(nnx.Rngs(0))
    start = nnx.state(model, nnx.Param).to_pure_dict()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    c = zinfjax.Config(nvme_path=str(tmp_path), params="nvme", optimizer="nvme", gradients="nvme",
                       activations="nvme")
    with zinfjax.wrap(optimizer, c, model=model, loss_fn=next_token_loss) as wrapped:
        losses = [float(wrapped.train_step(b)[1]["loss"]) for b in batches]
        groups = {g.name: g.length for g in wrapped.engine.program.streamed_groups()}
        ours = jax.tree.map(np.asarray, wrapped.sync())
    assert LAYERS in groups.values()  # the blocks stream, adapters with their layer
    exact_losses, exact = own_loop(batches, exact=True)
    assert_no_farther(exact_losses, ref_losses, losses, loss_distance)
    (ref_a, ref_base), (our_a, our_base), (start_a, start_base) = split(ref), split(ours), split(start)
    assert len(our_a) == 4
    assert_no_farther(split(exact)[0], ref_a, our_a)
    assert relative_error(start_a, our_a) > 1e-3  # the adapters did train
    for path, x in start_base.items():
        np.testing.assert_array_equal(our_base[path], x, err_msg=path)
        np.testing.assert_array_equal(ref_base[path], x, err_msg=path)


def test_a_filter_that_selects_nothing_is_refused_in_one_line(tmp_path):
    model = lora_lm(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.BatchStat)  # no parameter is a BatchStat
    with pytest.raises(FrozenError, match="selects no parameter of the model; nothing would train$"):
        zinfjax.wrap(optimizer, zinfjax.Config(), model=model, loss_fn=next_token_loss, batch=data()[0])


def test_a_filter_that_selects_the_base_with_the_adapters_is_refused_in_one_line():
    model = lora_lm(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # LoRAParam is a Param: everything trains
    with pytest.raises(WrapError, match="has LoRA adapters .* wrt=nnx.LoRAParam"):
        zinfjax.wrap(optimizer, zinfjax.Config(), model=model, loss_fn=next_token_loss, batch=data()[0])
