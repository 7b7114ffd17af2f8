"""The Pallas GPU (Triton) FlashAttention-2 kernel pair with segment ids (`jaxlong.kernels.pallas_gpu`).

On the CPU the kernels run in Pallas' interpreter (`interpret=True`): forward, lse and gradients (both the
backward from a saved (out, lse) and the custom_vjp) equal the blockwise kernel's in float32 -- causal and not,
GQA (heads 4 over kv_heads 2 and 1), packed documents with trailing padding whose boundaries cut through tiles
(so the skipped tiles matter), and a sequence that is not a multiple of the blocks; NaN planted in tiles that
must be skipped shows they are not read. Where the CUDA plugin is
installed the kernels compile through Triton for compile-only H100s (sm_90, `jaxlong.plan.target`), alone and
inside the train step that `attention.backend=auto` builds for packed documents (Ulysses and U-Pipe).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiered, tiny_cfg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import ConfigError
from jaxlong.kernels import backend as B
from jaxlong.kernels import blockwise as K
from jaxlong.kernels import pallas_gpu as PG
from jaxlong.plan.target import compile_only_devices, cuda_plugin_available, parse_target

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="the CUDA plugin (pip install 'jax[cuda12]') is not installed")

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b, s, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, s, h, d)), jax.random.normal(ks[1], (b, s, kvh, d)),
            jax.random.normal(ks[2], (b, s, kvh, d)), jax.random.normal(ks[3], (b, s, h, d)))


def _segments(*rows):
    """int32 [batch, seq] from per-row lists of (segment id, length)."""
    return jnp.array([sum(([i] * n for i, n in row), []) for row in rows], jnp.int32)


# seq 96: three documents cut through 16/32-token tiles, then padding (id 0); a second row of two documents.
DOCS_96 = _segments([(1, 20), (2, 37), (3, 23), (0, 16)], [(7, 50), (8, 46)])
# seq 80, not a multiple of block 32: padded inside the call.
DOCS_80 = _segments([(1, 33), (2, 40), (0, 7)])

CASES = {
    "causal-gqa2": dict(shape=(2, 64, 4, 2, 16), causal=True, seg=None),
    "full-gqa1": dict(shape=(1, 64, 4, 1, 32), causal=False, seg=None),
    "docs-gqa2": dict(shape=(2, 96, 4, 2, 16), causal=True, seg=DOCS_96),
    "docs-gqa1-uneven": dict(shape=(1, 80, 4, 1, 16), causal=True, seg=DOCS_80),
    "full-uneven": dict(shape=(1, 80, 4, 2, 16), causal=False, seg=None),
}


@pytest.mark.parametrize(*tiered("name", list(CASES), ids=list(CASES), fast={"causal-gqa2", "docs-gqa1-uneven"}))
def test_forward_lse_and_backward_equal_the_blockwise_kernel(name):
    case = CASES[name]
    q, k, v, do = _inputs(*case["shape"])
    opts = dict(causal=case["causal"], segment_ids=case["seg"])
    out, lse = PG.pallas_attention_fwd(q, k, v, block_q=16, block_k=32, interpret=True, **opts)
    ref_out, ref_lse = K.blockwise_attention_fwd(q, k, v, block_q=16, block_k=16, **opts)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    # the backward from the reference's (out, lse): no forward inside, blocks unlike the forward's
    grads = PG.pallas_attention_bwd(q, k, v, ref_out, ref_lse, do, block_q=32, block_k=16, interpret=True, **opts)
    ref = K.blockwise_attention_bwd(q, k, v, ref_out, ref_lse, do, block_q=16, block_k=16, **opts)
    for got, want, x in zip(grads, ref, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype and bool(jnp.isfinite(got).all())
        np.testing.assert_allclose(got, want, **TOL)


# Sliding windows (`window` W: query t sees keys t - W + 1 .. t): a window straddling 16/32-token tiles with GQA 2;
# with documents cut through tiles and a sequence padded inside the call (GQA 1, Gemma 3 270M's heads); a window of
# 1 (each query sees itself); one wider than the sequence (causal).
WINDOWS = {
    "window20-gqa2": dict(shape=(1, 64, 4, 2, 16), seg=None, window=20),
    "window9-docs-uneven": dict(shape=(1, 80, 4, 1, 16), seg=DOCS_80, window=9),
    "window1": dict(shape=(1, 32, 2, 2, 16), seg=None, window=1),
    "window100": dict(shape=(1, 48, 2, 1, 16), seg=None, window=100),
}


@pytest.mark.parametrize(*tiered("name", list(WINDOWS), ids=list(WINDOWS), fast={"window9-docs-uneven"}))
def test_window_forward_lse_and_backward_equal_the_blockwise_kernel(name):
    """float32, Pallas' interpreter: forward, lse and the backward from the blockwise kernel's (out, lse), with
    blocks unlike the forward's, equal the windowed blockwise kernel's (itself checked against a dense softmax in
    tests/kernels/test_window.py)."""
    case = WINDOWS[name]
    q, k, v, do = _inputs(*case["shape"])
    opts = dict(causal=True, segment_ids=case["seg"], window=case["window"])
    out, lse = PG.pallas_attention_fwd(q, k, v, block_q=16, block_k=32, interpret=True, **opts)
    ref_out, ref_lse = K.blockwise_attention_fwd(q, k, v, block_q=16, block_k=16, **opts)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    grads = PG.pallas_attention_bwd(q, k, v, ref_out, ref_lse, do, block_q=32, block_k=16, interpret=True, **opts)
    ref = K.blockwise_attention_bwd(q, k, v, ref_out, ref_lse, do, block_q=16, block_k=16, **opts)
    for got, want in zip(grads, ref):
        assert bool(jnp.isfinite(got).all())
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.slow
def test_window_custom_vjp_gradients_equal_the_dense_reference():
    """`pallas_attention(window=)` (the custom_vjp `attention(backend='pallas', window=)` runs): gradients of a
    weighted sum equal the dense reference's with the window and two documents."""
    q, k, v, w = _inputs(1, 64, 4, 2, 16, seed=9)
    seg = _segments([(1, 24), (2, 40)])
    pallas = functools.partial(PG.pallas_attention, block_q=16, block_k=16, interpret=True)
    got = jax.grad(lambda q, k, v: jnp.sum(pallas(q, k, v, segment_ids=seg, window=12) * w), argnums=(0, 1, 2))(
        q, k, v)
    ref = functools.partial(K.reference_attention, segment_ids=seg, window=12)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.slow
