"""Packed documents (segment ids) under ring attention (zigzag, causal), Ulysses x ring and U-Pipe x ring equal the
dense single-device reference with the same segment ids: forward and every gradient (float32, rtol 1e-5). The
documents straddle the ring's chunk boundaries, one is a single token, and rows end with padding (id 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RING_SEQ, assert_trees_close, loss_and_grads, reference_cfg, ring_mesh, tiered, tiny_cfg
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.kernels.blockwise import reference_attention
from jaxlong.layers.blocks import apply_rope, rope_tables
from jaxlong.parallel.ring import ring_attention, run_ids, unzigzag, zigzag
from jaxlong.parallel.ulysses import ulysses_attention
from jaxlong.parallel.record import SublayerContext, SublayerWeights
from jaxlong.parallel.upipe import upipe_attention

TOL = dict(rtol=1e-5, atol=1e-5)
S = 64
# Document lengths per row; the rest of the row is padding. With S=64 the ring's chunks are 16 (R=2), 8 (R=4)
# and 4 (R=8) tokens: every row has documents across chunk boundaries.
ROWS = [[5, 27, 1, 20], [20, 1, 39], [64], [3, 3, 50]]


def _segments(b, s=S):
    """int32 [b, s]: documents 1, 2, ... of ROWS (cycled), then padding (0); plus per-document positions."""
    seg, pos = np.zeros((b, s), np.int32), np.zeros((b, s), np.int32)
    for r in range(b):
        start = 0
        for i, n in enumerate(ROWS[r % len(ROWS)]):
            seg[r, start:start + n], pos[r, start:start + n] = i + 1, np.arange(n)
            start += n
        pos[r, start:] = np.arange(s - start)
    return jnp.asarray(seg), jnp.asarray(pos)


def _qkv(b, s, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    n = lambda key, heads: jax.random.normal(key, (b, s, heads, d))
    return n(ks[0], h), n(ks[1], kvh), n(ks[2], kvh), n(ks[3], h)


def _grads(fn, q, k, v, ct):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)


def _check(fn, ref, args, ct, names):
    np.testing.assert_allclose(jax.jit(fn)(*args), ref(*args), **TOL)
    grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=tuple(range(len(args))))(*args)
    for name, a, w in zip(names, jax.jit(lambda: grads(fn))(), grads(ref)):
        np.testing.assert_allclose(a, w, err_msg=name, **TOL)


def test_run_ids():
    seg = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 2, 2, 1, 1]], jnp.int32)
    want = np.array([[0, 0, 2, 2, 2, 5, 6, 6], [0, 0, 0, 0, 4, 4, 6, 6]])  # a reappearing id starts a new run
    np.testing.assert_array_equal(run_ids(zigzag(seg, 2), 2), zigzag(want, 2))


@pytest.mark.parametrize(*tiered("ring,heads,kv_heads", [(2, 4, 4), (4, 8, 2), (8, 8, 2)],
                                 ids=["r2-mha", "r4-gqa4", "r8-gqa4"], fast={"r2-mha"}))
def test_ring_attention_with_segments_matches_reference(ring, heads, kv_heads):
    mesh = jax.make_mesh((8 // ring, ring), ("fsdp", "ring"), axis_types=(AxisType.Auto,) * 2)
    b = 8 // ring
    q, k, v, ct = _qkv(b, S, heads, kv_heads, 8)
    seg, _ = _segments(b)
    sh = NamedSharding(mesh, P("fsdp", "ring", None, None))

    def ring_fn(q, k, v):  # natural order in and out; zigzag inside
        args = [jax.device_put(zigzag(x, ring), sh) for x in (q, k, v)]
        out = ring_attention(*args, mesh=mesh, block_q=4, block_k=4, segment_ids=zigzag(seg, ring))
        return unzigzag(out, ring)

    _check(ring_fn, lambda q, k, v: reference_attention(q, k, v, segment_ids=seg), (q, k, v), ct,
           ("dq", "dk", "dv"))


def test_ring_blocks_of_other_documents_are_skipped():
    """Two documents of 8 tokens each on a ring of 2 (chunks and tiles of 4): the tiles pairing one document's
    queries with the other's keys are never computed, forward (NaN keys/values of document 1 never reach document 2's outputs;
    masking alone would give 0 * NaN) or backward (NaN queries of document 2 never reach document 1's dK, dV)."""
    ring, s = 2, 16
    mesh = jax.make_mesh((ring,), ("ring",), axis_types=(AxisType.Auto,))
    q, k, v, ct = _qkv(1, s, 2, 2, 8)
    seg = jnp.asarray([[1] * 8 + [2] * 8], jnp.int32)
    sh = NamedSharding(mesh, P(None, "ring", None, None))

    def ring_fn(q, k, v):
        args = [jax.device_put(zigzag(x, ring), sh) for x in (q, k, v)]
        return unzigzag(ring_attention(*args, mesh=mesh, block_q=4, block_k=4, segment_ids=zigzag(seg, ring)), ring)

    nan_doc = lambda x, first: x.at[:, :8].set(jnp.nan) if first else x.at[:, 8:].set(jnp.nan)
    out = jax.jit(ring_fn)(q, nan_doc(k, True), nan_doc(v, True))
    assert bool(jnp.isfinite(out[:, 8:]).all()) and not bool(jnp.isfinite(out[:, :8]).any())
    _, dk, dv = jax.jit(lambda *a: _grads(ring_fn, *a))(nan_doc(q, False), k, v, ct)
    assert bool(jnp.isfinite(dk[:, :8]).all()) and bool(jnp.isfinite(dv[:, :8]).all())


def test_ring_segment_errors():
    mesh = jax.make_mesh((2,), ("ring",), axis_types=(AxisType.Auto,))
    q, k, v, _ = _qkv(1, 16, 2, 2, 8)
    seg = jnp.ones((1, 16), jnp.int32)
    with pytest.raises(ValueError, match="requires causal=True"):
        ring_attention(q, k, v, mesh=mesh, causal=False, block_q=4, block_k=4, segment_ids=seg)
    with pytest.raises(ValueError, match=r"\[batch, S\] = \[1, 16\]"):
        ring_attention(q, k, v, mesh=mesh, block_q=4, block_k=4, segment_ids=seg[:, :8])


# ----------------------------------------------------------------------------- hybrids


_mesh, SEQ = ring_mesh, RING_SEQ


@pytest.mark.parametrize(*tiered(
    "ring,context,heads,kv_heads", [(2, 4, 8, 4), (4, 2, 8, 1), (8, 1, 8, 2)],
    ids=["r2c4-kvsplit", "r4c2-kvreplicated", "r8c1-gqa"], fast={"r2c4-kvsplit"}))
def test_ulysses_ring_with_segments_matches_reference(ring, context, heads, kv_heads):
    mesh = _mesh(ring, context)
    b = 8 // (ring * context)
    q, k, v, ct = _qkv(b, S, heads, kv_heads, 8, seed=2)
    seg, _ = _segments(b)
    sh = NamedSharding(mesh, P(*SEQ, None, None))

    def hybrid(q, k, v):
        args = [jax.device_put(zigzag(x, ring), sh) for x in (q, k, v)]
        out = ulysses_attention(*args, mesh=mesh, backend="blockwise", block_q=4, block_k=4,
                                segment_ids=zigzag(seg, ring))
        return unzigzag(out, ring)

    _check(hybrid, lambda q, k, v: reference_attention(q, k, v, segment_ids=seg), (q, k, v), ct, ("dq", "dk", "dv"))


@pytest.mark.parametrize(*tiered(
    "ring,context,u_per_c,kv_heads", [(2, 4, 1, 2), (2, 4, 2, 4), (4, 2, 2, 1), (8, 1, 1, 4)],
    ids=["r2c4-U=C-kvrep", "r2c4-U=2C-kvsplit", "r4c2-U=2C-kvrep", "r8c1-U=C"], fast={"r2c4-U=2C-kvsplit"}))
def test_upipe_ring_with_segments_matches_reference(ring, context, u_per_c, kv_heads):
    """U-Pipe x ring with per-document RoPE positions and segment ids, both in the zigzag layout."""
    mesh = _mesh(ring, context)
    heads, hidden, d = 8, 32, 8
    b = 8 // (ring * context)
    ks = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(ks[0], (b, S, hidden))
    wq = jax.random.normal(ks[1], (hidden, heads, d)) / hidden**0.5
    wk = jax.random.normal(ks[2], (hidden, kv_heads, d)) / hidden**0.5
    wv = jax.random.normal(ks[3], (hidden, kv_heads, d)) / hidden**0.5
    ct = jax.random.normal(ks[4], (b, S, heads, d))
    seg, pos = _segments(b)

    def dense(x, wq, wk, wv):
        cos, sin = rope_tables(pos, d, 10000.0)
        q = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wq), cos, sin)
        k = apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wk), cos, sin)
        return reference_attention(q, k, jnp.einsum("bsh,hnd->bsnd", x, wv), segment_ids=seg)

    def upipe(x, wq, wk, wv):
        ctx = SublayerContext(mesh, heads_per_stage=u_per_c * context, backend="blockwise", block_q=4, block_k=4)
        out = upipe_attention(jax.device_put(zigzag(x, ring), NamedSharding(mesh, P(*SEQ, None))),
                              SublayerWeights(None, wq, wk, wv), ctx, positions=zigzag(pos, ring),
                              segment_ids=zigzag(seg, ring))
        return unzigzag(out, ring)

    _check(upipe, dense, (x, wq, wk, wv), ct, ("dx", "dWq", "dWk", "dWv"))


