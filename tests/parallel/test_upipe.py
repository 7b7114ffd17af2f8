"""U-Pipe equals Ulysses and the single-device reference (loss and every gradient), and saves memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_single_device, axes_mesh, tiered, tiny_cfg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import ConfigError
from jaxlong.kernels.blockwise import reference_attention
from jaxlong.layers.blocks import apply_rope, rms_norm, rope_tables
from jaxlong.parallel.ulysses import ulysses_attention
from jaxlong.parallel.record import SublayerContext, SublayerWeights
from jaxlong.parallel.upipe import Schedule, upipe_attention

CASES = {
    # name: (heads, kv_heads, context, U, fsdp, batch)
    "mha-U=C": (8, 8, 4, 4, 2, 2),
    "gqa4-U=C": (16, 4, 4, 4, 2, 2),  # Llama3-8B's g = 4, scaled down
    "gqa4-U=2C": (16, 4, 4, 8, 2, 2),
    "gqa4-U=H": (16, 4, 4, 16, 2, 2),
    "kv<C-U=C": (16, 2, 8, 8, 1, 1),  # 16 heads, 2 KV heads, C = 8: KV replicated
    "kv<C-U=2C": (16, 2, 8, 16, 1, 1),
}


def _mesh(fsdp, context):
    return axes_mesh(data=1, fsdp=fsdp, context=context)


def _op_inputs(heads, kv_heads, batch, seq=64, hidden=32, d=8):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (batch, seq, hidden))
    wq = jax.random.normal(ks[1], (hidden, heads, d)) / hidden**0.5
    wk = jax.random.normal(ks[2], (hidden, kv_heads, d)) / hidden**0.5
    wv = jax.random.normal(ks[3], (hidden, kv_heads, d)) / hidden**0.5
    ct = jax.random.normal(ks[4], (batch, seq, heads, d))
    return x, wq, wk, wv, ct


def _dense(x, wq, wk, wv, theta=10000.0):
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = rope_tables(pos, wq.shape[-1], theta)
    q = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wq), cos, sin)
    k = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wk), cos, sin)
    v = jnp.einsum("bsh,hnd->bsnd", x, wv)
    return reference_attention(q, k, v)


def _ulysses(x, wq, wk, wv, mesh, theta=10000.0):
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = rope_tables(pos, wq.shape[-1], theta)
    q = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wq), cos, sin)
    k = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wk), cos, sin)
    v = jnp.einsum("bsh,hnd->bsnd", x, wv)
    return ulysses_attention(q, k, v, mesh=mesh, backend="blockwise", block_q=16, block_k=16)


@pytest.mark.parametrize(*tiered("case", list(CASES), ids=list(CASES), fast={"gqa4-U=C", "gqa4-U=2C", "kv<C-U=2C"}))
def test_upipe_op_matches_ulysses_and_reference(case):
    heads, kv_heads, context, u, fsdp, batch = CASES[case]
    mesh = _mesh(fsdp, context)
    x, wq, wk, wv, ct = _op_inputs(heads, kv_heads, batch)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), "context", None)))

    def loss(fn):
        return lambda x, wq, wk, wv: jnp.sum(fn(x, wq, wk, wv) * ct)

    ctx = SublayerContext(mesh, impl="upipe", heads_per_stage=u, rope_theta=10000.0, backend="blockwise", block_q=16, block_k=16)
    upipe = lambda x, *w: upipe_attention(x, SublayerWeights(None, *w), ctx)
    ulysses = lambda *a: _ulysses(*a, mesh)
    ref_out = jax.jit(_dense)(x, wq, wk, wv)  # one program: eager ops on sharded x dispatch collectives
    for fn in (upipe, ulysses):
        np.testing.assert_allclose(jax.jit(fn)(x, wq, wk, wv), ref_out, rtol=1e-5, atol=1e-5)
    g_ref = jax.jit(jax.grad(loss(_dense), argnums=(0, 1, 2, 3)))(x, wq, wk, wv)
    g_up = jax.jit(jax.grad(loss(upipe), argnums=(0, 1, 2, 3)))(x, wq, wk, wv)
    g_ul = jax.jit(jax.grad(loss(ulysses), argnums=(0, 1, 2, 3)))(x, wq, wk, wv)
    for name, a, b, c in zip(("dx", "dWq", "dWk", "dWv"), g_up, g_ul, g_ref):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5, err_msg=f"{name} vs reference")
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{name} vs ulysses")


@pytest.mark.parametrize(*tiered("case", ["gqa4-U=C", "kv<C-U=C"], ids=["gqa4-U=C", "kv<C-U=C"], fast={"kv<C-U=C"}))
def test_upipe_with_fused_norm_matches_norm_then_upipe(case):
    """`norm_scale=`: the op normalizes x itself (and recomputes the norm in its backward); loss and the
    gradients of x, the norm scale and every weight equal RMSNorm followed by the dense reference."""
    heads, kv_heads, context, u, fsdp, batch = CASES[case]
    mesh = _mesh(fsdp, context)
    x, wq, wk, wv, ct = _op_inputs(heads, kv_heads, batch)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), "context", None)))
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), (x.shape[-1],))

    def fused(x, scale, wq, wk, wv):
        out = upipe_attention(x, SublayerWeights(scale, wq, wk, wv), SublayerContext(mesh, impl="upipe", heads_per_stage=u, rope_theta=10000.0, backend="blockwise", block_q=16, block_k=16))
        return jnp.sum(out * ct)

    def dense(x, scale, wq, wk, wv):
        return jnp.sum(_dense(rms_norm(x, scale, 1e-5), wq, wk, wv) * ct)

    args = (x, scale, wq, wk, wv)
    np.testing.assert_allclose(jax.jit(fused)(*args), jax.jit(dense)(*args), rtol=1e-5)
    g_fused = jax.jit(jax.grad(fused, argnums=range(5)))(*args)
    g_dense = jax.jit(jax.grad(dense, argnums=range(5)))(*args)
    for name, a, b in zip(("dx", "d_scale", "dWq", "dWk", "dWv"), g_fused, g_dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def _sublayer_case(case, dtype=jnp.float32):
    """Mesh, U, the sublayer's arguments `(x, scale, wq, wk, wv, wo)` in `dtype` (x sharded) and a cotangent."""
    heads, kv_heads, context, u, fsdp, batch = CASES[case]
    mesh = _mesh(fsdp, context)
    x, wq, wk, wv, _ = _op_inputs(heads, kv_heads, batch)
    hidden, d = x.shape[-1], wq.shape[-1]
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), (hidden,))
    wo = jax.random.normal(jax.random.key(8), (heads, d, hidden)) / (heads * d) ** 0.5
    ct = jax.random.normal(jax.random.key(9), x.shape)
    args = [a.astype(dtype) for a in (x, scale, wq, wk, wv, wo)]
    args[0] = jax.device_put(args[0], NamedSharding(mesh, P(("data", "fsdp"), "context", None)))
    return mesh, u, tuple(args), ct


