"""Tiled cross-entropy and tiled MLP equal their plain versions (value and every gradient, sharded and not),
and keep compiled memory of forward + gradient bounded by one tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import axes_mesh

from jaxlong.layers.blocks import rms_norm
from jaxlong.layers.loss import cross_entropy
from jaxlong.layers.tiled import (
    default_loss_tile,
    default_mlp_tiles,
    swiglu,
    tiled_cross_entropy,
    tiled_loss_sum,
    tiled_mlp,
)

RTOL, ATOL = 1e-5, 1e-6
ACT = P(("data", "fsdp"), "context", None)
TOK = P(("data", "fsdp"), "context")
SDS = jax.ShapeDtypeStruct


def _mesh():
    return axes_mesh(data=1, fsdp=2, context=4)


def _close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _ce_inputs(b=2, s=64, h=16, vocab=48, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(ks[0], (b, s, h))
    head = jax.random.normal(ks[1], (h, vocab)) / h**0.5
    targets = jax.random.randint(ks[2], (b, s), 0, vocab, dtype=jnp.int32)
    mask = (jax.random.uniform(ks[3], (b, s)) > 0.3).astype(jnp.float32)
    return hidden, head, targets, mask


def _ce_grads(loss_fn, hidden, head, targets, mask):
    """Loss and gradients wrt hidden, head and mask."""
    return jax.jit(jax.value_and_grad(lambda x, w, m: loss_fn(x, w, targets, m), argnums=(0, 1, 2)))(
        hidden, head, mask
    )


# ----------------------------------------------------------------------------------------------
# Cross-entropy.


@pytest.mark.parametrize("tile", [8, 16, 64])
def test_tiled_ce_matches_plain(tile):
    args = _ce_inputs()
    want = _ce_grads(cross_entropy, *args)
    got = _ce_grads(lambda *a: tiled_cross_entropy(*a, tile=tile), *args)
    _close(got, want)
    loss_sum, count = jax.jit(lambda *a: tiled_loss_sum(*a, tile=tile))(*args)
    np.testing.assert_allclose(count, args[3].sum())
    np.testing.assert_allclose(loss_sum / count, want[0], rtol=RTOL)


def test_tiled_ce_sharded_matches_plain():
    mesh = _mesh()
    hidden, head, targets, mask = _ce_inputs()  # local seq 64 / 4 = 16 tokens, 4 tiles of 4
    want = _ce_grads(cross_entropy, hidden, head, targets, mask)
    hidden_s = jax.device_put(hidden, NamedSharding(mesh, ACT))
    targets_s, mask_s = (jax.device_put(a, NamedSharding(mesh, TOK)) for a in (targets, mask))
    got = _ce_grads(lambda *a: tiled_cross_entropy(*a, tile=4, mesh=mesh), hidden_s, head, targets_s, mask_s)
    _close(got, want)  # d_head checks that the shard_map transpose sums it exactly once
    assert got[1][0].sharding.spec == ACT


def test_tiled_ce_inside_scan_and_remat():
    hidden, head, targets, mask = _ce_inputs()

    def total(loss_fn, hidden, head):
        def body(c, scale):
            return c + jax.checkpoint(lambda x, w: loss_fn(x * scale, w, targets, mask))(hidden, head), None

        return jax.lax.scan(body, 0.0, jnp.array([1.0, 0.5]))[0]

    grad = lambda fn: jax.jit(jax.value_and_grad(lambda x, w: total(fn, x, w), argnums=(0, 1)))(hidden, head)
    _close(grad(lambda *a: tiled_cross_entropy(*a, tile=16)), grad(cross_entropy))


def test_tiled_ce_sum_of_many_tiles_is_float32_exact():
    """16,384 tiles: the loss sum is within 2e-7 (about one float32 ulp of the sum) of float64's. The tiles' sums
    are added by a reduction tree; a running float32 total rounds at every tile and was off by 1e-6 here."""
    rng = np.random.default_rng(0)
    s, h, vocab = 2**16, 8, 8
    hidden = rng.normal(size=(1, s, h)).astype(np.float32)
    head = rng.normal(size=(h, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, (1, s)).astype(np.int32)
    logits = hidden[0].astype(np.float64) @ head.astype(np.float64)
    want = float(np.sum(np.log(np.exp(logits).sum(-1)) - logits[np.arange(s), targets[0]]))
    got, count = jax.jit(lambda *a: tiled_loss_sum(*a, tile=4))(hidden, head, targets, np.ones((1, s), np.float32))
    assert abs(float(got) - want) <= 2e-7 * want and float(count) == s


def test_tiled_ce_masked_padding_and_empty_mask():
    hidden, head, targets, mask = _ce_inputs()
    padded = jnp.where(mask > 0, targets, -100)  # ignored ids are fine where the mask is 0
    f = jax.jit(jax.value_and_grad(lambda x, t, m: tiled_cross_entropy(x, head, t, m, tile=8)))
    _close(f(hidden, padded, mask), f(hidden, targets, mask))
    loss, grad = f(hidden, targets, jnp.zeros_like(mask))
    assert float(loss) == 0.0 and not np.any(np.asarray(grad))


def test_tiled_ce_bfloat16_dtypes():
    hidden, head, targets, mask = _ce_inputs()
    hb, wb = hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16)
    loss, (dh, dw) = jax.jit(jax.value_and_grad(lambda x, w: tiled_cross_entropy(x, w, targets, mask, tile=16),
                                                argnums=(0, 1)))(hb, wb)
    want, _ = _ce_grads(cross_entropy, hb, wb, targets, mask)
    assert loss.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, want, rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# MLP.


def _mlp_inputs(b=2, s=64, h=16, f=40, seed=1):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (b, s, h))
    w_gate = jax.random.normal(ks[1], (h, f)) / h**0.5
    w_up = jax.random.normal(ks[2], (h, f)) / h**0.5
    w_down = jax.random.normal(ks[3], (f, h)) / f**0.5
    dy = jax.random.normal(ks[4], (b, s, h))
    return (x, w_gate, w_up, w_down), dy


def _mlp_vjp(fn, args, dy):
    def run(*a):
        y, vjp = jax.vjp(fn, *a)
        return y, vjp(dy)

    return jax.jit(run)(*args)


@pytest.mark.parametrize("sharded,tiles", [(False, 4), (False, 1), (True, 2), (True, 4)])
def test_tiled_mlp_matches_plain(sharded, tiles):
    args, dy = _mlp_inputs()
    want = _mlp_vjp(swiglu, args, dy)
    mesh = _mesh() if sharded else None
    if sharded:
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
        args = (put(args[0], ACT), *args[1:])
        dy = put(dy, ACT)
    got = _mlp_vjp(lambda *a: tiled_mlp(*a, tiles=tiles, mesh=mesh), args, dy)
    _close(got, want, atol=1e-5)  # weight grads sum 128 tokens: summation order differs
    if sharded:
        assert got[0].sharding.spec == ACT


def _mlp_sublayer(x, scale, w_gate, w_up, w_down):
    """The model's untiled MLP sublayer: `x + swiglu(rms_norm(x))`."""
    return x + swiglu(rms_norm(x, scale, 1e-5), w_gate, w_up, w_down)