def test_tiles_outside_the_window_are_not_visited():
    """NaN poison, blocks of 16, a window of 10: the first kv tile poisoned, the query tiles from 2 on (windows
    starting at 23 or later) stay finite in the forward and dQ; the last query tile poisoned, the kv tiles no query
    of it reaches (0 and 1) get finite dK, dV."""
    s, blk, window = 64, 16, 10
    q, k, v, do = _inputs(1, s, 2, 1, 16, seed=8)
    opts = dict(window=window, block_q=blk, block_k=blk, interpret=True)
    first = jnp.where(jnp.arange(s)[None, :, None, None] < blk, jnp.nan, 0.0)
    out, _ = PG.pallas_attention_fwd(q, k, v + first, **opts)
    assert not bool(jnp.isfinite(out[:, :blk]).any()) and bool(jnp.isfinite(out[:, 2 * blk:]).all())
    out, lse = PG.pallas_attention_fwd(q, k, v, **opts)
    dq, _, _ = PG.pallas_attention_bwd(q, k + first, v + first, out, lse, do, **opts)
    assert bool(jnp.isfinite(dq[:, 2 * blk:]).all())
    last = jnp.where(jnp.arange(s)[None, :, None, None] >= s - blk, jnp.nan, 0.0)
    _, dk, dv = PG.pallas_attention_bwd(q, k, v, out, lse, do + last, **opts)
    assert bool(jnp.isfinite(dk[:, :2 * blk]).all() and jnp.isfinite(dv[:, :2 * blk]).all())
    assert not bool(jnp.isfinite(dk[:, -blk:]).any())


def test_custom_vjp_gradients_equal_the_blockwise_kernel_with_documents_and_gqa():
    q, k, v, w = _inputs(2, 96, 4, 2, 16, seed=3)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, segment_ids=DOCS_96) * w)

    pallas = functools.partial(PG.pallas_attention, block_q=32, block_k=16, interpret=True)
    blockwise = functools.partial(K.blockwise_attention, block_q=16, block_k=16)
    got = jax.grad(loss(pallas), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(blockwise), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)
    # residuals are O(seq): q, k, v, segment ids, out and the float32 lse, no score tiles
    res = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(
        lambda q, k, v: PG.pallas_attention(q, k, v, segment_ids=DOCS_96, interpret=True), *a)[1]), q, k, v)
    assert sorted(r.size for r in res) == sorted([q.size, k.size, v.size, DOCS_96.size, q.size, 2 * 4 * 96])