def _dense_sublayer(x, scale, wq, wk, wv, wo):
    return x + jnp.einsum("bsnd,ndh->bsh", _dense(rms_norm(x, scale, 1e-5), wq, wk, wv), wo)


def _upipe_sublayer(mesh, u):
    ctx = SublayerContext(mesh, impl="upipe", heads_per_stage=u, rope_theta=10000.0, backend="blockwise", block_q=16, block_k=16)
    return lambda x, scale, wq, wk, wv, wo: upipe_attention(x, SublayerWeights(scale, wq, wk, wv, wo), ctx)


@pytest.mark.parametrize(*tiered("case", ["gqa4-U=C", "gqa4-U=2C", "kv<C-U=C"], ids=["gqa4-U=C", "gqa4-U=2C", "kv<C-U=C"],
                                 fast={"gqa4-U=2C"}))
def test_upipe_sublayer_with_out_projection_matches_dense(case):
    """`out_weight=`: the op returns `x + W_o attention(RMSNorm(x))` and forms each stage's output gradient
    from the `[b, S, hidden]` one; loss and the gradients of x, the norm scale, W_q, W_k, W_v and W_o equal
    autodiff of the dense sublayer."""
    mesh, u, args, ct = _sublayer_case(case)
    sublayer = _upipe_sublayer(mesh, u)

    def fused(*a):
        return jnp.sum(sublayer(*a) * ct)

    def dense(*a):
        return jnp.sum(_dense_sublayer(*a) * ct)

    np.testing.assert_allclose(jax.jit(fused)(*args), jax.jit(dense)(*args), rtol=1e-5)
    g_fused = jax.jit(jax.grad(fused, argnums=range(6)))(*args)
    g_dense = jax.jit(jax.grad(dense, argnums=range(6)))(*args)
    for name, a, b in zip(("dx", "d_scale", "dWq", "dWk", "dWv", "dWo"), g_fused, g_dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_upipe_sublayer_in_bfloat16_is_as_accurate_as_ulysses():
    """bf16 inputs and compute: the U-Pipe sublayer's loss and gradients are as close to a float32 reference
    (same bf16-rounded inputs) as the Ulysses sublayer's are, i.e. the op's casts lose nothing extra."""
    mesh, u, bf, ct = _sublayer_case("gqa4-U=C", jnp.bfloat16)
    sublayer = _upipe_sublayer(mesh, u)

    def upipe(*a):
        return jnp.sum(sublayer(*a).astype(jnp.float32) * ct)

    def ulysses(x, scale, wq, wk, wv, wo):
        attn = _ulysses(rms_norm(x, scale, 1e-5), wq, wk, wv, mesh)
        return jnp.sum((x + jnp.einsum("bsnd,ndh->bsh", attn, wo)).astype(jnp.float32) * ct)

    def dense(*a):
        return jnp.sum(_dense_sublayer(*a) * ct)

    ref = jax.jit(jax.value_and_grad(dense, argnums=range(6)))(*[a.astype(jnp.float32) for a in bf])
    got = {f.__name__: jax.jit(jax.value_and_grad(f, argnums=range(6)))(*bf) for f in (upipe, ulysses)}

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    for i, name in enumerate(("dx", "d_scale", "dWq", "dWk", "dWv", "dWo")):
        e_up, e_ul = rel(got["upipe"][1][i], ref[1][i]), rel(got["ulysses"][1][i], ref[1][i])
        assert e_up <= 2 * e_ul + 2e-3 and e_up < 0.03, (name, e_up, e_ul)
    assert rel(got["upipe"][0], ref[0]) < 1e-2


def test_upipe_out_weight_needs_norm_scale_and_its_shape():
    mesh = _mesh(2, 4)
    x, wq, wk, wv, _ = _op_inputs(16, 4, 2)
    with pytest.raises(ValueError, match="need the attention norm.s scale"):
        upipe_attention(x, SublayerWeights(None, wq, wk, wv, jnp.zeros((16, 8, 32))),
                        SublayerContext(mesh, heads_per_stage=4))
    with pytest.raises(ValueError, match="W_o must be \\[heads, head_dim, hidden\\] = \\[16, 8, 32\\]"):
        upipe_attention(x, SublayerWeights(jnp.ones((32,)), wq, wk, wv, jnp.zeros((128, 32))),
                        SublayerContext(mesh, heads_per_stage=4))


def test_upipe_natural_head_order_with_distinct_heads():
    """Each head gets a distinct weight; a wrong output permutation would swap heads and show up here."""
    heads, kv_heads, context = 16, 4, 4
    mesh = _mesh(2, context)
    x, wq, wk, wv, _ = _op_inputs(heads, kv_heads, 2)
    wq = wq * (1.0 + jnp.arange(heads))[None, :, None]
    out = upipe_attention(x, SublayerWeights(None, wq, wk, wv), SublayerContext(mesh, heads_per_stage=4,
                                                                                backend="reference"))
    np.testing.assert_allclose(out, _dense(x, wq, wk, wv), rtol=1e-5, atol=1e-5)


def test_schedule_matches_paper_formula_and_covers_all_heads():
    sch = Schedule(heads=32, kv_heads=8, context=8, heads_per_stage=8)  # Llama3-8B, U = C
    g = 4
    seen = []
    for t in range(sch.groups):
        for u in range(sch.stages_per_group):
            s = t * sch.stages_per_group + u
            for r in range(8):
                kv = (s // g) * 8 + r
                assert sch.query_heads(t, u, r) == [kv * g + (s % g)]
                seen += sch.query_heads(t, u, r)
    assert sorted(seen) == list(range(32))
    for u_ in (16, 32):
        sch = Schedule(32, 8, 8, u_)
        heads = [h for t in range(sch.groups) for u in range(sch.stages_per_group) for r in range(8)
                 for h in sch.query_heads(t, u, r)]
        assert sorted(heads) == list(range(32))


@pytest.mark.parametrize("u, match", [(2, "multiple of mesh.context=4"), (12, "divide model.heads=16"),
                                      (0, "heads_per_stage=0 must be a multiple of mesh.context=4 and divide model.heads=16$")])
def test_bad_heads_per_stage_raise(u, match):
    with pytest.raises(ConfigError, match=match):
        Schedule(16, 4, 4, u).validate()


@pytest.mark.parametrize(*tiered("overrides", [
    ("model.heads=8", "model.kv_heads=2", "attention.heads_per_stage=4"),  # g = 4 per KV head, U = C
    ("model.heads=8", "model.kv_heads=2", "attention.heads_per_stage=8", "remat.policy=full"),
    ("model.heads=8", "model.kv_heads=2", "attention.heads_per_stage=4", "remat.policy=offload",
     "tiling.loss=true", "tiling.mlp=true"),  # the ALST stack with U-Pipe, as the memory ladder runs it
], ids=["U=C", "U=2C-remat-full", "U=C-alst-stack"], fast={"U=2C-remat-full", "U=C-alst-stack"}))
def test_upipe_model_matches_single_device(overrides):
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", *overrides)
    assert_matches_single_device(cfg, seed=5)