@pytest.mark.parametrize("sharded,tiles", [(False, 4), (True, 2)])
def test_tiled_mlp_with_norm_and_residual_matches_the_sublayer(sharded, tiles):
    """With `norm_scale` the tiles normalize their own tokens and add the residual: the value and the gradients
    of x, the norm scale and the three weights equal those of the untiled sublayer."""
    (x, *ws), dy = _mlp_inputs()
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), (x.shape[-1],))
    want = _mlp_vjp(_mlp_sublayer, (x, scale, *ws), dy)
    mesh = _mesh() if sharded else None
    if sharded:
        x, dy = (jax.device_put(a, NamedSharding(mesh, ACT)) for a in (x, dy))

    def fused(x, scale, *ws):
        return tiled_mlp(x, *ws, tiles=tiles, mesh=mesh, norm_scale=scale, norm_eps=1e-5)

    got = _mlp_vjp(fused, (x, scale, *ws), dy)
    _close(got, want, atol=1e-5)


def test_tiled_mlp_with_norm_holds_no_normalized_copy():
    """Fusing the norm and the residual into the tiles removes the normalized input and its gradient, two
    `[b, s, hidden]` buffers of the forward + backward (Llama-3.1-8B widths, 32K tokens, float32)."""
    seq, hidden, mlp_hidden = 32768, 4096, 14336
    tiles = default_mlp_tiles(seq, hidden)
    act, scale = SDS((1, seq, hidden), jnp.float32), SDS((hidden,), jnp.float32)
    w_in, w_out = SDS((hidden, mlp_hidden), jnp.float32), SDS((mlp_hidden, hidden), jnp.float32)

    def temp(sublayer):
        def fwd_and_grad(x, scale, w_gate, w_up, w_down, dy):
            y, vjp = jax.vjp(sublayer, x, scale, w_gate, w_up, w_down)
            return y, vjp(dy)
        return _temp_bytes(fwd_and_grad, act, scale, w_in, w_in, w_out, act)

    def separate(x, scale, *ws):
        return x + tiled_mlp(rms_norm(x, scale, 1e-5), *ws, tiles=tiles)

    def fused(x, scale, *ws):
        return tiled_mlp(x, *ws, tiles=tiles, norm_scale=scale, norm_eps=1e-5)

    full = seq * hidden * 4
    assert temp(separate) - temp(fused) >= 1.5 * full, (temp(separate), temp(fused), full)