def test_kv_starts_block_equals_the_blockwise_kernels_run_id_mask():
    """Ring attention's off-diagonal block with documents: keys = tokens [48, 96) of a 144-token sequence, queries
    = tokens [96, 144) (keys all before queries). `kv_starts` (each query's document start minus 48) gives the
    blockwise kernel's `kv_segment_ids` mask on run ids: forward and lse (-inf for the queries of the document
    that starts among them), and the backward from the whole sequence's (out, lse), GQA, tiles cut by documents."""
    c, off = 48, 48
    seg = _segments([(1, 30), (2, 50), (3, 40), (4, 24)], [(5, 100), (6, 44)])  # [2, 144]
    runs = K.segment_starts(seg)
    q, k, v, do = _inputs(2, 3 * c, 4, 2, 16, seed=5)
    full_out, full_lse = K.blockwise_attention_fwd(q, k, v, segment_ids=seg, block_q=16, block_k=16)
    qs, ks = slice(2 * c, 3 * c), slice(off, off + c)
    blk = (q[:, qs], k[:, ks], v[:, ks])
    ids = dict(causal=False, segment_ids=runs[:, qs], kv_segment_ids=runs[:, ks])
    want_out, want_lse = K.blockwise_attention_fwd(*blk, block_q=16, block_k=16, **ids)
    kv_starts = runs[:, qs] - off
    out, lse = PG.pallas_attention_fwd(*blk, causal=False, kv_starts=kv_starts, block_q=16, block_k=32,
                                       interpret=True)
    assert bool(jnp.isneginf(lse).any()) and bool(jnp.isfinite(lse).any())  # row 0's document 4 sees no key
    np.testing.assert_allclose(lse, want_lse, **TOL)
    np.testing.assert_allclose(jnp.where(jnp.isfinite(want_lse).transpose(0, 2, 1)[..., None], out, 0.0), out)
    np.testing.assert_allclose(out, jnp.nan_to_num(want_out), **TOL)
    glob = (full_out[:, qs], full_lse[:, :, qs], do[:, qs])
    grads = PG.pallas_attention_bwd(*blk, *glob, causal=False, kv_starts=kv_starts, block_q=32, block_k=16,
                                    interpret=True)
    want = K.blockwise_attention_bwd(*blk, *glob, block_q=16, block_k=16, **ids)
    for got, ref in zip(grads, want):
        assert bool(jnp.isfinite(got).all())
        np.testing.assert_allclose(got, ref, **TOL)
    with pytest.raises(ValueError, match="kv_starts .* requires causal=False"):
        PG.pallas_attention_fwd(*blk, causal=True, kv_starts=kv_starts, interpret=True)


def test_kv_starts_over_a_two_chunk_key_block_of_another_length():
    """Ring attention's remote block of a later rank: a rank's second query chunk (tokens [96, 120)) to the whole
    key block of a rank that holds the zigzag chunks [24, 48) and [72, 96) (48 keys for 24 queries).
    `kv_starts` counts the block's keys before each query's document start
    (`jaxlong.parallel.ring.kv_starts_of_chunks`); forward, lse and the backward equal the blockwise kernel's run-id mask."""
    from jaxlong.parallel.ring import kv_starts_of_chunks

    c = 24
    seg = _segments([(1, 30), (2, 50), (3, 40)], [(4, 70), (5, 50)])  # [2, 120]
    runs = K.segment_starts(seg)
    q, k, v, do = _inputs(2, 5 * c, 4, 2, 16, seed=6)
    full_out, full_lse = K.blockwise_attention_fwd(q, k, v, segment_ids=seg, block_q=8, block_k=8)
    qs, keys = slice(4 * c, 5 * c), jnp.r_[c:2 * c, 3 * c:4 * c]
    blk = (q[:, qs], k[:, keys], v[:, keys])
    ids = dict(causal=False, segment_ids=runs[:, qs], kv_segment_ids=runs[:, keys])
    kv_starts = kv_starts_of_chunks(runs[:, qs], (c, 3 * c), c)
    want = K.blockwise_attention_fwd(*blk, block_q=8, block_k=8, **ids)
    got = PG.pallas_attention_fwd(*blk, causal=False, kv_starts=kv_starts, block_q=16, block_k=16, interpret=True)
    np.testing.assert_allclose(got[1], want[1], **TOL)
    np.testing.assert_allclose(got[0], jnp.nan_to_num(want[0]), **TOL)
    glob = (full_out[:, qs], full_lse[:, :, qs], do[:, qs])
    grads = PG.pallas_attention_bwd(*blk, *glob, causal=False, kv_starts=kv_starts, block_q=16, block_k=16,
                                    interpret=True)
    for g, r in zip(grads, K.blockwise_attention_bwd(*blk, *glob, block_q=8, block_k=8, **ids)):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.slow
