"""RMSNorm's hand-written backward, and the values of `jaxlong.core.ordering`'s opaque buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import axes_mesh

from jaxlong.core.ordering import grads_together, opaque_one, varying_axes, zeros_after
from jaxlong.layers.blocks import rms_norm


def _plain_rms_norm(x, scale, eps):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


def test_rms_norm_matches_autodiff_of_the_formula():
    ks = jax.random.split(jax.random.key(0), 3)
    x = 3.0 * jax.random.normal(ks[0], (2, 64, 32))
    scale = 1.0 + 0.1 * jax.random.normal(ks[1], (32,))
    ct = jax.random.normal(ks[2], x.shape)
    loss = lambda fn: (lambda x, s: jnp.sum(fn(x, s, 1e-5) * ct))
    np.testing.assert_allclose(rms_norm(x, scale, 1e-5), _plain_rms_norm(x, scale, 1e-5), rtol=1e-6)
    got = jax.grad(loss(rms_norm), argnums=(0, 1))(x, scale)
    want = jax.grad(loss(_plain_rms_norm), argnums=(0, 1))(x, scale)
    for name, a, b in zip(("dx", "d_scale"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def _mesh():
    return axes_mesh(context=8)


@pytest.mark.parametrize("value", [0.0, -np.inf])
def test_zeros_after_is_exact_even_for_nan_inputs(value):
    def local(dep):
        assert varying_axes(dep) == ("context",)
        z = zeros_after(dep, (4, 3), jnp.float32, value=value)
        return z[None], (opaque_one(dep, jnp.float32) * jnp.ones(()))[None]

    dep = jnp.full((8, 5), jnp.nan).at[3].set(jnp.inf)
    z, one = jax.jit(jax.shard_map(local, mesh=_mesh(), in_specs=P("context"), out_specs=(P("context"), P("context"))))(dep)
    np.testing.assert_array_equal(z, np.full((8, 4, 3), value, np.float32))
    np.testing.assert_array_equal(one, np.ones(8, np.float32))
    assert varying_axes(jnp.ones(3)) == ()
    np.testing.assert_array_equal(zeros_after(jnp.ones(3), (2,), jnp.float32), np.zeros(2))  # no mesh: plain



def test_grads_together_changes_no_value_or_gradient_and_orders_the_backward():
    ks = jax.random.split(jax.random.key(1), 2)
    x, w = jax.random.normal(ks[0], (4, 8)), jax.random.normal(ks[1], (8, 16))

    def loss(tie):
        def f(x, w):
            if tie:
                x, w = grads_together(x, w)
            return jnp.sum(jnp.tanh(x @ w))
        return f

    np.testing.assert_array_equal(loss(True)(x, w), loss(False)(x, w))
    for a, b in zip(jax.grad(loss(True), (0, 1))(x, w), jax.grad(loss(False), (0, 1))(x, w)):
        np.testing.assert_array_equal(a, b)
    # The backward holds both cotangents behind one barrier: x's cotangent depends on w's.
    text = jax.jit(jax.grad(loss(True), (0, 1))).lower(x, w).as_text()
    assert "optimization_barrier" in text
