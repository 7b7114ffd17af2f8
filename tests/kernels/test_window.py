"""Sliding-window attention in the blockwise kernel: forward, lse and gradients against a dense softmax written
here in numpy (not the package's reference), with the window inside a tile, straddling tiles and wider than the
sequence, combined with packed documents and GQA; the tiles the window masks are never visited (NaN poison), and
`window_tiles` counts what is computed against causal; a windowed model validates with the GPU kernels (the Pallas
and cuDNN kernels' windows: tests/kernels/test_pallas_attention.py, test_cudnn_attention.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlong.kernels import blockwise as K

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seq, heads, kv_heads, batch=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s, np.float32)
                 for s in ((batch, seq, heads, d), (batch, seq, kv_heads, d), (batch, seq, kv_heads, d),
                           (batch, seq, heads, d)))


def _dense(q, k, v, window, ids=None):
    """Softmax attention in float64 numpy with the mask spelled out: key j is visible to query i when
    j <= i, i - j < window and (with ids) both lie in the same run of one id."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = np.broadcast_to((j <= i) & (i - j < window), (b, s, s)).copy()
    if ids is not None:
        for r in range(b):
            start = np.array([max(t for t in range(p + 1) if t == 0 or ids[r, t] != ids[r, t - 1])
                              for p in range(s)])
            mask[r] &= (ids[r][:, None] == ids[r][None, :]) & (j >= start[:, None])
    kr, vr = np.repeat(k, g, axis=2).astype(np.float64), np.repeat(v, g, axis=2).astype(np.float64)
    sc = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kr) / np.sqrt(d)
    sc = np.where(mask[:, None], sc, -np.inf)
    lse = np.log(np.exp(sc - sc.max(-1, keepdims=True)).sum(-1)) + sc.max(-1)
    return np.einsum("bhqk,bkhd->bqhd", np.exp(sc - lse[..., None]), vr), lse


# (seq, block_q, block_k, window): inside one tile, straddling tiles, tiles that do not nest, a window of 1
# (each query sees itself), and one wider than the sequence (causal). The slow tier runs the middle two.
CASES = [(64, 16, 16, 5), (64, 16, 8, 20), pytest.param(48, 16, 24, 17, marks=pytest.mark.slow),
         pytest.param(32, 8, 8, 1, marks=pytest.mark.slow), (32, 16, 16, 100)]


@pytest.mark.parametrize("seq,bq,bk,window", CASES)
def test_window_forward_lse_and_grads_equal_the_dense_softmax(seq, bq, bk, window):
    q, k, v, w = _inputs(seq, 4, 2)
    out, lse = K.blockwise_attention_fwd(q, k, v, causal=True, block_q=bq, block_k=bk, window=window)
    ref_out, ref_lse = _dense(q, k, v, window)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    np.testing.assert_allclose(K.reference_attention(q, k, v, window=window), ref_out, **TOL)
    fn = functools.partial(K.blockwise_attention, causal=True, block_q=bq, block_k=bk, window=window)
    got = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    ref = functools.partial(K.reference_attention, window=window)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL)


def test_window_with_packed_documents_never_crosses_a_boundary():
    """Documents of 9, 30 and 25 tokens with a window of 12: a query near a document's start sees fewer than 12
    keys, never the previous document's; gradients equal the reference's with both masks."""
    seq, window = 64, 12
    q, k, v, w = _inputs(seq, 4, 4, seed=1)
    ids = np.repeat(np.array([[1, 2, 3], [4, 5, 6]]), [9, 30, 25], axis=1).astype(np.int32)
    opts = dict(causal=True, block_q=16, block_k=16, window=window)
    out, lse = K.blockwise_attention_fwd(q, k, v, segment_ids=jnp.asarray(ids), **opts)
    ref_out, ref_lse = _dense(q, k, v, window, ids)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    fn = functools.partial(K.blockwise_attention, segment_ids=jnp.asarray(ids), **opts)
    got = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    ref = functools.partial(K.reference_attention, segment_ids=jnp.asarray(ids), window=window)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL)