# ----------------------------------------------------------------------------- the train step


def _packed_batch(cfg, seed=3):
    """A packed batch of ROWS (documents, per-document positions and targets, padding masked out)."""
    rng = np.random.default_rng(seed)
    seg, pos = (np.asarray(a) for a in _segments(cfg.global_batch, cfg.seq_len))
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.global_batch, cfg.seq_len + 1)).astype(np.int32)
    last = np.append(seg[:, 1:] != seg[:, :-1], np.ones((seg.shape[0], 1), bool), axis=1)  # document ends
    mask = ((seg > 0) & ~last).astype(np.float32)  # no target across a document boundary
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask, "positions": pos, "segment_ids": seg}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "tiling.loss=true", "tiling.loss_tile=4"),
    ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe", "remat.policy=full"),
], ids=["ulysses-r2c4-tiled-loss", "upipe-fsdp2-r2c2"])
def test_packed_train_step_with_ring_matches_ring_1(overrides):
    """data.packing=documents: loss and every gradient of the model under mesh.ring=2 equal the mesh.ring=1 run
    (one device, reference attention with the same segment ids) on the same packed batch and parameters."""
    cfg = tiny_cfg(*overrides, f"seq_len={S}", "data.packing=documents")
    batch = _packed_batch(cfg)
    ref = reference_cfg(cfg)
    assert ref.mesh.ring == 1 and ref.data.packing == "documents"
    ref_loss, ref_grads, params = loss_and_grads(ref, 1, batch)
    loss, grads, _ = loss_and_grads(cfg, 8, batch, params_host=params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "upipe"])
def test_packed_ring_step_adds_no_sequence_squared_memory(impl):
    """The compiled train step under mesh.ring=2 with document masking needs no more temporary memory than the
    unpacked one (up to a few O(seq) int32 arrays): nothing [S, S]-shaped or per head is added."""
    from helpers import mesh_for

    from jaxlong.core.memstats import compiled_bytes
    from jaxlong.training import step as step_lib

    def temp(packing):
        cfg = tiny_cfg("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "seq_len=4096", "global_batch=1",
                       "attention.block_q=256", "attention.block_k=256", "remat.policy=full",
                       f"attention.impl={impl}", f"data.packing={packing}")
        return compiled_bytes(step_lib.compile_train_step(cfg, mesh_for(cfg, 8)))["temp"]

    packed, unpacked = temp("documents"), temp("concat")
    seq_bytes = 4096 * 4  # one [batch, seq] int32 array, whole
    assert packed <= unpacked * 1.02 + 8 * seq_bytes, (packed, unpacked)
