"""Every public name of ``zinfjax`` imports and works, each used once as a user would: a cheap call where there is
one, a user's mistake where that is the cheap path. ``WrappedState.params`` and ``opt_state``, the names a Flax
``TrainState`` has, still work, and say once what to call instead."""

import os
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zinfjax
from zinfjax import (
    BatchError,
    Batches,
    CheckpointError,
    CheckpointManager,
    Config,
    ConfigError,
    DataError,
    InitError,
    MemoryBudgetError,
    NonFiniteLossError,
    NotStreamableError,
    PlanError,
    ProgramError,
    RestackError,
    Sampling,
    StoreError,
    TiledDense,
    TiledMLP,
    UserError,
    WrapError,
    WrappedState,
    evaluate,
    generate,
    load_tokens,
    make_optimizer,
    make_plan,
    models,
    run,
    stack_layers,
    tune_allocator,
    wrap,
)

# What each test below uses; test_every_public_name_is_used_here holds it to zinfjax.__all__.
USED = {
    "Config", "wrap", "WrappedState", "run", "make_plan", "make_optimizer", "tune_allocator", "models", "TiledDense",
    "TiledMLP", "Batches", "load_tokens", "CheckpointManager", "stack_layers", "generate", "evaluate", "Sampling",
    "UserError", "ConfigError", "WrapError", "BatchError", "DataError", "InitError", "ProgramError",
    "NotStreamableError", "RestackError", "MemoryBudgetError", "PlanError", "CheckpointError", "NonFiniteLossError",
    "StoreError", "__version__",
}


def test_every_public_name_is_used_here():
    assert set(zinfjax.__all__) == USED
    assert all(hasattr(zinfjax, name) for name in USED)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _=None):
        return h + jnp.tanh(nn.Dense(h.shape[-1])(h)), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(nn.Dense(8)(x),
                                                                                                  None)
        return nn.Dense(1)(h)[..., 0]


def loss_fn(params, batch):
    return jnp.mean((Model().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """A scanned Linen model's TrainState, wrapped with its parameters on NVMe, one step trained."""
    tmp_path = tmp_path_factory.mktemp("wrapped")
    model = Model()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    batch = {"x": x, "y": jnp.sum(x, axis=1)}
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                                          tx=optax.sgd(0.1))
    config = Config(params="nvme", nvme_path=str(tmp_path / "nvme"), mesh="data:1")
    with wrap(state, config, loss_fn=loss_fn) as wrapped:
        wrapped, metrics = wrapped.train_step(batch)
        assert isinstance(wrapped, WrappedState) and wrapped.step == metrics["step"] == 1
        yield wrapped


def test_state_params_warns_once_and_is_read_params(wrapped, monkeypatch):
    monkeypatch.setattr(WrappedState, "_warned", set())  # once per process: this test starts a fresh one
    with pytest.warns(FutureWarning, match=r"WrappedState\.params is deprecated.*read_params\(\)") as caught:
        params = wrapped.params
    assert len(caught) == 1 and caught[0].filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use is silent
        again = wrapped.params
    read = wrapped.read_params()
    assert jax.tree.structure(params) == jax.tree.structure(read) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(read), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(params) == {"Dense_0", "ScanBlock_0", "Dense_1"}


def test_state_opt_state_warns_once_and_is_read_opt_state(wrapped, monkeypatch):
    monkeypatch.setattr(WrappedState, "_warned", set())
    with pytest.warns(FutureWarning, match=r"WrappedState\.opt_state is deprecated.*read_opt_state\(\)") as caught:
        opt_state = wrapped.opt_state
    assert len(caught) == 1
    assert jax.tree.structure(opt_state) == jax.tree.structure(wrapped.read_opt_state())


def test_a_future_warning_is_what_a_user_sees(tmp_path):
    """Why a FutureWarning: under Python's default filters a plain ``python train.py`` shows it from any module, where
    a DeprecationWarning from a user's own module (their loop, imported by their script) is hidden."""
    (tmp_path / "loop.py").write_text("import warnings\n\ndef step():\n"
                                      "    warnings.warn('future', FutureWarning)\n"
                                      "    warnings.warn('deprecation', DeprecationWarning)\n")
    (tmp_path / "train.py").write_text("import loop\nloop.step()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    shown = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True).stderr
    assert "FutureWarning: future" in shown and "deprecation" not in shown


def test_wrapping_a_wrapped_state_is_refused(wrapped):
    with pytest.raises(WrapError, match="wrapped already"):
        wrap(wrapped, wrapped.config, loss_fn=loss_fn)


def test_a_state_wrap_cannot_train_is_a_wrap_error():
    with pytest.raises(WrapError, match="TrainState or an nnx.Optimizer"):
        wrap(object(), Config())


def test_config_loads_overrides_and_refuses_a_bad_value():
    assert Config.load(None, ["steps=3", "memory_limit=1GiB"]).memory_limit == 1 << 30
    with pytest.raises(ConfigError, match="stage"):
        Config(stage=7)
    assert issubclass(ConfigError, UserError)


def test_make_optimizer_is_the_configs_optax_transformation():
    tx = make_optimizer(Config(optimizer_name="sgd", lr=0.5))
    params = {"w": jnp.ones(2)}
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.5 * np.ones(2))


def test_make_plan_without_probes_recommends_a_placement():
    plan = make_plan(Config(model="gpt2-tiny", mesh="data:1", batch_size=2, seq_len=16), probe=False)
    assert plan["parts"]["params"] == 898560 and plan["recommended"]["tiers"]["params"] == "device"


def test_run_checks_its_data_before_it_builds_the_model(tmp_path):
    # Training for real takes seconds of compiling (tests/training/ runs it); a corpus that is not there is refused
    # before anything is built.
    with pytest.raises(DataError, match="no_such_corpus"):
        run(Config(model="gpt2-tiny", data=str(tmp_path / "no_such_corpus.bin"), mesh="data:1"), progress=False)


def test_tune_allocator_is_a_function_of_glibcs_settings():
    # Not called: it sets malloc's arena count and thresholds for the whole test process (zinfjax.runtime.allocator's
    # own tests run it in a child process).
    assert callable(tune_allocator) and tune_allocator.__module__ == "zinfjax.runtime.allocator"


def test_models_build_a_named_model():
    config = models.ModelConfig.named("gpt2-tiny")
    assert isinstance(models.build("gpt2-tiny"), nn.Module) and config.n_layers > 0


def test_tiled_dense_and_mlp_trace_over_their_tiles():
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)  # shapes alone: traced, not compiled (tests/models/ run them)
    dense = TiledDense(features=6, in_splits=2, out_splits=3)
    variables = jax.eval_shape(dense.init, jax.random.key(0), x)
    assert jax.eval_shape(dense.apply, variables, x).shape == (2, 6)
    mlp = TiledMLP(d_ff=16, tiles=4)
    assert jax.eval_shape(mlp.apply, jax.eval_shape(mlp.init, jax.random.key(0), x), x).shape == (2, 8)


