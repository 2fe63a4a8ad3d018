"""`zinfjax.planning.zero_memory`: each device's bytes of the model state under the ZeRO stages, from shapes alone."""

import jax
import jax.numpy as jnp
import optax
import pytest

from tests.support.engine_helpers import expected_state_bytes
from zinfjax.benchmarks.state_table import abstract_params
from zinfjax.planning.zero_memory import state_bytes, zero_formula
from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt2_small_memory_table_follows_zero_formulas(stage, precision):
    """fp32: p=4, g=4, K=8 (Adam m, v); bf16: p=2, g=4 (spooled as fp32), K=12 (m, v, fp32 master)."""
    abstract, tx, n = abstract_params("gpt2-small"), optax.adamw(1e-3), 8
    dtype, (p, g, k) = {"fp32": (jnp.float32, (4, 4, 8)), "bf16": (jnp.bfloat16, (2, 4, 12))}[precision]
    got = sum(state_bytes(abstract, tx, ShardingRules(stage=stage, data=n), dtype).values())
    assert got == expected_state_bytes(abstract, tx, stage, n, p, g, k, PERSISTENCE_THRESHOLD)
    # Sharding must save what the paper says, up to the small replicated remainder.
    psi = sum(x.size for x in jax.tree.leaves(abstract))
    assert got == pytest.approx(zero_formula(stage, psi, n, p, g, k), rel=0.01)