def test_tiles_wholly_outside_the_window_are_never_visited():
    """NaN poison: the first key tile poisoned, queries whose window starts past it stay finite (forward); the
    last query tile poisoned, key tiles no query of it reaches get finite gradients (backward)."""
    seq, bq, bk, window = 64, 16, 16, 10
    q, k, v, w = _inputs(seq, 2, 2, seed=2)
    opts = dict(causal=True, block_q=bq, block_k=bk, window=window)
    v_bad = np.where(np.arange(seq)[None, :, None, None] < bk, np.nan, v)
    out, _ = K.blockwise_attention_fwd(q, k, v_bad, **opts)
    assert np.isnan(np.asarray(out[:, :bk])).all()
    assert np.isfinite(np.asarray(out[:, 2 * bq:])).all()  # windows start at 23 or later: tiles 1 on
    out, lse = K.blockwise_attention_fwd(q, k, v, **opts)
    q_bad = np.where(np.arange(seq)[None, :, None, None] >= seq - bq, np.nan, q)
    _, dk, dv = K.blockwise_attention_bwd(q_bad, k, v, out, lse, w, **opts)
    assert np.isfinite(np.asarray(dk[:, :2 * bk])).all() and np.isfinite(np.asarray(dv[:, :2 * bk])).all()
    assert np.isnan(np.asarray(dk[:, -bk:])).all()


def test_window_tiles_counts_what_is_computed_against_causal():
    """At 1M tokens in 512-token tiles a window of 1,024 computes 3 tiles per query tile (1 and 2 for the first two)
    against causal's (n + 1) / 2 on average: 1/342 of the tiles (the exact work is 1/512; the tiles on the window's
    edges are computed whole)."""
    assert K.window_tiles(64, 8, 8) == 36 and K.window_tiles(64, 8, 8, window=8) == 15
    assert K.window_tiles(64, 8, 8, window=1) == 8 and K.window_tiles(64, 8, 8, window=64) == 36
    n = 2**20 // 512
    assert K.window_tiles(2**20, 512, 512) == n * (n + 1) // 2
    assert K.window_tiles(2**20, 512, 512, window=1024) == 3 * n - 3
    assert round(K.window_tiles(2**20, 512, 512) / K.window_tiles(2**20, 512, 512, window=1024)) == 342


def test_bad_windows_are_refused():
    q, k, v, _ = _inputs(16, 2, 2)
    with pytest.raises(ValueError, match="window=-3"):
        K.blockwise_attention_fwd(q, k, v, window=-3)
    with pytest.raises(ValueError, match="needs causal=True"):
        K.blockwise_attention_fwd(q, k, v, causal=False, window=4)


RING_CASES = {  # (data, fsdp, ring, context), window, window_exchange: Ulysses alone by its all-to-all, or by the
    # halo exchange over context (contiguous chunks of 16 tokens: two hops); the halo exchange on ring 2 and ring 4 x
    # Ulysses 2, over two hops (windows wider than a ring rank's half-chunk of 16 and 8 tokens)
    "ulysses4": ((1, 2, 1, 4), 12, "all_to_all"), "ulysses4-halo": ((1, 2, 1, 4), 20, "halo"),
    "ring2-ulysses4": ((1, 1, 2, 4), 20, "all_to_all"), "ring4-ulysses2": ((1, 1, 4, 2), 12, "all_to_all")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n != "ring4-ulysses2" else pytest.mark.slow)
                                  for n in RING_CASES])