def test_tiles_of_other_documents_and_above_the_diagonal_are_not_visited():
    """NaN planted where only a visited tile could read it (0 * NaN is NaN in a matmul, masked or not): two
    tile-aligned documents of 32 tokens, blocks of 32. Forward and dQ skip the kv tile of the earlier document
    and the kv tile above the diagonal; dK/dV skip the query tile of the later document."""
    q, k, v, do = _inputs(1, 64, 2, 1, 16, seed=7)
    seg = _segments([(1, 32), (2, 32)])
    run = functools.partial(PG.pallas_attention_fwd, segment_ids=seg, block_q=32, block_k=32, interpret=True)
    nan_first, nan_second = (jnp.zeros((1, 64, 1, 1)).at[:, sl].set(jnp.nan) for sl in (slice(0, 32), slice(32, 64)))
    out, lse = run(q, k, v + nan_first)
    assert bool(jnp.isfinite(out[:, 32:]).all()) and not bool(jnp.isfinite(out[:, :32]).any())
    out, _ = run(q, k, v + nan_second)
    assert bool(jnp.isfinite(out[:, :32]).all())
    out, lse = run(q, k, v)
    bwd = functools.partial(PG.pallas_attention_bwd, segment_ids=seg, block_q=32, block_k=32, interpret=True)
    _, dk, dv = bwd(q, k, v, out, lse, do + nan_second.reshape(1, 64, 1, 1))
    assert bool(jnp.isfinite(dk[:, :32]).all() and jnp.isfinite(dv[:, :32]).all())
    dq, _, _ = bwd(q, k + nan_first, v + nan_first, out, lse, do)
    assert bool(jnp.isfinite(dq[:, 32:]).all()) and not bool(jnp.isfinite(dq[:, :32]).any())


def test_inside_shard_map_as_ulysses_calls_it():
    """Heads split over a 4-device `context` axis (as after Ulysses' all-to-all), segment ids replicated, in
    `jax.shard_map`: the gradients equal the blockwise kernel's run the same way. `check_vma=False` here only:
    JAX 0.10.2's Pallas interpreter evaluates the kernel body with mesh-invariant constants against varying
    loads and fails ("Primitive div requires varying manual axes to match"); the Triton lowering has no such
    step, and `check_vma=True` (as Ulysses and U-Pipe run) is compiled by the sm_90 tests below."""
    mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    q, k, v, w = _inputs(1, 64, 8, 4, 16, seed=11)
    seg = _segments([(1, 24), (2, 30), (0, 10)])
    spec = P(None, None, "context", None)

    def grads(fn):
        def local(q, k, v, w, sg):
            return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, segment_ids=sg) * w), argnums=(0, 1, 2))(q, k, v)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4 + (P(),), out_specs=(spec,) * 3,
                                     check_vma=False))(q, k, v, w, seg)

    got = grads(functools.partial(PG.pallas_attention, block_q=16, block_k=32, interpret=True))
    want = grads(functools.partial(K.blockwise_attention, block_q=16, block_k=16))
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.slow
def test_bf16_forward_is_close_to_the_blockwise_kernel():
    q, k, v, _ = _inputs(1, 64, 4, 2, 16, seed=5)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    seg = _segments([(1, 30), (2, 34)])
    out, lse = PG.pallas_attention_fwd(q, k, v, segment_ids=seg, block_q=16, block_k=16, interpret=True)
    ref_out, ref_lse = K.blockwise_attention_fwd(q, k, v, segment_ids=seg, block_q=16, block_k=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out.astype(jnp.float32), atol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3)


