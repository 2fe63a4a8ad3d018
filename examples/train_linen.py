"""A Flax Linen training loop, streamed with zinfjax: the changes are the `wrap` and the step call.

Run: .venv/bin/python examples/train_linen.py
"""

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import zinfjax
from zinfjax import Batches, load_tokens
from zinfjax.models import gpt

config = zinfjax.Config(model="gpt2-tiny", batch_size=8, seq_len=64, params="nvme", optimizer="nvme",
                        activations="host", nvme_path="runs/example_linen/nvme")
model = gpt.GPT(gpt.ModelConfig.named(config.model))
params = model.init(jax.random.key(0), jnp.zeros((1, config.seq_len), jnp.int32))["params"]
state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))

state = zinfjax.wrap(state, config)  # parameters and optimizer state now live on NVMe
batches = Batches(load_tokens("demo"), config.batch_size, config.seq_len, seed=0)
for _ in range(20):
    state, metrics = state.train_step(next(batches))
    print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}  "
          f"nvme read {metrics['read_bytes_nvme'] / 2**20:.1f} MiB  stall {metrics['stall_s']:.3f}s")
state.close()
