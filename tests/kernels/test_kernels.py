"""Tests for jaxlong.kernels.blockwise: blockwise (FlashAttention-2 style) attention vs a
materialized reference, custom_vjp residuals, compiled memory, dispatch and transforms."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pairwise
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.kernels import backend as B
from jaxlong.kernels import blockwise as K

TOL = dict(rtol=1e-5, atol=1e-5)

# (seq, block_q, block_k): even tiles, uneven tile counts, and tiles that do not nest.
BLOCKS = [(256, 64, 64), (256, 64, 32), (256, 32, 64), (96, 32, 48), (96, 48, 32)]
HEADS = [(4, 4), (8, 2)]  # (heads, kv_heads): MHA and GQA
# Fast tier: every block shape, both head layouts, causal and not; the slow tier runs the rest of the product.
KERNEL_CASES = pairwise({"seq,bq,bk": BLOCKS, "heads,kv_heads": HEADS, "causal": [True, False]},
                        fast=[(BLOCKS[0], HEADS[0], True), (BLOCKS[1], HEADS[1], False), (BLOCKS[2], HEADS[0], False),
                              (BLOCKS[3], HEADS[1], True), (BLOCKS[4], HEADS[0], True)])


def _inputs(seq, heads, kv_heads, batch=2, d=16, dtype=jnp.float32, seed=0):
    # numpy RNG: jax.random would compile a new sampler for every shape.
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q = normal(batch, seq, heads, d)
    k = normal(batch, seq, kv_heads, d)
    v = normal(batch, seq, kv_heads, d)
    w = normal(batch, seq, heads, d)
    return q, k, v, w


# Jitted so that op-by-op dispatch of the materialized reference does not dominate runtime.
_reference = jax.jit(K.reference_attention, static_argnames="causal")


@functools.partial(jax.jit, static_argnames="causal")
def _ref_lse(q, k, causal):
    """logsumexp of the materialized scaled scores, [batch, heads, seq]."""
    g = q.shape[2] // k.shape[2]
    kr = jnp.repeat(k, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


def _grads(fn, q, k, v, w):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))(
        q, k, v)


@functools.lru_cache(maxsize=None)
def _expected(seq, heads, kv_heads, causal):
    """Reference (out, lse, (dq, dk, dv)) for _inputs(seq, heads, kv_heads); shared by the
    block-size variants so the reference compiles once per shape."""
    q, k, v, w = _inputs(seq, heads, kv_heads)
    ref = functools.partial(K.reference_attention, causal=causal)
    return _reference(q, k, v, causal=causal), _ref_lse(q, k, causal), _grads(ref, q, k, v, w)


@pytest.mark.parametrize(*KERNEL_CASES)
def test_forward_and_lse_match_reference(seq, bq, bk, heads, kv_heads, causal):
    q, k, v, _ = _inputs(seq, heads, kv_heads)
    out, lse = jax.jit(functools.partial(
        K.blockwise_attention_fwd, causal=causal, block_q=bq, block_k=bk))(q, k, v)
    ref_out, ref_lse, _ = _expected(seq, heads, kv_heads, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, heads, seq) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


@pytest.mark.parametrize(*KERNEL_CASES)
def test_grads_match_reference(seq, bq, bk, heads, kv_heads, causal):
    q, k, v, w = _inputs(seq, heads, kv_heads)
    got = _grads(lambda q, k, v: K.blockwise_attention(
        q, k, v, causal=causal, block_q=bq, block_k=bk), q, k, v, w)
    want = _expected(seq, heads, kv_heads, causal)[2]
    for g, r, x in zip(got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.parametrize("bq,bk", [(32, 16), (16, 32)])
def test_causal_skips_tiles_above_diagonal(bq, bk):
    """NaN poison shows which tiles are visited: masking zeroes p, but 0 * NaN is NaN."""
    seq = 128
    q, k, v, w = _inputs(seq, 4, 2)
    opts = dict(causal=True, block_q=bq, block_k=bk)
    # Forward: poison the last kv tile; query tiles that end before it must not visit it.
    last = seq - bk
    v_bad = v.at[:, last:].set(jnp.nan)
    out, _ = jax.jit(functools.partial(K.blockwise_attention_fwd, **opts))(q, k, v_bad)
    clean_rows = last // bq * bq  # rows of query tiles lying entirely before `last`
    assert clean_rows > 0 and bool(jnp.isfinite(out[:, :clean_rows]).all())
    assert bool(jnp.isnan(out[:, last:]).all())
    # Backward: poison the first query tile; kv tiles starting after it must not visit it.
    out, lse = K.blockwise_attention_fwd(q, k, v, **opts)
    q_bad = q.at[:, :bq].set(jnp.nan)
    _, dk, dv = jax.jit(functools.partial(K.blockwise_attention_bwd, **opts))(
        q_bad, k, v, out, lse, w)
    first_clean = -(-bq // bk) * bk  # first kv tile starting at or after row bq
    assert bool(jnp.isfinite(dk[:, first_clean:]).all() & jnp.isfinite(dv[:, first_clean:]).all())
    assert bool(jnp.isnan(dk[:, :bq]).all())


def test_block_clamped_to_short_sequence():
    q, k, v, w = _inputs(48, 4, 2)  # default blocks 512 > seq
    np.testing.assert_allclose(jax.jit(K.blockwise_attention)(q, k, v), _reference(q, k, v),
                               **TOL)
    got = _grads(K.blockwise_attention, q, k, v, w)
    want = _grads(K.reference_attention, q, k, v, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


def test_residuals_are_only_qkv_out_lse():
    seq, bq = 128, 32
    q, k, v, _ = _inputs(seq, 8, 2)  # d=16 so that no O(seq) array has seq*seq elements

    def leaves(fn):
        _, vjp_fn = jax.vjp(fn, q, k, v)
        return jax.tree_util.tree_leaves(vjp_fn)

    res = leaves(lambda q, k, v: K.blockwise_attention(q, k, v, block_q=bq, block_k=bq))
    lse_size = q.shape[0] * q.shape[2] * seq
    budget = 2 * q.size + k.size + v.size + lse_size  # q, k, v, out, lse
    assert sum(x.size for x in res) <= budget + 64
    assert sorted(x.shape for x in res) == sorted(
        [q.shape, k.shape, v.shape, q.shape, (2, 8, seq)])
    for x in res:  # no score tiles: never two sequence/tile axes in one residual
        assert sum(dim in (seq, bq) for dim in x.shape) <= 1, x.shape
    # The check can tell: the materialized reference saves [seq, seq] probabilities.
    ref = leaves(lambda q, k, v: K.reference_attention(q, k, v))
    assert sum(x.size for x in ref) > budget + seq * seq


def _temp_bytes(fn, seq=4096, d=64):
    x = jax.ShapeDtypeStruct((1, seq, 1, d), jnp.float32)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_grad_memory_is_subquadratic():
    seq = 4096
    quadratic = seq * seq * 4
    blockwise = _temp_bytes(lambda q, k, v: K.blockwise_attention(q, k, v, block_q=256,
                                                                  block_k=256), seq)
    reference = _temp_bytes(K.reference_attention, seq)
    assert blockwise < quadratic / 4, (blockwise, quadratic)
    assert reference > quadratic, (reference, quadratic)


def test_bad_block_size_raises():
    q, k, v, _ = _inputs(96, 4, 2)
    with pytest.raises(ValueError, match=r"block_q=64 .*seq=96"):
        K.blockwise_attention(q, k, v, block_q=64, block_k=32)
    with pytest.raises(ValueError, match=r"block_k=40 .*seq=96.*32"):
        K.blockwise_attention_fwd(q, k, v, block_q=32, block_k=40)
    with pytest.raises(ValueError, match="block_k"):
        B.attention(q, k, v, backend="blockwise", block_q=32, block_k=0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        K.blockwise_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))


def test_unknown_backend_raises():
    q, k, v, _ = _inputs(32, 4, 2)
    with pytest.raises(ValueError, match="'blockwise'"):
        B.attention(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="expected one of"):
        B.attention_fwd_with_lse(q, k, v, backend="nope", causal=True, block_q=32, block_k=32)


def test_auto_selects_blockwise_on_cpu():
    q, k, v, _ = _inputs(64, 4, 2)
    assert B.resolve_backend("auto", q) == "blockwise"
    assert B.resolve_backend("auto", q.astype(jnp.bfloat16)) == "blockwise"
    out = jax.jit(functools.partial(B.attention, backend="auto", block_q=32, block_k=16))(q, k, v)
    np.testing.assert_allclose(out, _reference(q, k, v), **TOL)


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_fwd_with_lse_and_bwd_match_vjp_of_reference(backend):
    q, k, v, w = _inputs(64, 8, 2)
    opts = dict(backend=backend, causal=True, block_q=16, block_k=32)
    out, lse = jax.jit(functools.partial(B.attention_fwd_with_lse, **opts))(q, k, v)
    ref_out, vjp = jax.vjp(_reference, q, k, v)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, _ref_lse(q, k, True), **TOL)
    got = jax.jit(functools.partial(B.attention_bwd, **opts))(q, k, v, out, lse, w)
    for g, r in zip(got, jax.jit(vjp)(w)):
        np.testing.assert_allclose(g, r, **TOL)


def test_inside_jit_scan():
    q, k, v, w = _inputs(64, 4, 2)

    def run(attn):
        def body(x, _):
            y = attn(x, k, v)
            return y, jnp.sum(y * w)
        return jax.jit(lambda q: jax.lax.scan(body, q, None, length=2))

    blk = run(lambda q, k, v: K.blockwise_attention(q, k, v, block_q=32, block_k=16))
    ref = run(K.reference_attention)
    (y, s), (ry, rs) = blk(q), ref(q)
    np.testing.assert_allclose(y, ry, **TOL)
    np.testing.assert_allclose(s, rs, rtol=1e-5, atol=1e-4)
    g = jax.jit(jax.grad(lambda q: blk(q)[1].sum()))(q)
    rg = jax.jit(jax.grad(lambda q: ref(q)[1].sum()))(q)
    np.testing.assert_allclose(g, rg, **TOL)


def test_under_checkpoint_and_shard_map():
    q, k, v, w = _inputs(64, 8, 2)
    want = _grads(K.reference_attention, q, k, v, w)
    attn = lambda q, k, v: K.blockwise_attention(q, k, v, block_q=16, block_k=32)

    got = _grads(jax.checkpoint(attn), q, k, v, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)

    # Heads (and their GQA kv heads) sharded over 2 devices, as after a Ulysses all-to-all.
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    spec = P(None, None, "x")
    sharded = jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    got = _grads(sharded, put(q), put(k), put(v), put(w))
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


def test_bf16_inputs_keep_dtype():
    q, k, v, w = _inputs(64, 4, 2, dtype=jnp.bfloat16)
    attn = lambda q, k, v: K.blockwise_attention(q, k, v, block_q=16, block_k=32)
    out = jax.jit(attn)(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = _reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2, rtol=3e-2)
    grads = _grads(attn, q, k, v, w)
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)


@pytest.mark.parametrize("sq,sk", [(64, 32), (32, 64)])
def test_unmasked_call_with_a_key_block_of_another_length_matches_reference(sq, sk):
    """Without the causal mask the keys may be a block of another length (ring attention's remote blocks: a
    rank's 2c queries to c keys, or its c second-chunk queries to 2c keys): out, lse and dq, dk, dv as the
    dense reference; the causal mask still needs one length."""
    q = _inputs(sq, 8, 2)[0]
    _, k, v, _ = _inputs(sk, 8, 2, seed=1)
    w = _inputs(sq, 8, 2, seed=2)[3]
    out, lse = K.blockwise_attention_fwd(q, k, v, causal=False, block_q=16, block_k=16)
    np.testing.assert_allclose(out, _reference(q, k, v, causal=False), **TOL)
    np.testing.assert_allclose(lse, _ref_lse(q, k, causal=False), **TOL)
    got = K.blockwise_attention_bwd(q, k, v, out, lse, w, causal=False, block_q=16, block_k=16)
    want = _grads(functools.partial(K.reference_attention, causal=False), q, k, v, w)
    for name, g, r in zip("qkv", got, want):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, err_msg=f"d{name}", **TOL)
    with pytest.raises(ValueError, match="does not match q shape"):
        K.blockwise_attention_fwd(q, k, v, causal=True, block_q=16, block_k=16)


def _bounded_case(window, documents):
    """q, k, v, w and the bounds of two cases (batch 2, 8 query heads over 2 KV heads, head_dim 16):

    * cache: 32 queries at prompt indices 32..63 over a 64-key cache in descending prompt order (slot s holds index
      63 - s, as a chunk-prefilled shard of one device), `kv_starts` the slot of each query's own index, `kv_ends`
      (with a window) the slot past its window; row 1 is shifted by 3 slots, and its first 3 queries see no key.
    * documents (causal): 64 tokens in documents of 20, 30 and 14, with `kv_starts` each query's position less 9
      (a second window, any sign) and 4 queries whose `kv_starts` lie past themselves (they see no key)."""
    if documents:
        q, k, v, w = _inputs(64, 8, 2, seed=3)
        seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [20, 30, 14]), np.repeat([4, 4, 5], [20, 30, 14])]))
        starts = jnp.broadcast_to(jnp.arange(64) - 9, (2, 64)).at[1, 40:44].set(50)
        return (q, k, v, w), dict(causal=True, segment_ids=seg, window=window, kv_starts=starts)
    q, w = (x[:, :32] for x in _inputs(64, 8, 2, seed=4)[::3])
    _, k, v, _ = _inputs(64, 8, 2, seed=5)
    starts = jnp.stack([31 - jnp.arange(32), 34 - jnp.arange(32)])
    ends = starts + window if window else jnp.full((2, 32), 64)
    ends = ends.at[1, :3].set(starts[1, :3])  # empty rows
    return (q, k, v, w), dict(causal=False, kv_starts=starts, kv_ends=ends)


@pytest.mark.parametrize("documents,window", [  # the fast tier: the cache with a window, documents without
    pytest.param(False, 0, id="cache-0", marks=pytest.mark.slow), pytest.param(False, 12, id="cache-12"),
    pytest.param(True, 0, id="documents-0"), pytest.param(True, 12, id="documents-12", marks=pytest.mark.slow)])
def test_per_query_key_bounds_match_the_dense_reference(documents, window):
    """`kv_starts` / `kv_ends` (each query's first key and one past its last), with and without a window, over a
    cache-ordered key block of another length and over causal documents: out, lse (-inf where a query sees no key)
    and dq, dk, dv equal the dense reference's; the forward reads head-major keys in place (also through the
    backend, and the Pallas kernel's forward in its interpreter); key tiles outside a query tile's bounds are not
    visited (NaN poison in the first and last key tiles)."""
    (q, k, v, w), opts = _bounded_case(window, documents)
    tiles = dict(block_q=8, block_k=16)
    ref = jax.jit(functools.partial(K.reference_attention_with_lse, **opts))
    out, lse = jax.jit(functools.partial(K.blockwise_attention_fwd, **opts, **tiles))(q, k, v)
    want_out, want_lse = ref(q, k, v)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)  # -inf at the same rows
    assert bool(jnp.isneginf(lse).any()) and not bool(jnp.isnan(out).any())
    got = jax.jit(functools.partial(K.blockwise_attention_bwd, **opts, **tiles))(q, k, v, out, lse, w)
    for name, g, r in zip("qkv", got, _grads(lambda *a: ref(*a)[0], q, k, v, w)):
        np.testing.assert_allclose(g, r, err_msg=f"d{name}", **TOL)
    head_major = [jnp.swapaxes(x, 1, 2) for x in (k, v)]
    for kernel in ("blockwise", "reference"):
        got = B.attention_fwd_with_lse(q, *head_major, backend=kernel, kv_head_major=True, **opts, **tiles)
        np.testing.assert_allclose(got[0], out, **TOL)
    if not documents:  # the Pallas kernel's forward (in its interpreter) takes both bounds, as the chunked prefill
        got = B.attention_fwd_with_lse(q, *head_major, backend="pallas", kv_head_major=True, interpret=True, **opts)
        np.testing.assert_allclose(got[0], want_out, **TOL)
        np.testing.assert_allclose(got[1], want_lse, **TOL)
    # The key tiles [lo, hi) each query tile visits: from its least first key (its window's, its own) to its
    # greatest end (its own key, with `causal`); NaN in the first or last key tile reaches only the rows that visit.
    first = np.maximum(np.asarray(opts["kv_starts"]), 0)
    if documents:
        first = np.maximum(first, np.asarray(K.segment_starts(opts["segment_ids"])))
        first = np.maximum(first, np.arange(64) - window + 1) if window else first
    ends = np.asarray(opts["kv_ends"]) if "kv_ends" in opts else np.arange(1, 65)[None].repeat(2, 0)
    lo = first.reshape(2, -1, 8).min(axis=(0, 2)) // 16
    hi = -(-ends.reshape(2, -1, 8).max(axis=(0, 2)) // 16)
    skipped = 0
    for tile in (0, 3):
        visits = (lo <= tile) & (hi > tile)
        bad = v.at[:, 16 * tile:16 * (tile + 1)].set(jnp.nan)
        out = K.blockwise_attention_fwd(q, k, bad, **opts, **tiles)[0]
        np.testing.assert_array_equal(np.asarray(jnp.isnan(out).any(axis=(0, 2, 3))).reshape(-1, 8).any(axis=1),
                                      visits, err_msg=f"key tile {tile}")
        skipped += int((~visits).sum())
    assert skipped


def test_per_query_key_bounds_are_checked():
    q, k, v, _ = _inputs(32, 4, 2)
    with pytest.raises(ValueError, match=r"kv_starts must be integer \[batch, seq\]"):
        K.blockwise_attention_fwd(q, k, v, kv_starts=jnp.zeros((2, 31), jnp.int32))
    with pytest.raises(ValueError, match=r"kv_ends must be integer"):
        K.blockwise_attention_bwd(q, k, v, q, jnp.zeros((2, 4, 32)), q, kv_ends=jnp.zeros((2, 32)))
    with pytest.raises(ValueError, match="kv_ends must come with kv_starts"):
        B.attention_fwd_with_lse(q, k, v, backend="pallas", causal=False, kv_ends=jnp.zeros((2, 32), jnp.int32),
                                 interpret=True)
