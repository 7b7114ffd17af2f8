"""FSDP x Ulysses equals the dense single-device model: loss and every gradient (float32, rtol 1e-5)."""

import jax
import numpy as np
import pytest
from helpers import assert_matches_single_device, loss_and_grads, random_batch, reference_cfg, tiered, tiny_cfg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.kernels.blockwise import reference_attention
from jaxlong.layers.blocks import apply_rope, rope_tables
from jaxlong.parallel.ulysses import ulysses_attention


@pytest.mark.parametrize(*tiered(
    "mesh_overrides",
    [
        ("mesh.fsdp=2", "mesh.context=4"),  # kv_heads 4 = C: KV heads split
        ("mesh.fsdp=1", "mesh.context=8", "global_batch=1", "model.kv_heads=2"),  # H_kv < C: replicated
        ("mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "global_batch=4"),  # data parallel too
    ],
    ids=["fsdp2-cp4-kvsplit", "cp8-kvreplicated", "dp2-fsdp2-cp2"], fast={"cp8-kvreplicated", "dp2-fsdp2-cp2"}))
def test_fsdp_ulysses_matches_single_device(mesh_overrides):
    cfg = tiny_cfg(*mesh_overrides)
    assert_matches_single_device(cfg)


def test_remat_full_and_tied_embeddings_match_single_device():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "remat.policy=full", "model.tie_embeddings=true")
    assert_matches_single_device(cfg, seed=3)


def test_ulysses_attention_uses_global_rope_positions():
    """RoPE is applied with global token positions: rotating each context shard by its *local* positions
    would change the result, and the sharded op equals the single-device one."""
    mesh = jax.make_mesh((1, 2, 4), ("data", "fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    b, s, h, d = 2, 64, 8, 16
    q, k, v = (jax.random.normal(jax.random.key(i), (b, s, h, d)) for i in range(3))
    pos = np.broadcast_to(np.arange(s), (b, s))
    cos, sin = rope_tables(pos, d, 10000.0)
    q0, k0 = q, k
    q, k = apply_rope(q0, cos, sin), apply_rope(k0, cos, sin)
    spec = NamedSharding(mesh, P(("data", "fsdp"), "context", None, None))
    out = ulysses_attention(*(jax.device_put(x, spec) for x in (q, k, v)), mesh=mesh, backend="blockwise",
                            block_q=16, block_k=16)
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    local = np.broadcast_to(np.arange(s) % (s // 4), (b, s))
    lcos, lsin = rope_tables(local, d, 10000.0)
    wrong = reference_attention(apply_rope(q0, lcos, lsin), apply_rope(k0, lcos, lsin), v)
    assert np.max(np.abs(np.asarray(wrong) - np.asarray(out))) > 1e-2


def test_tiled_loss_and_mlp_match_single_device():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "remat.policy=full", "tiling.loss=true",
                   "tiling.loss_tile=4", "tiling.mlp=true", "tiling.mlp_tiles=2")
    assert_matches_single_device(cfg, seed=11)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights_and_tracks_fp32_loss():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "compute_dtype=bfloat16")
    batch = random_batch(cfg, seed=13)
    ref = reference_cfg(cfg)
    ref.compute_dtype = "float32"
    ref_loss, ref_grads, params = loss_and_grads(ref, 1, batch)
    loss, grads, _ = loss_and_grads(cfg, 8, batch, params_host=params)
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