# ----------------------------------------------------------------------------------------------
# Options.


def test_bad_tiles_raise():
    hidden, head, targets, mask = _ce_inputs(s=64)
    with pytest.raises(ValueError, match=r"tiling\.loss_tile=24 .* 64 .*valid values: \[1, 2, 4, 8, 16, 32, 64\]"):
        tiled_cross_entropy(hidden, head, targets, mask, tile=24)
    with pytest.raises(ValueError, match=r"tiling\.loss_tile=32 .* 16 "):  # 64 tokens over context 4
        tiled_cross_entropy(hidden, head, targets, mask, tile=32, mesh=_mesh())
    with pytest.raises(ValueError, match=r"tiling\.loss_tile=0"):
        tiled_cross_entropy(hidden, head, targets, mask, tile=0)
    (x, *ws), _ = _mlp_inputs(s=64)
    with pytest.raises(ValueError, match=r"tiling\.mlp_tiles=3 .* 64"):
        tiled_mlp(x, *ws, tiles=3)
    with pytest.raises(ValueError, match=r"tiling\.mlp_tiles=32 .* 16 "):
        tiled_mlp(x, *ws, tiles=32, mesh=_mesh())
    with pytest.raises(ValueError, match="mesh.context=4"):
        tiled_mlp(x[:, :62], *ws, tiles=1, mesh=_mesh())


def test_defaults():
    assert default_loss_tile(65536, 128256) == 512  # 250.5 MiB float32 logits tile
    assert default_loss_tile(65536, 128256, batch=2) == 256
    assert default_loss_tile(12, 128256) == 4 and default_loss_tile(7, 128256) == 1
    assert default_loss_tile(64, 48, budget_bytes=1) == 1
    assert default_mlp_tiles(65536, 4096) == 16  # ALST: ceil(S_local / hidden)
    assert default_mlp_tiles(10000, 4096) == 4  # ceil = 3 does not divide 10000
    assert default_mlp_tiles(100, 4096) == 1


# ----------------------------------------------------------------------------------------------
# Compiled memory (per device, float32, nothing allocated).


def _temp_bytes(fn, *specs) -> int:
    return jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes


def _ce_temp(loss_fn, seq, hidden=4096, vocab=128256):
    specs = (SDS((1, seq, hidden), jnp.float32), SDS((hidden, vocab), jnp.float32),
             SDS((1, seq), jnp.int32), SDS((1, seq), jnp.float32))
    return _temp_bytes(jax.value_and_grad(loss_fn, argnums=(0, 1)), *specs)


def test_tiled_ce_memory():
    """Llama-3 vocabulary, 64K local tokens: the plain loss's float32 logits alone are 31 GiB."""
    seq, vocab = 65536, 128256
    tile = default_loss_tile(seq, vocab)
    tiled = lambda *a: tiled_cross_entropy(*a, tile=tile)
    plain_b, tiled_b = _ce_temp(cross_entropy, seq), _ce_temp(tiled, seq)
    assert plain_b >= seq * vocab * 4
    assert tiled_b <= plain_b / 8, (tiled_b, plain_b)
    # The tiled temporaries do not grow with the sequence (only the [b, s] lse does).
    assert _ce_temp(tiled, seq) - _ce_temp(tiled, seq // 4) < 8 * seq, "tiled loss memory grows with seq"


def _mlp_temp(mlp_fn, seq, hidden=4096, mlp_hidden=14336):
    def fwd_and_grad(x, w_gate, w_up, w_down, dy):
        y, vjp = jax.vjp(mlp_fn, x, w_gate, w_up, w_down)
        return y, vjp(dy)

    act = SDS((1, seq, hidden), jnp.float32)
    w_in, w_out = SDS((hidden, mlp_hidden), jnp.float32), SDS((mlp_hidden, hidden), jnp.float32)
    return _temp_bytes(fwd_and_grad, act, w_in, w_in, w_out, act)


def test_tiled_mlp_memory():
    """Llama-3.1-8B widths at 32K local tokens with ALST's tile count (8 tiles of 4096 tokens)."""
    seq, hidden = 32768, 4096
    tiled = lambda *a, seq=seq: tiled_mlp(*a, tiles=default_mlp_tiles(seq, hidden))
    plain_b, tiled_b = _mlp_temp(swiglu, seq), _mlp_temp(tiled, seq)
    assert tiled_b <= plain_b / 4, (tiled_b, plain_b)
    # Same tile size at twice the sequence: the temporaries stay those of one tile.
    tiled2 = lambda *a: tiled_mlp(*a, tiles=default_mlp_tiles(2 * seq, hidden))
    assert _mlp_temp(tiled2, 2 * seq) <= 1.01 * tiled_b