def test_batches_of_the_demo_corpus():
    tokens = load_tokens("demo")
    batch = next(iter(Batches(tokens, batch_size=2, seq_len=8, seed=0)))
    assert batch.shape == (2, 9) and tokens.dtype == np.uint16
    with pytest.raises(DataError):
        load_tokens("/no/such/corpus.bin")


def test_stack_layers_stacks_and_refuses_a_mismatch():
    stacked = stack_layers({"layers_0": {"w": np.zeros(3)}, "layers_1": {"w": np.ones(3)}, "head": np.ones(2)})
    assert stacked["layers"]["w"].shape == (2, 3) and "head" in stacked
    with pytest.raises(RestackError):
        stack_layers({"layers_0": {"w": np.zeros(3)}, "layers_1": {"w": np.ones(4)}})


def test_checkpoint_manager_saves_a_wrapped_state(wrapped, tmp_path):
    with CheckpointManager(str(tmp_path / "ckpt"), keep=1) as manager:
        manager.save(wrapped)
    assert (tmp_path / "ckpt" / "1" / "zinfjax.json").is_file()
    with pytest.raises(CheckpointError):
        evaluate(str(tmp_path / "missing"), "demo", Config())


def test_generate_checks_its_prompts_and_sampling_before_it_reads_a_layer():
    # Generating for real compiles a decoder (tests/inference/ runs it); these are refused before anything is built.
    model = models.ModelConfig.named("gpt2-tiny")
    with pytest.raises(ConfigError, match="needs its model"):
        generate({}, [[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(ConfigError, match="top_k"):
        generate({}, [[1, 2, 3]], max_new_tokens=2, model=model, sampling=Sampling(top_k=model.vocab_size + 1))


def test_every_error_is_a_class_a_user_can_catch():
    for error in (BatchError, InitError, ProgramError, NotStreamableError, MemoryBudgetError, PlanError,
                  NonFiniteLossError, CheckpointError, DataError, RestackError, WrapError):
        assert issubclass(error, UserError), error
    assert issubclass(StoreError, Exception)
    assert zinfjax.__version__.count(".") >= 2
