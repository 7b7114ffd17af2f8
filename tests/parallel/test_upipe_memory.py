"""Compiled memory of one U-Pipe attention layer (nothing is allocated: compile and read `memory_analysis`).

Llama3-8B (H 32, H_kv 8, d 128, hidden 4096) and the 64-head Qwen3-32B shape (H 64, H_kv 8, d 128, hidden 5120)
at S = 256K tokens over C = 8 simulated devices, float32 (XLA's CPU backend computes bf16 matmuls and
all-to-alls in float32, so bf16 figures would not be what a GPU uses). Per-device temp bytes of the forward and
of forward + backward (a `jax.vjp` with the cotangent as an argument) must fall strictly as U falls, stay within
15% of `attention_memory_model`, and at U = C be well below Ulysses'. A naive U-Pipe, a plain `lax.scan` over
stages differentiated by autodiff, stacks every stage's residuals; its gradient must cost much more.
"""

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from helpers import axes_mesh, pairwise, tiered
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.kernels.blockwise import blockwise_attention
from jaxlong.layers.blocks import apply_rope, rope_tables
from jaxlong.parallel.ulysses import heads_to_seq, seq_to_heads
from jaxlong.parallel.upipe import accumulate_product, attention_layer, attention_memory_model

# Every program here is compiled with XLA's default CPU fusion emitters: its buffers are compared with the memory
# model (tests/xla_flags.py).
pytestmark = pytest.mark.usefixtures("default_emitters")
S, C, BLOCK = 262144, 8, 1024
SHAPES = {  # heads, kv_heads, head_dim, hidden
    "llama3-8b": (32, 8, 128, 4096),
    "qwen3-32b": (64, 8, 128, 5120),
}
TOLERANCE = 0.15
# U-Pipe (U = C) / Ulysses, forward + backward: at most this (the model gives 0.64 and 0.45; measured 0.76, 0.46).
MAX_RATIO = {"llama3-8b": 0.8, "qwen3-32b": 0.55}


@functools.cache
def _mesh():
    return axes_mesh(data=1, fsdp=1, context=C)


def _abstract(shape):
    heads, kv_heads, d, hidden = SHAPES[shape]
    mesh = _mesh()
    act = NamedSharding(mesh, P(("data", "fsdp"), "context", None))
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((1, S, hidden), jnp.float32, sharding=act)
    ws = [jax.ShapeDtypeStruct((hidden, n, d), jnp.float32, sharding=rep) for n in (heads, kv_heads, kv_heads)]
    ct_sharding = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    ct = jax.ShapeDtypeStruct((1, S, heads, d), jnp.float32, sharding=ct_sharding)
    return x, ws, ct


def _temp_bytes(fn, shape, backward):
    x, ws, ct = _abstract(shape)
    if not backward:
        return jax.jit(fn).lower(x, *ws).compile().memory_analysis().temp_size_in_bytes

    def fwd_bwd(x, wq, wk, wv, ct):
        _, vjp = jax.vjp(fn, x, wq, wk, wv)
        return vjp(ct)

    return jax.jit(fwd_bwd).lower(x, *ws, ct).compile().memory_analysis().temp_size_in_bytes


@functools.cache
def _measured(shape, impl, u, backward):
    layer = attention_layer(impl, _mesh(), heads_per_stage=u, backend="blockwise", block_q=BLOCK, block_k=BLOCK)
    return _temp_bytes(layer, shape, backward)


def _model(shape, impl, u, backward):
    heads, kv_heads, d, hidden = SHAPES[shape]
    return sum(attention_memory_model(impl, 1, S, heads, kv_heads, d, hidden, C, u, 4, backward).values())


