"""ZeRO-3: every parameter, gradient and optimizer-state leaf is sharded over fsdp x context."""

import jax
import numpy as np
import pytest
from helpers import mesh_for, tiny_cfg
from jax.sharding import PartitionSpec as P

from jaxlong.core.mesh import FSDP_AXES, describe_param_sharding, param_spec
from jaxlong.training import step as step_lib


def test_param_spec_rule():
    assert param_spec((32, 4096, 32, 128), 8, stacked=True) == P(None, FSDP_AXES, None, None)
    assert param_spec((128256, 4096), 8, stacked=False) == P(FSDP_AXES, None)
    assert param_spec((3, 5), 8, stacked=False) == P(None, None)  # too small to split: replicated
    assert param_spec((), 8, stacked=False) == P()


def test_every_state_leaf_is_sharded_as_specified():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4")
    mesh = mesh_for(cfg, 8)
    state = step_lib.init_state(cfg, mesh)
    expected = step_lib.state_shardings(mesh, state)
    n_sharded = 0
    for (path, leaf), want in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), name
        if leaf.ndim and leaf.size > 1:  # all non-scalar leaves of this model are divisible by 8 somewhere
            assert FSDP_AXES in tuple(want.spec), name
            shard = leaf.addressable_shards[0].data
            assert shard.size * 8 == leaf.size, name
            n_sharded += 1
    assert n_sharded == 3 * len(jax.tree.leaves(state["params"]))  # params, Adam mu and nu
    lines = describe_param_sharding(mesh, state["params"])
    assert not [line for line in lines if "replicated" in line]


@pytest.mark.slow
def test_gradients_come_back_sharded_like_params():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "steps=2")
    mesh = mesh_for(cfg, 8)
    compiled = step_lib.compile_train_step(cfg, mesh)
    out_state_shardings = compiled.output_shardings[0]
    want = step_lib.state_shardings(mesh, step_lib.abstract_state(cfg, mesh))
    for got, exp in zip(jax.tree.leaves(out_state_shardings), jax.tree.leaves(want)):
        assert got.is_equivalent_to(exp, len(exp.spec) or 0) or got.spec == exp.spec
    assert np.isfinite(compiled.memory_analysis().temp_size_in_bytes)


@pytest.mark.slow
def test_only_one_layer_of_gathered_weights_is_live():
    """Each layer's weights are all-gathered inside the layer scan: adding layers adds per-device temp bytes
    far below one full (gathered) layer's weights per layer."""

    def temp(layers):
        cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "remat.policy=full", "model.hidden=256",
                       "model.mlp_hidden=1024", "model.head_dim=32", f"model.layers={layers}", "seq_len=32")
        return step_lib.compile_train_step(cfg, mesh_for(cfg, 8)).memory_analysis().temp_size_in_bytes, cfg

    (t2, _), (t8, cfg) = temp(2), temp(8)
    m = cfg.model
    layer_bytes = 4 * (m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden
                       + 3 * m.hidden * m.mlp_hidden)
    assert (t8 - t2) / 6 < 0.5 * layer_bytes, (t2, t8, layer_bytes)


def test_a_run_spans_its_mesh_num_devices_of_the_simulated_devices():
    """On the CPU in one process the mesh takes the first `mesh.num_devices` devices (this process has 8), so a
    `mesh.num_devices=1` override of the trainer or `python -m jaxlong.eval` means one device; a -1 axis fills
    up to `mesh.num_devices`; fixed axes over more devices than exist are refused."""
    from jaxlong.config import MeshConfig  # noqa: PLC0415
    from jaxlong.core.errors import ConfigError  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh, run_devices  # noqa: PLC0415

    assert len(jax.devices()) == 8
    one = build_mesh(MeshConfig(fsdp=1, context=1, num_devices=1))
    assert one.devices.size == 1 and one.devices.flat[0] == jax.devices()[0]
    assert dict(build_mesh(MeshConfig(fsdp=-1, ring=2, context=1, num_devices=4)).shape) == \
        {"data": 1, "fsdp": 2, "ring": 2, "context": 1}
    assert run_devices(MeshConfig(num_devices=8)) == jax.devices()
    assert run_devices(MeshConfig(num_devices=3)) == jax.devices()[:3]
    with pytest.raises(ConfigError, match="= 16, but there are 8 devices"):
        build_mesh(MeshConfig(fsdp=4, context=4, num_devices=16))
