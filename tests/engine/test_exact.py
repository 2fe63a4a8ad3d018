"""Invariant 1: the engine equals the in-memory reference trainer, for every tier and prefetch depth.

The engine on device memory is held to the reference over 20 steps: no farther from the same loop run in float64
than the fp32 loop is (tests/support/tolerances.py). Every other tier and depth is
held to the engine on device memory *bitwise* (invariant 3: the operation order does not depend on
where the state lives), over 5 steps: bitwise equality after 5 steps is equality after 20. The full matrix of
depths, and the 20-step runs of the numerics that make test covers together (clip+accum), are ``wide``
(``make test-all``).
"""

import pytest

from tests.support.engine_helpers import STEPS, assert_bitwise, config, engine_run, exact_run, reference_run
from tests.support.tolerances import assert_run_no_farther

NUMERICS = {
    "plain": {},
    "clip": {"grad_clip": 0.05},
    "accum": {"grad_accum": 2},
    "clip+accum": {"grad_clip": 0.05, "grad_accum": 2},
}


SHORT = 5
pytestmark = pytest.mark.numeric  # every test here holds the engine to the float64 loop too


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
@pytest.mark.parametrize("case", [c if c == "clip+accum" else pytest.param(c, marks=pytest.mark.wide)
                                  for c in NUMERICS])
def test_engine_on_device_equals_the_reference_trainer(runs, case):
    reference, (losses, params, _) = runs(case)
    assert_run_no_farther(exact_run(config(**NUMERICS[case])), reference, (losses, params))
    assert losses[-1] < losses[0]


# The first two, every tier on nvme, are wide (make test-all), beside test_full_nvme_matrix_of_depths: make test
# runs the mixed placements below, which take depths 0, 1 and 4 and every numerics case, and holds every tier on
# nvme to the reference elsewhere (test_stages.py, spooled clipping and accumulation; test_parts.py).
TIERS = [  # (params, optimizer, gradients, activations, prefetch_depth, numerics)
    pytest.param("nvme", "nvme", "nvme", "nvme", 0, "plain", marks=pytest.mark.wide),
    pytest.param("nvme", "nvme", "nvme", "nvme", 4, "clip+accum", marks=pytest.mark.wide),
    pytest.param("host", "host", "host", "host", 1, "clip", marks=pytest.mark.wide),
    ("nvme", "host", "nvme", "device", 1, "accum"),
    pytest.param("host", "nvme", "device", "nvme", 4, "plain", marks=pytest.mark.wide),
    pytest.param("device", "nvme", "host", "host", 0, "clip+accum", marks=pytest.mark.wide),
]


@pytest.mark.parametrize("params,optimizer,gradients,activations,depth,case", TIERS)
def test_every_tier_and_depth_is_bitwise_equal_to_device(runs, tmp_path, params, optimizer, gradients,
                                                          activations, depth, case):
    c = config(**NUMERICS[case], params=params, optimizer=optimizer, gradients=gradients,
               activations=activations, prefetch_depth=depth, nvme_path=str(tmp_path))
    reference, (device_losses, device_params, _) = runs(case, SHORT)
    losses, final, metrics = engine_run(c, SHORT)
    assert losses == device_losses  # bitwise: the operation order does not depend on the tier
    assert_bitwise(device_params, final)
    assert_run_no_farther(exact_run(config(**NUMERICS[case]), SHORT), reference, (losses, final))
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
