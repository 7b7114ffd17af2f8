"""Ring attention (zigzag, causal) and its hybrids equal the dense single-device reference: forward and
dq, dk, dv (float32, rtol 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pairwise, tiered
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.kernels.blockwise import reference_attention
from jaxlong.parallel.ring import ring_attention, unzigzag, zigzag, zigzag_positions

TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(b, s, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, h, d))
    k = jax.random.normal(ks[1], (b, s, kvh, d))
    v = jax.random.normal(ks[2], (b, s, kvh, d))
    ct = jax.random.normal(ks[3], (b, s, h, d))
    return q, k, v, ct


def _grads(fn, q, k, v, ct):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)


def test_zigzag_layout():
    order = zigzag_order(16, 2)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    x = jnp.arange(2 * 16).reshape(2, 16)
    np.testing.assert_array_equal(zigzag(x, 2), np.asarray(x)[:, order])
    np.testing.assert_array_equal(unzigzag(zigzag(x, 4), 4), x)
    np.testing.assert_array_equal(zigzag_positions(jnp.arange(16), 16, 2), order)
    np.testing.assert_array_equal(zigzag_positions(jnp.arange(48), 48, 3), zigzag_order(48, 3))


@pytest.mark.parametrize(*pairwise(
    {"ring": [2, 4, 8], "heads,kv_heads": [(4, 4), (8, 2)], "causal": [True, False]},
    fast=[(2, (4, 4), True), (8, (8, 2), True), (4, (8, 2), False)],
    ids={"heads,kv_heads": ["mha", "gqa4"], "causal": ["causal", "full"]}))
def test_ring_attention_matches_reference(ring, heads, kv_heads, causal):
    if not causal and (ring, heads) != (4, 8):
        pytest.skip("non-causal: one case")
    mesh = jax.make_mesh((8 // ring, ring), ("fsdp", "ring"), axis_types=(AxisType.Auto,) * 2)
    b, s, d = 8 // ring, 64, 16
    q, k, v, ct = _qkv(b, s, heads, kv_heads, d)
    sh = NamedSharding(mesh, P("fsdp", "ring", None, None))

    def ring_fn(q, k, v):  # natural order in and out; zigzag inside
        args = [jax.device_put(zigzag(x, ring), sh) for x in (q, k, v)]
        out = ring_attention(*args, mesh=mesh, causal=causal, block_q=4, block_k=4)
        return unzigzag(out, ring)

    ref = lambda q, k, v: reference_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(jax.jit(ring_fn)(q, k, v), ref(q, k, v), **TOL)
    got = jax.jit(lambda *a: _grads(ring_fn, *a))(q, k, v, ct)
    want = _grads(ref, q, k, v, ct)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, w, err_msg=name, **TOL)


# ----------------------------------------------------------------------------- hybrids

from helpers import RING_SEQ, ring_mesh  # noqa: E402

from jaxlong.layers.blocks import apply_rope, rope_tables  # noqa: E402
from jaxlong.parallel.ulysses import ulysses_attention  # noqa: E402
from jaxlong.parallel.record import SublayerContext, SublayerWeights  # noqa: E402
from jaxlong.parallel.upipe import upipe_attention  # noqa: E402
from jaxlong.core.batch import zigzag_order

_mesh, SEQ = ring_mesh, RING_SEQ


@pytest.mark.parametrize(*tiered(
    "ring,context,heads,kv_heads", [(2, 4, 8, 4), (4, 2, 8, 1), (8, 1, 8, 2)],
    ids=["r2c4-kvsplit", "r4c2-kvreplicated", "r8c1-gqa"], fast={"r4c2-kvreplicated"}))
def test_ulysses_ring_hybrid_matches_reference(ring, context, heads, kv_heads):
    mesh = _mesh(ring, context)
    b, s, d = 8 // (ring * context), 64, 8
    q, k, v, ct = _qkv(b, s, heads, kv_heads, d, seed=2)
    sh = NamedSharding(mesh, P(*SEQ, None, None))

    def hybrid(q, k, v):
        args = [jax.device_put(zigzag(x, ring), sh) for x in (q, k, v)]
        return unzigzag(ulysses_attention(*args, mesh=mesh, backend="blockwise", block_q=4, block_k=4), ring)

    np.testing.assert_allclose(jax.jit(hybrid)(q, k, v), reference_attention(q, k, v), **TOL)
    got = jax.jit(lambda *a: _grads(hybrid, *a))(q, k, v, ct)
    for name, a, w in zip(("dq", "dk", "dv"), got, _grads(reference_attention, q, k, v, ct)):
        np.testing.assert_allclose(a, w, err_msg=name, **TOL)


def _dense_layer(x, wq, wk, wv, theta=10000.0):
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = rope_tables(pos, wq.shape[-1], theta)
    q = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wq), cos, sin)
    k = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wk), cos, sin)
    return reference_attention(q, k, jnp.einsum("bsh,hnd->bsnd", x, wv))


@pytest.mark.parametrize(*tiered(
    "ring,context,u_per_c,kv_heads", [(2, 4, 1, 2), (2, 4, 2, 4), (4, 2, 1, 2), (4, 2, 2, 1), (8, 1, 1, 4), (8, 1, 2, 2)],
    ids=["r2c4-U=C-kvrep", "r2c4-U=2C-kvsplit", "r4c2-U=C-kvsplit", "r4c2-U=2C-kvrep", "r8c1-U=C", "r8c1-U=2C"],
    fast={"r4c2-U=C-kvsplit"}))  # U = 2C x ring: test_model_with_ring_matches_single_device
def test_upipe_ring_hybrid_matches_reference(ring, context, u_per_c, kv_heads):
    """U-Pipe x ring: each stage runs ring attention for its heads; RoPE positions follow the zigzag layout."""
    mesh = _mesh(ring, context)
    heads, hidden, d, s = 8, 32, 8, 64
    b = 8 // (ring * context)
    ks = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(ks[0], (b, s, hidden))
    wq = jax.random.normal(ks[1], (hidden, heads, d)) / hidden**0.5
    wk = jax.random.normal(ks[2], (hidden, kv_heads, d)) / hidden**0.5
    wv = jax.random.normal(ks[3], (hidden, kv_heads, d)) / hidden**0.5
    ct = jax.random.normal(ks[4], (b, s, heads, d))
    sh = NamedSharding(mesh, P(*SEQ, None))

    def upipe(x, wq, wk, wv):
        ctx = SublayerContext(mesh, heads_per_stage=u_per_c * context, backend="blockwise", block_q=4, block_k=4)
        out = upipe_attention(jax.device_put(zigzag(x, ring), sh), SublayerWeights(None, wq, wk, wv), ctx)
        return unzigzag(out, ring)

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2, 3))(x, wq, wk, wv)

    np.testing.assert_allclose(jax.jit(upipe)(x, wq, wk, wv), _dense_layer(x, wq, wk, wv), **TOL)
    got = jax.jit(lambda: grads(upipe))()
    for name, a, w in zip(("dx", "dWq", "dWk", "dWv"), got, grads(_dense_layer)):
        np.testing.assert_allclose(a, w, err_msg=name, **TOL)


# ----------------------------------------------------------------------------- whole model

from helpers import assert_matches_single_device, tiny_cfg  # noqa: E402


@pytest.mark.parametrize(*tiered(
    "overrides",
    [
        ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4"),
        ("mesh.fsdp=2", "mesh.ring=4", "mesh.context=1", "remat.policy=full", "tiling.loss=true",
         "tiling.loss_tile=4", "tiling.mlp=true", "tiling.mlp_tiles=2"),
        ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe"),
        ("mesh.fsdp=1", "mesh.ring=4", "mesh.context=2", "attention.impl=upipe", "attention.heads_per_stage=4",
         "model.kv_heads=1"),
    ], ids=["ulysses-r2c4", "ring4-fsdp2-remat-tiled", "upipe-fsdp2-r2c2", "upipe-r4c2-U=2C-kvrep"],
        fast={"upipe-r4c2-U=2C-kvrep"}))
def test_model_with_ring_matches_single_device(overrides):
    """Zigzag layout of the batch, RoPE positions and the hybrids: the loss and every gradient equal the
    single-device model on the natural token order."""
    assert_matches_single_device(tiny_cfg(*overrides, "data.packing=concat"))  # ring: one causal stream
