import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.tolerances import assert_loss_no_farther, in_float64
from zinfjax import models
from zinfjax.models import LayeredConventionError, check_params, get_layers, loss_fn


def n_params(name):
    model = models.build(name)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))


def test_gpt2_small_has_the_published_parameter_count():
    assert n_params("gpt2-small") == 124_439_808


@pytest.mark.parametrize("name,expected", [("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
                                           ("gpt2-xl", 1_557_611_200)])
def test_larger_gpt2_sizes_match_published_counts(name, expected):
    assert n_params(name) == expected


def test_llama_7b_has_the_published_parameter_count():
    assert n_params("llama-7b") == 6_738_415_616


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_blocks_are_stacked_on_a_layer_axis(name):
    model = models.build(name)
    params = model.init(jax.random.key(0), jnp.zeros((2, 16), jnp.int32))["params"]
    assert check_params(params) == model.config.n_layers
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == model.config.n_layers


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_layered_split_equals_the_whole_model(name):
    model = models.build(name)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, model.config.vocab_size)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    whole = model.apply({"params": params}, tokens[:, :-1], tokens[:, 1:])
    layers = get_layers(model)
    h = layers.embed(params["embed"], tokens[:, :-1])
    for i in range(model.config.n_layers):
        h = layers.block(models.layer_slice(params["blocks"], i), h)
    split = layers.head(params["head"], params["embed"], h, tokens[:, 1:])
    with jax.enable_x64(True):  # the whole model in float64: the truth both fp32 losses are judged against
        exact = models.build(name, jnp.float64).apply({"params": in_float64(params)}, tokens[:, :-1], tokens[:, 1:])
        assert exact.dtype == jnp.float64
    # unrolled layer by layer, no farther from it than the scanned whole model (tests/support/tolerances.py)
    for ours in (split, loss_fn(layers, params, tokens[:, :-1], tokens[:, 1:])):
        assert_loss_no_farther(float(exact), float(whole), float(ours), terms=tokens[:, 1:].size)
    assert np.isclose(whole, np.log(model.config.vocab_size), rtol=0.1)  # near-uniform at init


@pytest.mark.numeric  # the logits before the changed token are the same arithmetic on the same values: bitwise
def test_logits_are_causal():
    model = models.build("llama-tiny")
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, 256)
    params = model.init(jax.random.key(0), tokens)["params"]
    logits = model.apply({"params": params}, tokens)
    changed = tokens.at[0, 8].set((tokens[0, 8] + 1) % 256)
    logits2 = model.apply({"params": params}, changed)
    np.testing.assert_array_equal(logits[0, :8], logits2[0, :8])
    assert not np.allclose(logits[0, 8:], logits2[0, 8:])


def test_tiny_sizes_shard_over_eight_devices():
    for name in ("gpt2-tiny", "llama-tiny"):
        c = models.ModelConfig.named(name)
        assert c.n_heads % 8 == 0 and c.kv_heads % 8 == 0 and c.d_model % 8 == 0 and c.d_ff % 8 == 0


def test_a_model_without_the_convention_is_refused_with_a_pointer_to_the_docs():
    class Plain:
        pass

    with pytest.raises(LayeredConventionError, match="layers\\(\\).*docstring of zinfjax.models.layered"):
        get_layers(Plain())
    with pytest.raises(LayeredConventionError, match="groups"):
        check_params({"embed": {}, "layers": {}})
    with pytest.raises(LayeredConventionError, match="leading layer axis"):
        check_params({"embed": {}, "blocks": {"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))}, "head": {}})
