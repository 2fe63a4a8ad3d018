"""An NNX training loop, streamed with zinfjax. An `nnx.Optimizer` does not hold its model, so pass it too.

Run: .venv/bin/python examples/train_nnx.py
"""

import jax.numpy as jnp
import optax
from flax import nnx

import zinfjax
from zinfjax import Batches, load_tokens
from zinfjax.models import gpt

config = zinfjax.Config(model="gpt2-tiny", batch_size=8, seq_len=64, params="host", optimizer="nvme",
                        nvme_path="runs/example_nnx/nvme")
model = nnx.bridge.ToNNX(gpt.GPT(gpt.ModelConfig.named(config.model)), rngs=nnx.Rngs(0))
nnx.bridge.lazy_init(model, jnp.zeros((1, config.seq_len), jnp.int32))
optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

state = zinfjax.wrap(optimizer, config, model=model)
batches = Batches(load_tokens("demo"), config.batch_size, config.seq_len, seed=0)
for _ in range(20):
    state, metrics = state.train_step(next(batches))
    print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}")
state.sync()  # the trained parameters back in the NNX model
state.close()