def _stage_sizes(shape):
    heads = SHAPES[shape][0]
    return [heads >> i for i in range(int(math.log2(heads // C)) + 1)]  # H, H/2, ..., C


@pytest.mark.parametrize(*pairwise({"shape": list(SHAPES), "backward": [False, True]},
                                   fast=[(list(SHAPES)[0], True), (list(SHAPES)[1], False)],
                                   ids={"backward": ["fwd", "fwd+bwd"]}))
def test_temp_bytes_fall_with_heads_per_stage_and_match_model(shape, backward):
    us = _stage_sizes(shape)
    measured = [_measured(shape, "upipe", u, backward) for u in us]
    table = [(u, m / 2**20, _model(shape, "upipe", u, backward) / 2**20) for u, m in zip(us, measured)]
    for a, b in zip(measured, measured[1:]):
        assert b < a, f"temp bytes must fall as U falls: (U, measured MiB, model MiB) {table}"
    for u, m, model in table:
        assert abs(model - m) <= TOLERANCE * m, f"U={u}: measured {m:.0f} MiB vs model {model:.0f} MiB; {table}"


@pytest.mark.parametrize(*tiered("shape", list(SHAPES), ids=list(SHAPES), fast={"llama3-8b"}))
def test_upipe_at_u_equal_c_is_well_below_ulysses(shape):
    upipe = _measured(shape, "upipe", C, True)
    ulysses = _measured(shape, "ulysses", None, True)
    assert upipe <= MAX_RATIO[shape] * ulysses, (upipe / 2**20, ulysses / 2**20)
    assert abs(_model(shape, "ulysses", None, True) - ulysses) <= TOLERANCE * ulysses


def _naive_upipe(mesh, u):
    """U-Pipe as a plain `lax.scan` over stages, differentiated by autodiff (no custom_vjp). U = C, GQA with
    H_kv = C: stage s gives device r the query head `r*g + s`, the one that uses the KV head r holds."""

    def local(x, wq, wk, wv):
        b, s_loc, _ = x.shape
        d = wq.shape[-1]
        pos = jax.lax.axis_index("context") * s_loc + jnp.arange(s_loc)
        cos, sin = rope_tables(jnp.broadcast_to(pos, (b, s_loc)), d, 500000.0)
        k = seq_to_heads(apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wk), cos, sin))
        v = seq_to_heads(jnp.einsum("bsh,hnd->bsnd", x, wv))
        g = wq.shape[1] // wk.shape[1]
        wq_v = wq.reshape(wq.shape[0], u, g, d)

        def stage(carry, s):
            q = seq_to_heads(apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wq_v[:, :, s]), cos, sin))
            return carry, heads_to_seq(blockwise_attention(q, k, v, block_q=BLOCK, block_k=BLOCK))

        _, outs = jax.lax.scan(stage, None, jnp.arange(g))  # [g, b, S/C, U, d]
        return jnp.moveaxis(outs, 0, 3).reshape(b, s_loc, -1, d)  # natural head order r*g + s

    act, rep = P(("data", "fsdp"), "context", None), P()
    return jax.shard_map(local, mesh=mesh, in_specs=(act, rep, rep, rep),
                         out_specs=P(("data", "fsdp"), "context", None, None), check_vma=False)


def test_naive_autodiff_scan_gradient_costs_much_more():
    """The regression the custom_vjp prevents: autodiff of a plain scan saves every stage's Q and attention output
    (all H/C heads' worth over the g stages) for the backward. Qwen shape: g = 8 stages of one head per device."""
    shape = "qwen3-32b"
    naive = _temp_bytes(_naive_upipe(_mesh(), C), shape, True)
    upipe = _measured(shape, "upipe", C, True)
    assert naive >= 1.5 * upipe, (naive / 2**20, upipe / 2**20)
    assert naive > (1 + TOLERANCE) * _model(shape, "upipe", C, True)  # so the model check would catch it too


def test_dx_products_are_added_in_place_by_row_blocks():
    """U-Pipe's backward adds each stage's `[b, S/C, hidden]` dx term (dY W^T) into dx block by block: the same
    sum as adding the whole product, and the compiled program holds one block of the product, not all of it."""
    b, s, n, d, hidden, tiles = 1, 4096, 4, 16, 256, 4
    kx, ky, kw = jax.random.split(jax.random.key(0), 3)
    dx = jax.random.normal(kx, (b, s, hidden), jnp.float32)
    dy = jax.random.normal(ky, (b, s, n, d), jnp.float32)
    w = jax.random.normal(kw, (hidden, n, d), jnp.float32)
    whole = jax.jit(functools.partial(accumulate_product, tiles=1))
    blocks = jax.jit(functools.partial(accumulate_product, tiles=tiles))
    expected = dx + jnp.einsum("bsnd,hnd->bsh", dy, w)
    assert jnp.allclose(whole(dx, dy, w), expected, rtol=1e-5, atol=1e-4)
    assert jnp.allclose(blocks(dx, dy, w), expected, rtol=1e-5, atol=1e-4)

    def temp(fn):  # dx donated: the accumulator is updated where it lies, as inside the backward's scan
        return jax.jit(fn, donate_argnums=0).lower(dx, dy, w).compile().memory_analysis().temp_size_in_bytes

    full_product = b * s * hidden * 4
    assert temp(whole) >= full_product
    # One block of the product (a quarter of it) and the block's slice of dY: under half of the whole product.
    assert temp(blocks) < full_product / 2
