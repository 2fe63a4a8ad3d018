"""Invariant 1: the engine equals the in-memory reference trainer, for every tier and prefetch depth.

The engine on device memory is held to the reference over 20 steps. Every other tier and depth is
held to the engine on device memory *bitwise* (invariant 3: the operation order does not depend on
where the state lives), over 5 steps: bitwise equality after 5 steps is equality after 20. The full matrix of
depths, and the 20-step runs of the numerics that make test covers together (clip+accum), are ``wide``
(``make test-all``).
"""

import numpy as np
import pytest

from tests.support.engine_helpers import STEPS, assert_bitwise, config, engine_run, reference_run, relative_error

NUMERICS = {
    "plain": {},
    "clip": {"grad_clip": 0.05},
    "accum": {"grad_accum": 2},
    "clip+accum": {"grad_clip": 0.05, "grad_accum": 2},
}


SHORT = 5


@pytest.fixture(scope="module")
def runs():
    """Reference and all-device engine runs (20 steps, and 5), computed once per numerics case."""
    cache = {}

    def get(case, steps=STEPS):
        if (case, steps) not in cache:
            c = config(**NUMERICS[case])
            cache[case, steps] = (reference_run(c, steps), engine_run(c, steps))
        return cache[case, steps]

    return get


# Over 20 steps, make test runs plain and clip+accum (clipping and micro-batches together); clip alone and accum
# alone are wide, for make test-all. make test holds them to the reference over 5 steps still, in the tier cases
# below ("clip", "accum").
@pytest.mark.parametrize("case", [c if c in ("plain", "clip+accum") else pytest.param(c, marks=pytest.mark.wide)
                                  for c in NUMERICS])
def test_engine_on_device_equals_the_reference_trainer(runs, case):
    (ref_losses, ref_params), (losses, params, _) = runs(case)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert relative_error(ref_params, params) < 1e-6
    assert losses[-1] < losses[0]


# The first two, every tier on nvme, are wide (make test-all), beside test_full_nvme_matrix_of_depths: make test
# runs the mixed placements below, which take depths 0, 1 and 4 and every numerics case, and holds every tier on
# nvme to the reference elsewhere (test_stages.py, spooled clipping and accumulation; test_parts.py).
TIERS = [  # (params, optimizer, gradients, activations, prefetch_depth, numerics)
    pytest.param("nvme", "nvme", "nvme", "nvme", 0, "plain", marks=pytest.mark.wide),
    pytest.param("nvme", "nvme", "nvme", "nvme", 4, "clip+accum", marks=pytest.mark.wide),
    ("host", "host", "host", "host", 1, "clip"),
    ("nvme", "host", "nvme", "device", 1, "accum"),
    ("host", "nvme", "device", "nvme", 4, "plain"),
    ("device", "nvme", "host", "host", 0, "clip+accum"),
]


@pytest.mark.parametrize("params,optimizer,gradients,activations,depth,case", TIERS)
def test_every_tier_and_depth_is_bitwise_equal_to_device(runs, tmp_path, params, optimizer, gradients,
                                                          activations, depth, case):
    c = config(**NUMERICS[case], params=params, optimizer=optimizer, gradients=gradients,
               activations=activations, prefetch_depth=depth, nvme_path=str(tmp_path))
    (ref_losses, _), (device_losses, device_params, _) = runs(case, SHORT)
    losses, final, metrics = engine_run(c, SHORT)
    assert losses == device_losses  # bitwise: the operation order does not depend on the tier
    assert_bitwise(device_params, final)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    if "nvme" in (params, optimizer, activations):
        assert metrics[-1]["read_bytes_nvme"] > 0 and metrics[-1]["write_bytes_nvme"] > 0


@pytest.mark.wide
@pytest.mark.parametrize("depth", [0, 1, 4])
@pytest.mark.parametrize("case", list(NUMERICS))
def test_full_nvme_matrix_of_depths(runs, tmp_path, depth, case):
    c = config(**NUMERICS[case], params="nvme", optimizer="nvme", gradients="nvme", activations="nvme",
               prefetch_depth=depth, nvme_path=str(tmp_path))
    (_, _), (device_losses, device_params, _) = runs(case, SHORT)
    losses, final, _ = engine_run(c, SHORT)
    assert losses == device_losses
    assert_bitwise(device_params, final)
