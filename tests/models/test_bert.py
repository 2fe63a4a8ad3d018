"""The BERT encoder in the layered convention: the split equals the whole, and padding changes nothing.

"Equals" where the sums run in another order (scanned against unrolled, a padded batch against a shorter one): no
farther from the encoder in float64 than the fp32 encoder is, within ``SLACK`` (whole-array relative L2;
tests/support/tolerances.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.tolerances import assert_no_farther, in_float64
from zinfjax import models
from zinfjax.models import BertInputs, LayeredConventionError, check_params, get_layers, mean_pool

CONFIG = models.ModelConfig("bert", 64, 16, 32, 3, 4, 64, tied=False, norm_eps=1e-12)


def batch(length=10, real=(10, 6)):
    ids = jax.random.randint(jax.random.key(1), (len(real), length), 1, CONFIG.vocab_size)
    mask = (jnp.arange(length)[None] < jnp.asarray(real)[:, None]).astype(jnp.int32)
    types = (jnp.arange(length)[None] >= 3).astype(jnp.int32) * mask
    return BertInputs(ids * mask, mask, types)


@pytest.fixture(scope="module")
def model_and_params():
    model = models.build(CONFIG)
    return model, model.init(jax.random.key(0), batch())["params"]


def exact(params, x):
    """The whole encoder in float64 (``jax.enable_x64``) from the fp32 params: its hidden states and pooled output."""
    with jax.enable_x64(True):
        out = models.build(CONFIG, jnp.float64).apply({"params": in_float64(params)}, x)
        assert out.hidden.dtype == out.pooled.dtype == jnp.float64  # no silent fp32
        return np.asarray(out.hidden), np.asarray(out.pooled)


@pytest.mark.numeric
def test_blocks_are_stacked_and_the_split_equals_the_whole(model_and_params):
    model, params = model_and_params
    assert check_params(params) == CONFIG.n_layers
    x = batch()
    whole = model.apply({"params": params}, x)
    layers = get_layers(model)
    h = layers.embed(params["embed"], x)
    for i in range(CONFIG.n_layers):
        h = layers.block(models.layer_slice(params["blocks"], i), h)
    split = layers.head(params["head"], params["embed"], h, None)
    hidden, pooled = exact(params, x)  # scanned and unrolled differ in rounding only
    assert_no_farther(hidden, np.asarray(whole.hidden), np.asarray(split.hidden))
    assert_no_farther(pooled, np.asarray(whole.pooled), np.asarray(split.pooled))
    assert whole.hidden.shape == (2, 10, 32) and whole.pooled.shape == (2, 32)


@pytest.mark.numeric
def test_padding_does_not_change_the_real_tokens(model_and_params):
    model, params = model_and_params
    short = batch(length=6, real=(6, 6))
    padded = BertInputs(*(jnp.pad(a, ((0, 0), (0, 4))) for a in short))
    a = model.apply({"params": params}, short).hidden
    b = model.apply({"params": params}, padded).hidden
    hidden, _ = exact(params, short)
    assert_no_farther(hidden, np.asarray(a), np.asarray(b[:, :6]))
    with jax.enable_x64(True):
        pooled = np.asarray(mean_pool(jnp.asarray(hidden), short.mask))
    assert_no_farther(pooled, np.asarray(mean_pool(a, short.mask)), np.asarray(mean_pool(b, padded.mask)))


@pytest.mark.numeric  # the same arithmetic: bitwise
def test_bare_ids_mean_no_padding_and_one_segment(model_and_params):
    model, params = model_and_params
    ids = batch().ids
    ones = jnp.ones(ids.shape, jnp.int32)
    np.testing.assert_array_equal(model.apply({"params": params}, ids).hidden,
                                  model.apply({"params": params}, BertInputs(ids, ones, 0 * ones)).hidden)


def test_the_encoder_refuses_targets(model_and_params):
    model, params = model_and_params
    with pytest.raises(LayeredConventionError, match="no training loss"):
        model.apply({"params": params}, batch(), batch().ids)