def test_ulysses_and_ring_run_a_window_with_one_kv_head(name):
    """4 query heads and 1 KV head (Gemma 3 270M's), packed documents, 64 tokens, a window straddling the shards:
    the output and the gradients equal the dense softmax's. Under Ulysses alone each device holds whole sequences
    after the all-to-all; under ring each rank receives its halo (the window's K/V) from its neighbours by
    `ppermute` in the zigzag layout, over as many hops as the window needs (here two: it is wider than a ring
    rank's half-chunk), and sends their gradients back."""
    from helpers import axes_mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxlong.parallel.ring import unzigzag, zigzag
    from jaxlong.parallel.ulysses import ulysses_attention

    (data, fsdp, ring, context), window, exchange = RING_CASES[name]
    mesh = axes_mesh(data=data, fsdp=fsdp, ring=ring, context=context)
    seq = 64
    q, k, v, w = _inputs(seq, 4, 1, seed=3)
    ids = np.repeat(np.array([[1, 2], [3, 4]]), [40, 24], axis=1).astype(np.int32)
    spec = NamedSharding(mesh, P(("data", "fsdp"), ("ring", "context"), None, None))
    opts = dict(mesh=mesh, backend="blockwise", block_q=16, block_k=16, window=window, window_exchange=exchange)

    def loss(q, k, v, ids):  # natural order in and out; the zigzag layout inside, as the model lays out its batch
        z = [jax.lax.with_sharding_constraint(zigzag(x, ring), spec) for x in (q, k, v)]
        out = unzigzag(ulysses_attention(*z, segment_ids=zigzag(ids, ring), **opts), ring)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, jnp.asarray(ids))
    np.testing.assert_allclose(out, _dense(q, k, v, window, ids)[0], **TOL)
    ref = functools.partial(K.reference_attention, segment_ids=jnp.asarray(ids), window=window)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, want):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.slow
def test_a_local_layer_under_ring_sends_its_halo_not_the_shards():
    """The compiled forward and backward of a local layer's attention under ring 4 x Ulysses 2 holds 8
    collective-permutes of the halo (128 rows of K and V for each half-chunk, and their gradients back): 1/6 of the
    bytes a global layer's ring permutes show in its program, before the R - 1 = 3 trips of their loops
    (experiments/window_permute_bytes.py)."""
    from experiments.window_permute_bytes import permute_bytes

    local, glob = permute_bytes(2048, 4, 2, 128), permute_bytes(2048, 4, 2, 0)
    assert local == 8 * 128 * 1 * 64 * 4  # 8 permutes of [1, 128, 1 KV head, 64] float32
    assert glob >= 6 * local


@pytest.mark.parametrize("overrides,kernel", [
    (("attention.backend=cudnn", "data.packing=concat"), "cudnn"),
    (("attention.backend=pallas", "data.packing=documents"), "pallas"),
    (("attention.backend=auto", "data.packing=documents"), "pallas"),
    (("attention.backend=auto", "data.packing=concat"), "cudnn")], ids=["cudnn", "pallas", "auto-docs", "auto"])
def test_the_gpu_kernels_take_a_windowed_model(overrides, kernel):
    """A Gemma 3 config (local and global layers) validates for GPUs with the cuDNN and the Pallas kernel, explicit
    or as `auto` picks them; cuDNN with packed documents is refused in one line naming what runs them."""
    from helpers import tiny_cfg

    from jaxlong.config import validate
    from jaxlong.core.errors import ConfigError
    from jaxlong.kernels.backend import kernel_that_runs

    gemma = ("model.family=gemma3", "model.layers=4", "model.sliding_window_pattern=2", "model.sliding_window=8",
             "model.heads=4", "model.kv_heads=1", "compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.context=4")
    cfg = tiny_cfg(*gemma, *overrides)
    validate(cfg, 8, platform="gpu")
    assert kernel_that_runs(cfg.attention.backend, "gpu", compute_dtype="bfloat16", head_dim=cfg.model.head_dim,
                            segment_ids=cfg.data.packing == "documents") == kernel
    if kernel == "cudnn":
        with pytest.raises(ConfigError, match="cannot mask packed documents") as e:
            validate(tiny_cfg(*gemma, "attention.backend=cudnn", "data.packing=documents"), 8, platform="gpu")
        assert "\n" not in str(e.value)
