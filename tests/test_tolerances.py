"""The exactness rule catches defects: each planted one lands orders of magnitude beyond what it allows.

The rule (tests/support/tolerances.py): an fp32 run is no farther from the same loop in float64 than the fp32
in-memory loop is, times ``fp32_slack``. Here the in-memory loop itself is given a defect an engine could have (a
wrong gradient, a missed update, a stale layer), and the defective run's distance from float64 is set against
the largest distance the rule would allow. A tolerance loose enough to let one through would fail here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.support.engine_helpers import batches, config, exact_run, initial_params, reference_run, relative_error
from tests.support.tolerances import assert_no_farther, fp32_slack
from zinfjax import models
from zinfjax.models.stacked import lm_loss
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax.trainers.reference import loss_and_grads

pytestmark = pytest.mark.numeric
STEPS = 5
C = config(mesh="data:1")


def _misrouted(grads, step):
    """A wrong gradient: block 1 gets block 0's (a layer index off by one). Not a scaled one: Adam would not see
    a gradient off by a constant factor."""
    return {**grads, "blocks": jax.tree.map(lambda g: g.at[1].set(g[0]), grads["blocks"])}


def _skip_step_2(updates, step):
    """A missed update: step 2 changes nothing."""
    return jax.tree.map(lambda u: jnp.where(step == 2, 0.0, u), updates)


def _stale_layer_1(updates, step):
    """A stale layer: block 1 keeps its parameters at step 2."""
    def one(u):
        return u.at[1].set(jnp.where(step == 2, 0.0, u[1]))
    return {**updates, "blocks": jax.tree.map(one, updates["blocks"])}


DEFECTS = {"wrong_gradient": (_misrouted, None), "missed_update": (None, _skip_step_2),
           "stale_layer": (None, _stale_layer_1)}


def defective_run(on_grads, on_updates):
    """The reference loop of ``C`` with a defect planted in its gradients or its updates."""
    loss_fn, tx = lm_loss(models.build(C.model)), make_optimizer(C)

    @jax.jit
    def step(params, opt, batch, i):
        _, grads = loss_and_grads(loss_fn, params, batch)
        grads = on_grads(grads, i) if on_grads else grads
        updates, opt = tx.update(grads, opt, params)
        updates = on_updates(updates, i) if on_updates else updates
        return optax.apply_updates(params, updates), opt

    params = initial_params(C)
    opt, data = tx.init(params), batches(C)
    for i in range(STEPS):
        params, opt = step(params, opt, next(data), i)
    return jax.tree.map(np.asarray, params)


@pytest.mark.parametrize("defect", [d if d == "missed_update" else pytest.param(d, marks=pytest.mark.wide)
                                    for d in DEFECTS])  # one in make test, every defect in make test-all
def test_a_planted_defect_fails_the_rule_by_orders_of_magnitude(defect):
    exact, reference = exact_run(C, STEPS)[1], reference_run(C, STEPS)[1]
    assert_no_farther(exact, reference, defective_run(None, None))  # the loop without a defect passes
    allowed = fp32_slack(exact, reference) * relative_error(exact, reference)
    beyond = relative_error(exact, defective_run(*DEFECTS[defect])) / allowed
    print(f"\n{defect}: {beyond:.0f} times what the rule allows")
    assert beyond > 100, f"{defect}: only {beyond:.1f} times what the rule allows"
