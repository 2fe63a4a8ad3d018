"""The optimizer update on the host (``update_on=host``): exact, placed on the host, and light on the link.

On the CPU backend host and device are one memory, so the figures that matter on an accelerator
are checked by what the program says: the update's HLO is host compute (``compute_on``), its master
and state stay in ``pinned_host`` memory, and ``host_link_bytes`` counts what crosses. The numbers
are checked against the plain update on the device, which `test_engine_exact` holds to the
reference trainer.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.engine_helpers import (
    assert_bitwise,
    batches,
    config,
    engine_run,
    exact_run,
    make_engine,
    reference_run,
)
from tests.support.tolerances import assert_run_no_farther
from zinfjax import Config
from zinfjax.engine.engine_plan import update_location
from zinfjax.errors import ConfigError
from zinfjax.sections import Tiering
from zinfjax.sharding import make_mesh
from zinfjax.store.layout import host_tier_kind, pick_host_kind
from zinfjax.training.loop import run

CASES = {  # name: config keys; each tier of the optimizer state, stage 3, sweeps (clipping) and fp16
    "bf16-host": dict(mesh="data:1", precision="bf16", optimizer="host"),
    "nvme-stage3": dict(stage=3, params="nvme", optimizer="nvme", activations="nvme"),
    "clip-stage2": dict(stage=2, optimizer="host", gradients="host", grad_clip=0.05),
    "fp16": dict(mesh="data:1", precision="fp16", optimizer="nvme"),
    "bf16-parts": dict(mesh="data:2", precision="bf16", optimizer="nvme", sub_group_size=4096),
}
SHORT = 3  # steps: bitwise equal after 3 is bitwise equal after any number


# make test keeps the host tier (bf16) and sweeps at stage 2; the nvme tier, stage 3, fp16 and parts are wide
# (make test-all). make test has the host update against the reference below.
SHORT_CASES = ("bf16-host", "clip-stage2")


@pytest.mark.parametrize("case", [c if c in SHORT_CASES else pytest.param(c, marks=pytest.mark.wide) for c in CASES])
def test_the_update_on_the_host_is_bitwise_the_update_on_the_device(tmp_path, case):
    c = config(**CASES[case], nvme_path=str(tmp_path / "nvme"))
    dev_losses, dev_params, _ = engine_run(c.replace(update_on="device"), steps=SHORT)
    host_losses, host_params, metrics = engine_run(c.replace(update_on="host"), steps=SHORT)
    assert host_losses == dev_losses
    assert_bitwise(host_params, dev_params)
    assert all(np.isfinite(m["loss"]) for m in metrics)


# make test follows the reference over 5 steps (the cases above hold the host update bitwise to the device's, which
# test_exact holds to the reference over 20); the wide form, for make test-all, over 20 steps.
@pytest.mark.numeric
@pytest.mark.parametrize("steps", [5, pytest.param(20, marks=pytest.mark.wide)])
def test_the_update_on_the_host_follows_the_reference_trainer(tmp_path, steps):
    c = config(optimizer="host", stage=3, update_on="host")
    losses, params, _ = engine_run(c, steps)
    # The reference loop does not depend on the tiers or the stage: config() is test_exact.py's float64 run.
    assert_run_no_farther(exact_run(config(), steps), reference_run(c, steps), (losses, params))
    assert losses[-1] < losses[0]


def _step(c):
    engine = make_engine(c)
    try:
        metrics = engine.train_step(next(batches(c)))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.params()))
    finally:
        engine.close()
    return metrics, n


def test_bf16_params_on_device_and_optimizer_on_host_move_about_4_bytes_per_parameter():
    """Gradient down (2 B), compute copy up (2 B); the device update moves master, m and v both ways (24 B)
    between the host tier and the device."""
    c = config(mesh="data:1", precision="bf16", optimizer="host", params="device")
    host, n = _step(c.replace(update_on="host"))
    device, _ = _step(c.replace(update_on="device"))
    # gpt2-tiny's backward hands the attention output projection an fp32 gradient (4 B): 16384 of 224640
    # parameters, so the count is 4.15 B per parameter.
    assert 4 * n <= host["host_link_bytes"] <= 4.2 * n
    # The device update reads and writes master, m and v on the host tier: on an accelerator that crosses
    # the link. On the CPU backend the host tier is device memory (`host_tier_kind`), so nothing does.
    assert 24 * n <= device["read_bytes_host"] + device["write_bytes_host"] <= 24 * n + 4096
    assert device["host_link_bytes"] == 0
    assert host["read_bytes_host"] == device["read_bytes_host"]  # the state is read either way, on the host


def test_fp32_master_on_device_moves_gradient_and_parameters():
    """fp32 has no separate master: the parameters on the device are it, so they go down and come up."""
    c = config(mesh="data:1", optimizer="host", params="device", update_on="host")
    metrics, n = _step(c)
    assert metrics["host_link_bytes"] == 12 * n


def _update_of_layer_0(engine):
    """The jitted update of layer 0 of ``blocks``, lowered on the inputs the engine gives it."""
    group = "s:blocks"
    stores = engine.stores
    paths, state_paths = engine.units.paths(group)
    master = stores.kind("params")[group].read(0).result()
    state = stores.kind("opt")[group].read(0, None, "pinned_host").result()
    grads = [jnp.zeros_like(master[p]) for p in paths]
    fn = engine.units.update(group, 0, engine.units.size(group, 0), (), None)
    return fn.lower([master[p] for p in paths], grads, [state[p] for p in state_paths], engine.globals, [],
                    engine.units.start(group, 0), jnp.float32(1))


def test_the_update_is_compiled_as_host_compute_with_its_state_in_host_memory():
    c = config(mesh="data:2", optimizer="host", update_on="host")
    engine = make_engine(c)
    try:
        engine.train_step(next(batches(c)))
        lowered = _update_of_layer_0(engine)
        partials, compute, master, state = lowered.compile().output_shardings
    finally:
        engine.close()
    assert '_xla_compute_type = "host"' in lowered.as_text()
    assert {s.memory_kind for s in state} == {"pinned_host"}
    assert {s.memory_kind for s in compute} == {"device"}


def test_the_host_tier_on_the_cpu_backend_is_device_memory_unless_the_update_runs_on_the_host():
    cpu = jax.devices("cpu")[0]
    kind, why = host_tier_kind(cpu)
    assert kind == "device" and "device memory is host memory" in why
    assert host_tier_kind(cpu, update_on_host=True) == ("pinned_host", None)


def test_a_platform_without_pinned_host_memory_falls_back_and_says_why():
    assert pick_host_kind("cpu", ["device", "pinned_host", "unpinned_host"]) == ("pinned_host", None)
    kind, why = pick_host_kind("tpu", ["device", "unpinned_host"])
    assert kind == "unpinned_host" and why == "tpu has no pinned_host memory; the host tier uses unpinned_host"
    kind, why = pick_host_kind("metal", ["device"])
    assert kind == "device" and "metal has no host memory kind (it has device)" in why


def test_the_log_records_where_the_update_ran_and_the_host_memory_kind(tmp_path):
    log = tmp_path / "log.json"
    run(config(mesh="data:1", optimizer="host", update_on="host", steps=1, log=str(log)), progress=False)
    record = json.loads(log.read_text())
    assert record["update_on"] == "host" and record["host_memory_kind"] == "pinned_host"
    assert "host_memory_fallback" not in record
    assert record["steps"][0]["host_link_bytes"] > 0


def test_auto_updates_on_the_device_on_the_cpu_backend_and_host_is_refused_without_host_state():
    platform = make_mesh({"data": 1}).devices.flat[0].platform
    assert update_location(Config(optimizer="host").section(Tiering), platform) == "device"
    host = Config(optimizer="nvme", nvme_path="/x", update_on="host").section(Tiering)
    assert update_location(host, platform) == "host"
    with pytest.raises(ConfigError, match="update_on=host .* needs optimizer=host or nvme"):
        Config(update_on="host")
    with pytest.raises(ConfigError, match="update_on='gpu' is not allowed; use auto, device, host"):
        Config(update_on="gpu")


def test_the_host_tier_on_the_cpu_backend_moves_nothing_over_the_host_link_and_says_why(tmp_path):
    log = tmp_path / "log.json"
    run(config(mesh="data:1", params="host", optimizer="host", gradients="host", steps=1, log=str(log)), progress=False)
    record = json.loads(log.read_text())
    assert record["update_on"] == "device" and record["host_memory_kind"] == "device"
    assert "device memory is host memory" in record["host_memory_fallback"]
    assert record["steps"][0]["host_link_bytes"] == 0 and record["steps"][0]["read_bytes_host"] > 0
