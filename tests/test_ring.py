"""Ring attention (zigzag, causal) and its hybrids equal the dense single-device reference: forward and
dq, dk, dv (float32, rtol 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxlong.attention.kernels import reference_attention
from jaxlong.ring import ring_attention, unzigzag, zigzag, zigzag_order, zigzag_positions

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


@pytest.mark.parametrize("ring", [2, 4, 8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
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
