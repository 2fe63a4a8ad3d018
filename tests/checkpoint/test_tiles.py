"""A checkpoint saved in tiles is a checkpoint of the same leaves: it restores in other tiles and converts alike.

An engine that streams gpt2-tiny in 8 tiles (`zinfjax.models.tiling`) writes each tile as a block of its
layer's leaf (docs/checkpoint.md). Restored in 1 tile on 2 devices in memory and in 2 tiles at stage 3
on 4 devices on NVMe, the parameters and optimizer state are those saved, bit for bit, and
``zinfjax convert --to hf`` writes the same tensors from it as from the untiled restore's own save.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from safetensors.numpy import load_file

from tests.support.engine_helpers import _tx, assert_bitwise, batches, config, initial_params
from zinfjax import models
from zinfjax.checkpoint import CheckpointManager, CheckpointSource
from zinfjax.cli import main
from zinfjax.engine import TreeSource
from zinfjax.models.configs import ModelConfig
from zinfjax.sharding import make_mesh
from zinfjax.trainers.streaming import lm_engine

NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")


def engine_in(c, tiles: int, source):
    model = models.build(ModelConfig.resolve(c.model).replace(tiles=tiles))
    c = c.replace(stream_tiles="always")
    return lm_engine(model, c, make_mesh(c.mesh_axes()), source=source, tx=_tx(c))


def save(engine, c, directory) -> None:
    with CheckpointManager(str(directory), config=c, model=ModelConfig.resolve(c.model)) as manager:
        manager.save(engine)


def hf_tensors(checkpoint, out, capsys) -> dict:
    assert main(["convert", str(checkpoint), str(out), "--to", "hf", "--quiet", "--json"]) == 0
    json.loads(capsys.readouterr().out)
    return load_file(str(out / "model.safetensors"))


def test_saved_in_8_tiles_restores_in_1_and_2_and_converts_to_the_same_hf_tensors(tmp_path, capsys):
    c = config(stage=3, mesh="data:4", nvme_path=str(tmp_path / "nvme8"), **NVME)
    params = initial_params(c)
    engine = engine_in(c, 8, lambda program, plan: TreeSource(program, plan, params))
    data = batches(c)
    for _ in range(2):
        engine.train_step(next(data))
    save(engine, c, tmp_path / "ckpt8")
    saved, saved_opt = jax.tree.map(np.asarray, engine.params()), jax.tree.map(np.asarray, engine.opt_state())
    engine.close()

    for tiles, c2 in ((1, config(stage=1, mesh="data:2")),
                      (2, config(stage=3, mesh="data:4", nvme_path=str(tmp_path / "nvme2"), **NVME))):
        restored = engine_in(c2, tiles, lambda program, plan: CheckpointSource(str(tmp_path / "ckpt8"), program,
                                                                                plan))
        assert restored.step_count == 2
        assert_bitwise(jax.tree.map(np.asarray, restored.params()), saved)
        assert_bitwise(jax.tree.map(np.asarray, restored.opt_state()), saved_opt)
        if tiles == 1:
            save(restored, c2, tmp_path / "ckpt1")
        restored.close()

    tiled, untiled = hf_tensors(tmp_path / "ckpt8", tmp_path / "hf8", capsys), hf_tensors(tmp_path / "ckpt1",
                                                                                            tmp_path / "hf1", capsys)
    assert sorted(tiled) == sorted(untiled)
    for name, x in tiled.items():
        np.testing.assert_array_equal(x.view(np.uint8), untiled[name].view(np.uint8), err_msg=name)