def test_bad_inputs_are_clear_errors_before_tracing():
    q, k, v, _ = _inputs(1, 64, 4, 2, 16)
    with pytest.raises(ValueError, match="head_dim a power of two"):
        PG.pallas_attention_fwd(q[..., :12], k[..., :12], v[..., :12], interpret=True)
    with pytest.raises(ValueError, match="block_q=24"):
        PG.pallas_attention_fwd(q, k, v, block_q=24, interpret=True)
    with pytest.raises(ValueError, match="requires causal=True"):
        PG.pallas_attention(q, k, v, causal=False, segment_ids=jnp.ones((1, 64), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"segment_ids must be integer \[batch, seq\]"):
        PG.pallas_attention(q, k, v, segment_ids=jnp.ones((1, 63), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="one dtype"):
        PG.pallas_attention_fwd(q.astype(jnp.bfloat16), k, v, interpret=True)
    with pytest.raises(ValueError, match="kv_heads"):
        PG.pallas_attention_fwd(q[:, :, :3], k, v, interpret=True)
    big = jax.ShapeDtypeStruct((1, 2**21, 8, 128), jnp.bfloat16)  # 2**31 elements: int32 offsets would wrap
    with pytest.raises(ValueError, match="int32 offsets"):
        PG.pallas_attention_fwd(big, jax.ShapeDtypeStruct((1, 2**21, 1, 128), jnp.bfloat16),
                                jax.ShapeDtypeStruct((1, 2**21, 1, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="lse"):
        PG.pallas_attention_bwd(q, k, v, q, jnp.zeros((1, 4, 63)), q, interpret=True)
    with pytest.raises(ValueError, match="window=-2"):
        PG.pallas_attention_fwd(q, k, v, window=-2, interpret=True)
    with pytest.raises(ValueError, match="sliding window needs causal=True"):
        PG.pallas_attention(q, k, v, causal=False, window=8, interpret=True)


def test_auto_picks_pallas_for_segment_ids_on_gpus_and_config_accepts_it():
    seg = jnp.ones((1, 64), jnp.int32)
    bf16 = jax.ShapeDtypeStruct((1, 64, 4, 128), jnp.bfloat16)
    assert B.resolve_backend("auto", bf16, seg, platform="gpu") == "pallas"
    assert B.resolve_backend("auto", bf16, None, platform="gpu") == "cudnn"
    assert B.resolve_backend("auto", bf16, seg, platform="cpu") == "blockwise"
    odd = jax.ShapeDtypeStruct((1, 64, 4, 96), jnp.bfloat16)  # not a power of two: blockwise
    assert B.resolve_backend("auto", odd, seg, platform="gpu") == "blockwise"
    assert B.resolve_backend("pallas", bf16, seg) == "pallas"
    with pytest.raises(ValueError, match="pallas"):
        B.resolve_backend("cudnn", bf16, seg)
    assert tiny_cfg("attention.backend=pallas").attention.backend == "pallas"
    with pytest.raises(ConfigError, match="pallas"):
        tiny_cfg("attention.backend=cudnn", "data.packing=documents")


def test_training_with_pallas_on_the_cpu_is_refused(tmp_path, monkeypatch):
    from jaxlong import data as data_lib
    from jaxlong.recipes import train as run

    def no_data(*args, **kwargs):
        raise AssertionError("the corpus was loaded")

    monkeypatch.setattr(data_lib, "DocumentSource", no_data)
    with pytest.raises(ConfigError, match="attention.backend=pallas needs an NVIDIA GPU, but jax runs on cpu"):
        run(tiny_cfg("attention.backend=pallas", f"run_dir={tmp_path}"))


# ---------------------------------------------------------------------------- deviceless sm_90 compile


@functools.cache
def _devices():
    return compile_only_devices(parse_target("h100"))


def _triton_kernels(compiled) -> list[str]:
    """Names of the Pallas kernels (`__gpu$xla.gpu.triton` custom calls) in a compiled program's HLO."""
    text = compiled.as_text()
    assert "__gpu$xla.gpu.triton" in text or "jaxlong_flash" not in text
    return sorted(re.findall(r'name = \\?"(jaxlong_flash_[a-z_]+)', text))


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_kernels_compile_for_sm90_inside_shard_map():
    """bf16, GQA, head_dim 128, segment ids, heads split over 8 devices as after Ulysses' all-to-all: the
    forward, the backward from (out, lse) and the custom_vjp's gradient compile through Triton for sm_90."""
    mesh = jax.make_mesh((8,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=_devices())
    s, heads, kv_heads, d = 2048, 32, 8, 128
    spec, lse_spec, seg_spec = P(None, None, "context", None), P(None, "context", None), P(None, None)

    def sds(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    q, k = sds((1, s, heads, d), spec), sds((1, s, kv_heads, d), spec)
    lse, seg = sds((1, heads, s), lse_spec, jnp.float32), sds((1, s), seg_spec, jnp.int32)
    opts = dict(backend="pallas", causal=True)

    def sm(f, ins, outs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=True))

    fwd = sm(lambda q, k, v, sg: B.attention_fwd_with_lse(q, k, v, segment_ids=sg, **opts),
             (spec,) * 3 + (seg_spec,), (spec, lse_spec))
    assert _triton_kernels(fwd.lower(q, k, k, seg).compile()) == ["jaxlong_flash_fwd_causal"]
    bwd = sm(lambda q, k, v, o, l, do, sg: B.attention_bwd(q, k, v, o, l, do, segment_ids=sg, **opts),
             (spec,) * 4 + (lse_spec, spec, seg_spec), (spec,) * 3)
    assert _triton_kernels(bwd.lower(q, k, k, q, lse, q, seg).compile()) == ["jaxlong_flash_bwd_dkdv_causal",
                                                                             "jaxlong_flash_bwd_dq_causal"]

    def loss(q, k, v, w, sg):
        return jnp.sum(B.attention(q, k, v, segment_ids=sg, **opts).astype(jnp.float32) * w)

    grad = sm(jax.grad(loss, argnums=(0, 1, 2)), (spec,) * 4 + (seg_spec,), (spec,) * 3)
    assert _triton_kernels(grad.lower(q, k, k, q, seg).compile()) == [
        "jaxlong_flash_bwd_dkdv_causal", "jaxlong_flash_bwd_dq_causal", "jaxlong_flash_fwd_causal"]


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_windowed_kernels_compile_for_sm90_inside_shard_map():
    """A local layer's attention as Ulysses runs it (bf16, 4 query heads over 1 KV head as Gemma 3 270M, head_dim
    256, segment ids, a window of 512 over 2,048 tokens, 8 query and 2 KV heads split over 2 devices,
    `check_vma=True`): the
    custom_vjp's gradient compiles through Triton for sm_90 to the three kernels, whose Triton IR differs from the
    windowless program's (the window's mask and loop bounds are in the kernels)."""
    mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=_devices()[:2])
    s, heads, kv_heads, d = 2048, 8, 2, 256
    spec, seg_spec = P(None, None, "context", None), P(None, None)
    q = jax.ShapeDtypeStruct((1, s, heads, d), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    k = jax.ShapeDtypeStruct((1, s, kv_heads, d), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32, sharding=NamedSharding(mesh, seg_spec))

    def program(window):
        def loss(q, k, v, w, sg):
            out = B.attention(q, k, v, backend="pallas", segment_ids=sg, window=window)
            return jnp.sum(out.astype(jnp.float32) * w)
        grad = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(spec,) * 4 + (seg_spec,),
                             out_specs=(spec,) * 3, check_vma=True)
        return jax.jit(grad).lower(q, k, k, q, seg).compile()

    windowed, causal = program(512), program(0)
    assert _triton_kernels(windowed) == ["jaxlong_flash_bwd_dkdv_causal", "jaxlong_flash_bwd_dq_causal",
                                         "jaxlong_flash_fwd_causal"]
    ir = lambda c: re.findall(r'ir = "((?:[^"\\]|\\.)*)"', c.as_text())  # noqa: E731  (serialized Triton IR)
    assert len(ir(windowed)) == 3 and ir(windowed) != ir(causal)


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("impl", ["ulysses", "upipe"])
def test_auto_train_step_with_packed_documents_uses_the_pallas_kernel_on_sm90(impl):
    """`attention.backend=auto` with `data.packing=documents` on compile-only H100s resolves to the Pallas
    kernel, and the whole train step (Ulysses or U-Pipe, C = 4) compiles with it and no blockwise loop."""
    from jaxlong.core.mesh import build_mesh
    from jaxlong.config import runtime
    from jaxlong.training import step as step_lib

    cfg = tiny_cfg("compute_dtype=bfloat16", "mesh.fsdp=2", "mesh.context=4", "data.packing=documents",
                   f"attention.impl={impl}", "seq_len=256")
    mesh = build_mesh(cfg.mesh, devices=_devices())
    assert runtime(cfg, mesh).attention_backend == "pallas"
    kernels = set(_triton_kernels(step_lib.compile_train_step(cfg, mesh)))
    # named with their mask (`_causal`), which the planner's cost model reads (jaxlong.plan.cost)
    assert kernels == {"jaxlong_flash_fwd_causal", "jaxlong_flash_bwd_dkdv_causal",
                       "jaxlong_flash_bwd_dq_causal"}, kernels
