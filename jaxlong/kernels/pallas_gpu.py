"""FlashAttention-2 in Pallas (Triton lowering) for NVIDIA GPUs, with document masking (segment ids).

    pallas_attention_fwd(q, k, v, segment_ids=None)                  -> (out, lse)
    pallas_attention_bwd(q, k, v, out, lse, dout, segment_ids=None)  -> (dq, dk, dv)   (no forward recomputation)
    pallas_attention(q, k, v, segment_ids=None)                      -> out            (custom_vjp)

The signatures, layout and lse convention are those of `jaxlong.kernels.cudnn`: q `[batch, seq, heads,
head_dim]`, k, v `[batch, seq, kv_heads, head_dim]`, out like q, lse float32 `[batch, heads, seq]`, the
natural-log logsumexp of the scaled scores `q . k / sqrt(head_dim)` per query row. This kernel exists for what
cuDNN cannot do at long context: segment ids (see `jaxlong.kernels.cudnn`); `attention.backend=auto` uses it
on GPUs when the batches carry segment ids and cuDNN otherwise.

Masking is exactly the blockwise kernel's (`jaxlong.kernels.blockwise`): with `causal`, query t sees keys 0..t;
with segment ids (int32 `[batch, seq]`, 0 = padding, `causal=True` required) it sees only the keys of its own
run of equal ids, i.e. keys `starts[t] <= key <= t` with `starts = segment_starts(segment_ids)`. With a sliding
`window` W > 0 (`causal=True` required; Gemma 3's local layers, docs/windows.md) it sees only keys `t - W < key
<= t` as well: itself and the W - 1 before it (transformers' `sliding_window`, cuDNN's `sliding_window_length`),
combined with the segment ids. Every query sees at least itself, so no softmax row is empty (padding attends to
earlier padding of its run). The run starts (and run ends, for the backward's bounds) are computed once outside
the kernels, O(seq) int32.

Ring attention's off-diagonal blocks (`jaxlong.parallel.ring`: every key before every query) take `kv_starts`
instead (int32 `[batch, seq]`, `causal=False`): query t sees key j iff `j >= kv_starts[t]`, the number of the
block's keys before its document's start. A query may see no key of the block: its output row is 0 and its lse
-inf (the ring's merge gives it weight 0). Without the causal mask the key block may have another length than
the queries (k, v `[batch, kv_seq, kv_heads, head_dim]`).

Algorithm (T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023):
  - Forward (§3.1, Algorithm 1): one program per (query tile, batch, head); it keeps the query tile, the
    running max `m`, the running sum `l` and the unnormalized output in float32 and streams kv tiles
    (online softmax), then writes `out = acc / l` and `lse = m + log(l)`. GQA: the program reads kv head
    `h // (heads / kv_heads)` through its BlockSpec; KV heads are never repeated in memory.
  - Backward (§3.1, Algorithm 2, no forward rerun): `delta = rowsum(dout * out)` first (float32, XLA), then
    two kernels that recompute each score tile from q, k and the saved lse (`P = exp(S - lse)`):
    dK/dV: one program per (kv tile, batch, kv head) loops over the group's query heads and the query tiles,
    so dK and dV are summed over the GQA group in float32 registers (no atomics, no per-head dK buffer);
    dQ: one program per (query tile, batch, head) loops over kv tiles.
  - Skipped tiles (loop bounds, no work and no loads): with `causal`, kv tiles wholly above the diagonal
    (forward, dQ) and query tiles wholly above it (dK/dV); with segment ids, kv tiles before the earliest run
    start of the query tile (forward, dQ) and query tiles after the end of the run holding the kv tile's last
    key (dK/dV); with a window W, kv tiles wholly before the query tile's earliest window start (forward, dQ)
    and query tiles wholly past the kv tile's last key + W - 1 (dK/dV), as `jaxlong.kernels.blockwise`
    (`window_tiles` counts them). Bounds are per (batch row, tile), so n equal documents cost about 1/n of causal
    attention. Tiles that straddle a document boundary or a window's edge are computed and masked.

Statistics, accumulators and the softmax are float32; matmuls take the input dtype (bf16/fp16/fp32) with
float32 accumulation (fp32 inputs without TF32). head_dim must be a power of two in [16, 256] (Triton tile
shapes), block sizes powers of two >= 16, every operand under 2**31 elements (`MAX_ELEMENTS`: the kernels'
pointer offsets are not shown to be 64-bit, as for `jaxlong.kernels.cudnn`). A sequence that is not a
multiple of the blocks is padded inside the call (padded keys are masked, padded rows dropped).

Segment ids may carry a shared prefix's branches (`jaxlong.core.segments`): the kernels read the queries' and the
keys' ids tile by tile (int32, `bq` and `bk` per tile) and mask a branch from its siblings, as the blockwise
kernel does. Ring attention's off-diagonal blocks pass the (query, key) run ids too (`kv_segment_ids`).

`interpret=True` runs the kernels in Pallas' interpreter (CPU tests; JAX 0.10.2's interpreter fails inside
`shard_map(check_vma=True)`, so interpreted tests run with `check_vma=False`); otherwise they lower through
Triton and need a GPU, or the deviceless GPU compile (`jaxlong.plan.target`), where XLA compiles them to sm_90
PTX. Inside `shard_map(check_vma=True)` (Ulysses, U-Pipe) the outputs vary over the mesh axes the inputs do.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxlong.core.ordering import varying_axes
from jaxlong.core.kept import keep_attention_residuals
from jaxlong.core.segments import documents, segment_starts, visible
from jaxlong.kernels.layout import check_qkv, check_window, pallas_head_dim_ok, pallas_tiles

__all__ = ["MAX_ELEMENTS", "pallas_attention", "pallas_attention_bwd", "pallas_attention_fwd"]

_F32 = jnp.float32
_NEG = float(jnp.finfo(jnp.float32).min)  # finite "minus infinity": no inf - inf NaNs
DEFAULT_BLOCK = 64
_LAUNCH = dict(num_warps=4, num_stages=2)  # Triton launch parameters of every kernel
MAX_ELEMENTS = 2**31 - 1  # per operand: Triton pointer offsets are 32-bit unless proven otherwise


def _check(q, k, v, segment_ids, causal, block_q, block_k, kv_starts=None, kv_segment_ids=None):
    """Validate before tracing; return (segment_ids as int32 or None, block_q, block_k)."""
    b, s, h, d = check_qkv(q, k, v, "pallas attention", causal)
    pair = kv_segment_ids is not None  # ring attention's off-diagonal blocks: the (query, key) id pair
    if pair:
        if causal or segment_ids is None:
            raise ValueError("pallas attention: kv_segment_ids requires causal=False and segment_ids")
        if tuple(kv_segment_ids.shape) != (b, k.shape[1]) or not jnp.issubdtype(kv_segment_ids.dtype, jnp.integer):
            raise ValueError(f"kv_segment_ids must be integer [batch, kv_seq] = {[b, k.shape[1]]}; got "
                             f"{kv_segment_ids.dtype} {tuple(kv_segment_ids.shape)}")
    if kv_starts is not None:
        if causal or (segment_ids is not None and not pair):
            raise ValueError("pallas attention: kv_starts (ring attention's off-diagonal blocks) requires "
                             "causal=False, and segment_ids only with kv_segment_ids")
        if tuple(kv_starts.shape) != (b, s) or not jnp.issubdtype(kv_starts.dtype, jnp.integer):
            raise ValueError(f"kv_starts must be integer [batch, seq] = {[b, s]}; got {kv_starts.dtype} "
                             f"{tuple(kv_starts.shape)}")
    if not (jnp.dtype(q.dtype) == jnp.dtype(k.dtype) == jnp.dtype(v.dtype)) or \
            jnp.dtype(q.dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"attention.backend=pallas needs q, k, v of one dtype among bfloat16, float16, float32; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not pallas_head_dim_ok(d):
        raise ValueError(f"attention.backend=pallas needs head_dim a power of two in [16, 256] (model.head_dim), "
                         f"got {d}; use attention.backend=blockwise")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if int(blk) != blk or blk < 16 or int(blk) & (int(blk) - 1):
            raise ValueError(f"pallas attention: {name}={blk!r} must be a power of two >= 16")
    if segment_ids is not None:
        if not causal and not pair:
            raise ValueError("segment_ids (document masking) requires causal=True")
        if tuple(segment_ids.shape) != (b, s) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integer [batch, seq] = {[b, s]}; got {segment_ids.dtype} "
                             f"{tuple(segment_ids.shape)}")
        segment_ids = segment_ids.astype(jnp.int32)
    block_q, block_k, padded = pallas_tiles(max(s, k.shape[1]), block_q, block_k)
    sp, skp = _padded(s, block_q, block_k), _padded(k.shape[1], block_q, block_k)
    if b * max(sp * h, skp * k.shape[2]) * d > MAX_ELEMENTS:  # also: jaxlong.kernels.backend.check_kernel_size
        raise ValueError(f"attention.backend=pallas: q {tuple(q.shape)} or k {tuple(k.shape)} (seq padded to "
                         f"{max(sp, skp)}) has more than "
                         f"{MAX_ELEMENTS:,} elements, beyond the kernels' int32 offsets; use a larger "
                         f"mesh.context, U-Pipe with fewer attention.heads_per_stage, or attention.backend=blockwise")
    return segment_ids, block_q, block_k


def _padded(seq: int, block_q: int, block_k: int) -> int:
    """`seq` padded to a multiple of both tiles (both are powers of two)."""
    return -(-seq // max(block_q, block_k)) * max(block_q, block_k)


def _runs(segment_ids, padded: int):
    """Run start and run end (inclusive) of every token, int32 `[batch, padded]`; padded tokens form one run."""

    b, s = segment_ids.shape
    pos = lax.broadcasted_iota(jnp.int32, (b, s), 1)
    doc = documents(segment_ids)  # a document's branches are one run with its prefix
    last = jnp.concatenate([doc[:, 1:] != doc[:, :-1], jnp.ones((b, 1), bool)], axis=1)
    ends = lax.cummin(jnp.where(last, pos, s - 1), axis=1, reverse=True)
    pad = ((0, 0), (0, padded - s))
    return (jnp.pad(segment_starts(segment_ids), pad, constant_values=s),
            jnp.pad(ends, pad, constant_values=padded - 1))


def _mask(q_pos, k_pos, starts, causal: bool, seq: int, padded: bool, window: int = 0):
    """Visible (query, key) pairs of one tile, bool `[bq, bk]`, or None when all are. `starts`: the queries' run
    starts (causal) or `kv_starts` (not causal), or None; `window` > 0: a sliding window (causal only)."""
    mask = None
    if causal:
        mask = q_pos[:, None] >= k_pos[None, :]
        if window:
            mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
        if starts is not None:
            mask = mask & (k_pos[None, :] >= starts[:, None])
        return mask
    if starts is not None:
        mask = k_pos[None, :] >= starts[:, None]
    if padded:  # causal masks padded keys for every real query already
        mask = _and(mask, jnp.broadcast_to(k_pos[None, :] < seq, (q_pos.shape[0], k_pos.shape[0])))
    return mask


def _and(mask, other):
    return other if mask is None else mask & other


def _dot(a, b, trans_a=False, trans_b=False):
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False if a.dtype == _F32 else None)


def _kv_bounds(i, st, *, causal, bq, bk, nk, window=0, en=None):
    """kv tiles [lo, hi) that query tile i can see (module docstring: skipped tiles); `en`: the queries' `kv_ends`."""
    hi = jnp.minimum(nk, lax.div((i + 1) * bq + bk - 1, bk)) if causal else nk
    if en is not None:  # up to the tile of the last key any query of the tile sees
        hi = jnp.minimum(hi, lax.div(jnp.maximum(jnp.max(en), 0) + bk - 1, bk))
    lo = lax.div(jnp.maximum(jnp.min(st), 0), bk) if st is not None else 0  # kv_starts may be < 0
    if window:  # the key tile of the earliest window start among the tile's queries
        lo = jnp.maximum(lo, lax.div(jnp.maximum(i * bq - window + 1, 0), bk))
    return jnp.minimum(lo, hi), hi


def _q_bounds(j, end_ref, *, causal, bq, bk, nq, window=0):
    """query tiles [lo, hi) that can see kv tile j (module docstring: skipped tiles)."""
    lo = lax.div(j * bk, bq) if causal else 0
    hi = jnp.minimum(nq, lax.div(jnp.max(end_ref[...]), bq) + 1) if end_ref is not None else nq
    if window:  # up to the tile of the last query whose window reaches the kv tile's last key
        hi = jnp.minimum(hi, lax.div((j + 1) * bk + window - 2, bq) + 1)
    return lo, hi


def _take(refs: list, present: bool):
    """The next optional input ref (in the order the wrapper appends them), or None."""
    return refs.pop(0) if present else None


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, scale, causal, segments, bq, bk, nk, seq, padded, window, ends=False,
                ids=False):
    *refs, o_ref, lse_ref = refs
    st_ref, en_ref = _take(refs, segments), _take(refs, ends)
    qid_ref, kid_ref = _take(refs, ids), _take(refs, ids)  # segment ids: the queries' tile, the whole keys'
    i = pl.program_id(0)
    q = q_ref[...]  # [bq, d]
    q_pos = i * bq + jnp.arange(bq)
    st = st_ref[...] if segments else None  # [bq] run starts
    en = en_ref[...] if ends else None  # [bq] kv_ends
    qid = qid_ref[...] if ids else None  # [bq] segment ids

    def body(j, carry):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        sc = _dot(q, k, trans_b=True) * scale  # [bq, bk] float32
        mask = _mask(q_pos, j * bk + jnp.arange(bk), st, causal, seq, padded, window)
        if en is not None:  # kv_ends
            mask = _and(mask, jnp.broadcast_to((j * bk + jnp.arange(bk))[None, :] < en[:, None], (bq, bk)))
        if ids:  # a shared prefix's branches see the prefix and themselves
            mask = _and(mask, visible(qid[:, None], kid_ref[pl.ds(j * bk, bk)][None, :]))
        if mask is not None:
            sc = jnp.where(mask, sc, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        p = jnp.exp(sc - m_new[:, None])
        if mask is not None:  # a row with no visible key in this tile has m_new == _NEG: keep its 1s out
            p = jnp.where(mask, p, 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    lo, hi = _kv_bounds(i, st, causal=causal, bq=bq, bk=bk, nk=nk, window=window, en=en)
    init = (jnp.zeros(q.shape, _F32), jnp.full((bq,), _NEG, _F32), jnp.zeros((bq,), _F32))
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    if segments and not causal:  # kv_starts: a query may see no key of the block (l == 0)
        seen = l > 0
        o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _vary_alike(*xs):
    """`xs` cast to vary over the same `jax.shard_map` axes (their union), and the output type to match.

    A `pallas_call` inside `shard_map(check_vma=True)` (Ulysses, U-Pipe) must declare how its outputs vary
    over the mesh; they vary as the inputs together do. Outside `shard_map` this changes nothing."""
    axes = varying_axes(*xs)
    out = []
    for x in xs:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    if "manual_axis_type" in params:  # JAX 0.10
        kw = {"manual_axis_type": getattr(jax.typeof(out[0]), "manual_axis_type", None)}
    else:  # JAX versions that spell it `vma`
        kw = {"vma": frozenset(axes)} if "vma" in params else {}
    return out, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, **kw)


def _starts(segment_ids, kv_starts, padded: int, padded_keys: int):
    """The per-query bound the kernels mask keys with, int32 `[batch, padded]`: run starts (`segment_ids`) or
    `kv_starts` (padded rows see none of the `padded_keys` keys)."""
    if kv_starts is None:
        return _runs(segment_ids, padded)[0]
    return _pad_seq(kv_starts.astype(jnp.int32), padded, value=padded_keys)


def _key_ids(segment_ids, kv_segment_ids):
    """The keys' segment ids, int32: `kv_segment_ids` (an off-diagonal block of ring attention) or the queries'."""
    return segment_ids if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)


def _pad_seq(x, padded: int, axis: int = 1, value=0):
    extra = padded - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pallas_attention_fwd(q, k, v, *, causal: bool = True, segment_ids=None, block_q: int = DEFAULT_BLOCK,
                         block_k: int = DEFAULT_BLOCK, interpret: bool = False, kv_starts=None,
                         kv_head_major: bool = False, window: int = 0, kv_ends=None, kv_segment_ids=None):
    """FlashAttention-2 forward (Pallas, Triton lowering); returns `(out, lse)`.

    Args:
      q: `[batch, seq, heads, head_dim]`; k, v: `[batch, kv_seq, kv_heads, head_dim]` (one dtype: bf16, fp16
        or fp32; head_dim a power of two in [16, 256]; `kv_seq` = `seq` when `causal`).
      causal: query t sees keys 0..t.
      segment_ids: int `[batch, seq]` or None: document masking (module docstring), needs `causal` (or
        `kv_segment_ids`); a shared prefix's branches (`jaxlong.core.segments`) are masked too.
      block_q, block_k: tile lengths, powers of two >= 16; seq is padded to a multiple of both.
      interpret: run in Pallas' interpreter (CPU tests) instead of compiling through Triton.
      kv_segment_ids: int `[batch, kv_seq]` or None: with `causal=False`, `segment_ids` and `kv_starts`, the keys'
        ids (ring attention's off-diagonal blocks): query t sees key j only if `jaxlong.core.segments.visible`.
      kv_starts: int `[batch, seq]` or None: with `causal=False`, query t sees key j iff `j >= kv_starts[t]`
        (ring attention's off-diagonal blocks with document masking, module docstring; the chunked prefill's
        cache, `jaxlong.generation.chunked`).
      kv_ends: int `[batch, seq]` or None: with `kv_starts`, query t sees key j only if `j < kv_ends[t]` too (a
        sliding window over the chunked prefill's cache, `jaxlong.generation.chunked`); the kv tiles past a query
        tile's last end are not visited.
      kv_head_major: k, v are `[batch, kv_heads, kv_seq, head_dim]` (a KV cache's layout: read in place, not
        transposed).
      window: 0, or a sliding window of that many positions with `causal` (query t sees keys `t - window + 1 ..
        t`, combined with the segment ids; module docstring, docs/windows.md); the kv tiles wholly before a query
        tile's earliest window start are not visited.

    Returns:
      `out` (shape and dtype of q) and `lse` float32 `[batch, heads, seq]` (natural log), the convention
      of `blockwise_attention_fwd` and `cudnn_attention_fwd`; with `kv_starts` a row that sees no key is 0
      with lse -inf.

    Raises:
      ValueError: malformed shapes, dtypes, head_dim, block sizes, segment ids or window (negative, or without
        `causal`), or q with more than `MAX_ELEMENTS` elements (before tracing a kernel).
    """
    seq_axis = 2 if kv_head_major else 1
    shapes = [jax.ShapeDtypeStruct(jnp.swapaxes(x, 1, 2).shape if kv_head_major else x.shape, x.dtype)
              for x in (k, v)]
    segment_ids, bq, bk = _check(q, *shapes, segment_ids, causal, block_q, block_k, kv_starts, kv_segment_ids)
    window = check_window(window, causal, "pallas attention")
    if kv_ends is not None and (kv_starts is None or tuple(kv_ends.shape) != tuple(kv_starts.shape)):
        raise ValueError(f"pallas attention: kv_ends must come with kv_starts, of its shape {q.shape[:2]}; got "
                         f"{None if kv_ends is None else tuple(kv_ends.shape)}")
    b, s, h, d = q.shape
    sk, g = shapes[0].shape[1], h // shapes[0].shape[2]
    sp, skp = _padded(s, bq, bk), _padded(sk, bq, bk)
    q_ = _pad_seq(q, sp)
    k_, v_ = (_pad_seq(x, skp, axis=seq_axis) for x in (k, v))
    segments = segment_ids is not None or kv_starts is not None
    ids = segment_ids is not None
    kernel = functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(d), causal=bool(causal), segments=segments,
                               bq=bq, bk=bk, nk=skp // bk, seq=sk, padded=skp != sk, window=window,
                               ends=kv_ends is not None, ids=ids)
    tile = pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, i, hh, 0))
    whole_kv = (pl.BlockSpec((None, None, skp, d), lambda i, bb, hh: (bb, lax.div(hh, g), 0, 0)) if kv_head_major
                else pl.BlockSpec((None, skp, None, d), lambda i, bb, hh: (bb, 0, lax.div(hh, g), 0)))
    in_specs, args = [tile, whole_kv, whole_kv], [q_, k_, v_]
    if segments:
        in_specs.append(pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i)))
        args.append(_starts(segment_ids, kv_starts, sp, skp))
    if kv_ends is not None:  # padded rows see no key
        in_specs.append(pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i)))
        args.append(_pad_seq(kv_ends.astype(jnp.int32), sp, value=0))
    if ids:  # the queries' ids by tile, the keys' whole (padded keys: id 0, seen by no document)
        in_specs += [pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i)), pl.BlockSpec((None, skp),
                                                                                     lambda i, bb, hh: (bb, 0))]
        args += [_pad_seq(segment_ids, sp), _pad_seq(_key_ids(segment_ids, kv_segment_ids), skp)]
    args, sds = _vary_alike(*args)
    out, lse = pl.pallas_call(
        kernel, grid=(sp // bq, b, h), in_specs=in_specs,
        out_specs=[tile, pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, i))],
        out_shape=[sds((b, sp, h, d), q.dtype), sds((b, h, sp), _F32)],
        compiler_params=plgpu.CompilerParams(**_LAUNCH),
        interpret=interpret,
        name="jaxlong_flash_fwd" + ("_causal" if causal else "") + ("_kvhm" if kv_head_major else ""))(*args)
    return out[:, :s], lse[:, :, :s]


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale, causal, segments, bq, bk, nq,
                 g, seq, padded, window, ids=False):
    *refs, dk_ref, dv_ref = refs
    # document masking: run starts and ends; kv_starts: every query tile may see the kv tile
    st_ref, end_ref = _take(refs, segments), _take(refs, segments and causal)
    qid_ref, kid_ref = _take(refs, ids), _take(refs, ids)  # segment ids: the queries' whole, the keys' tile
    j = pl.program_id(0)
    k = k_ref[...]  # [bk, d]
    v = v_ref[...]
    kid = kid_ref[...] if ids else None
    k_pos = j * bk + jnp.arange(bk)
    lo, hi = _q_bounds(j, end_ref, causal=causal, bq=bq, bk=bk, nq=nq, window=window)

    def q_step(i, carry, hg):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q = q_ref[rows, hg, :]  # [bq, d]
        do = do_ref[rows, hg, :]
        sc = _dot(q, k, trans_b=True) * scale
        mask = _mask(i * bq + jnp.arange(bq), k_pos, st_ref[rows] if segments else None, causal, seq, padded,
                     window)
        if ids:
            mask = _and(mask, visible(qid_ref[rows][:, None], kid[None, :]))
        if mask is not None:
            sc = jnp.where(mask, sc, _NEG)
        p = jnp.exp(sc - lse_ref[hg, rows][:, None])  # masked -> exp(_NEG - lse) == 0
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        dp = _dot(do, v, trans_b=True)
        ds = (p * (dp - delta_ref[hg, rows][:, None]) * scale).astype(q.dtype)
        return dk + _dot(ds, q, trans_a=True), dv

    def head(hg, carry):
        return lax.fori_loop(lo, hi, functools.partial(q_step, hg=hg), carry)

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(0, g, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale, causal, segments, bq, bk, nk, seq,
               padded, window, ids=False):
    *refs, dq_ref = refs
    st_ref = _take(refs, segments)
    qid_ref, kid_ref = _take(refs, ids), _take(refs, ids)  # segment ids: the queries' tile, the keys' whole
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]  # [bq, d]
    lse, delta = lse_ref[...], delta_ref[...]  # [bq]
    q_pos = i * bq + jnp.arange(bq)
    st = st_ref[...] if segments else None
    qid = qid_ref[...] if ids else None

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        sc = _dot(q, k, trans_b=True) * scale
        mask = _mask(q_pos, j * bk + jnp.arange(bk), st, causal, seq, padded, window)
        if ids:
            mask = _and(mask, visible(qid[:, None], kid_ref[pl.ds(j * bk, bk)][None, :]))
        if mask is not None:
            sc = jnp.where(mask, sc, _NEG)
        p = jnp.exp(sc - lse[:, None])
        ds = (p * (_dot(do, v, trans_b=True) - delta[:, None]) * scale).astype(k.dtype)
        return dq + _dot(ds, k)

    lo, hi = _kv_bounds(i, st, causal=causal, bq=bq, bk=bk, nk=nk, window=window)
    dq_ref[...] = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, _F32)).astype(dq_ref.dtype)


def pallas_attention_bwd(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None,
                         block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK, interpret: bool = False,
                         kv_starts=None, window: int = 0, kv_segment_ids=None):
    """FlashAttention-2 backward from the saved `out` and `lse` (no forward rerun); returns `(dq, dk, dv)`.

    Args:
      q, k, v, causal, segment_ids, block_q, block_k, interpret, kv_starts, window, kv_segment_ids: as for
        `pallas_attention_fwd` (the blocks need not match the forward's; the window must); dK/dV skip the query
        tiles past the reach of a kv tile's window.
      out: the forward output (shape of q); lse: float32 `[batch, heads, seq]` (from this forward,
        `cudnn_attention_fwd` or `blockwise_attention_fwd`, or ring attention's global output and lse for one
        of its blocks); dout: the gradient of out (shape of q).

    Returns:
      `dq`, `dk`, `dv` with the shapes and dtypes of q, k, v; dk and dv summed over each GQA group.

    Raises:
      ValueError: as `pallas_attention_fwd`, and when out, dout or lse have the wrong shapes.
    """
    segment_ids, bq, bk = _check(q, k, v, segment_ids, causal, block_q, block_k, kv_starts, kv_segment_ids)
    window = check_window(window, causal, "pallas attention")
    b, s, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != (b, h, s):
        raise ValueError(f"pallas attention backward: out {out.shape} and dout {dout.shape} must have q's shape "
                         f"{q.shape} and lse {lse.shape} must be [batch, heads, seq] = {(b, h, s)}")
    sp, skp = _padded(s, bq, bk), _padded(sk, bq, bk)
    # D_i = rowsum(dO_i * O_i) (Algorithm 2, line 4), float32 [b, h, s]
    delta = jnp.einsum("bshd,bshd->bhs", dout.astype(_F32), out.astype(_F32))
    q_, do_ = (_pad_seq(x, sp) for x in (q, dout.astype(q.dtype)))
    k_, v_ = (_pad_seq(x, skp) for x in (k, v))
    # padded rows (q = 0, dout = 0): lse = +max keeps their P = exp(S - lse) at 0, so they add nothing
    lse_, delta_ = _pad_seq(lse.astype(_F32), sp, 2, -_NEG), _pad_seq(delta, sp, 2)
    segments = segment_ids is not None or kv_starts is not None
    if kv_starts is not None:
        runs = (_starts(None, kv_starts, sp, skp),)
    else:
        runs = _runs(segment_ids, sp) if segments else None
    ids = segment_ids is not None
    common = dict(scale=1.0 / math.sqrt(d), causal=bool(causal), segments=segments, bq=bq, bk=bk, seq=sk,
                  padded=skp != sk, window=window, ids=ids)
    q_ids = _pad_seq(segment_ids, sp) if ids else None
    k_ids = _pad_seq(_key_ids(segment_ids, kv_segment_ids), skp) if ids else None
    params = plgpu.CompilerParams(**_LAUNCH)

    # dK, dV: grid (kv tile, batch, kv head); q, dout, lse, delta of the group's g query heads, whole sequence.
    group_rows = pl.BlockSpec((None, sp, g, d), lambda j, bb, kh: (bb, 0, kh, 0))
    group_stat = pl.BlockSpec((None, g, sp), lambda j, bb, kh: (bb, kh, 0))
    kv_tile = pl.BlockSpec((None, bk, None, d), lambda j, bb, kh: (bb, j, kh, 0))
    in_specs, args = [group_rows, kv_tile, kv_tile, group_rows, group_stat, group_stat], [q_, k_, v_, do_, lse_,
                                                                                         delta_]
    if segments:
        in_specs.append(pl.BlockSpec((None, sp), lambda j, bb, kh: (bb, 0)))
        if kv_starts is None:  # the run ends bound the query tiles
            in_specs.append(pl.BlockSpec((None, bk), lambda j, bb, kh: (bb, j)))
        args += list(runs)
    if ids:  # the queries' ids whole, the keys' by tile
        in_specs += [pl.BlockSpec((None, sp), lambda j, bb, kh: (bb, 0)), pl.BlockSpec((None, bk),
                                                                                     lambda j, bb, kh: (bb, j))]
        args += [q_ids, k_ids]
    args, sds = _vary_alike(*args)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, nq=sp // bq, g=g, **common), grid=(skp // bk, b, kvh),
        in_specs=in_specs, out_specs=[kv_tile, kv_tile],
        out_shape=[sds((b, skp, kvh, d), k.dtype), sds((b, skp, kvh, d), v.dtype)],
        compiler_params=params, interpret=interpret,
        name="jaxlong_flash_bwd_dkdv" + ("_causal" if causal else ""))(*args)

    # dQ: grid (query tile, batch, head); k, v of the head's kv head, whole sequence.
    q_tile = pl.BlockSpec((None, bq, None, d), lambda i, bb, hh: (bb, i, hh, 0))
    stat_tile = pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, i))
    whole_kv = pl.BlockSpec((None, skp, None, d), lambda i, bb, hh: (bb, 0, lax.div(hh, g), 0))
    in_specs, args = [q_tile, whole_kv, whole_kv, q_tile, stat_tile, stat_tile], [q_, k_, v_, do_, lse_, delta_]
    if segments:
        in_specs.append(pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i)))
        args.append(runs[0])
    if ids:  # the queries' ids by tile, the keys' whole
        in_specs += [pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, i)), pl.BlockSpec((None, skp),
                                                                                     lambda i, bb, hh: (bb, 0))]
        args += [q_ids, k_ids]
    args, sds = _vary_alike(*args)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, nk=skp // bk, **common), grid=(sp // bq, b, h), in_specs=in_specs,
        out_specs=q_tile, out_shape=sds((b, sp, h, d), q.dtype),
        compiler_params=params, interpret=interpret, name="jaxlong_flash_bwd_dq" + ("_causal" if causal else ""))(*args)
    return dq[:, :s], dk[:, :sk], dv[:, :sk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pallas(q, k, v, segment_ids, causal, opts):
    return pallas_attention_fwd(q, k, v, causal=causal, segment_ids=segment_ids, **dict(opts))[0]


def _pallas_vjp_fwd(q, k, v, segment_ids, causal, opts):
    out, lse = pallas_attention_fwd(q, k, v, causal=causal, segment_ids=segment_ids, **dict(opts))
    out, lse = keep_attention_residuals(out, lse)  # `remat.keep_attention` may keep them
    return out, (q, k, v, segment_ids, out, lse)  # O(seq) residuals: no score tiles


def _pallas_vjp_bwd(causal, opts, res, dout):
    q, k, v, segment_ids, out, lse = res
    return (*pallas_attention_bwd(q, k, v, out, lse, dout, causal=causal, segment_ids=segment_ids, **dict(opts)),
            None)


_pallas.defvjp(_pallas_vjp_fwd, _pallas_vjp_bwd)


def pallas_attention(q, k, v, *, causal: bool = True, segment_ids=None, block_q: int = DEFAULT_BLOCK,
                     block_k: int = DEFAULT_BLOCK, interpret: bool = False, window: int = 0):
    """Differentiable Pallas flash attention (`jax.custom_vjp`); returns `out` (shape and dtype of q).

    The residuals are exactly `(q, k, v, segment_ids, out, lse)` and the backward is
    `pallas_attention_bwd` (no forward rerun). Shapes, `window` and errors as for `pallas_attention_fwd`
    (checked before tracing the custom_vjp).
    """
    segment_ids, _, _ = _check(q, k, v, segment_ids, causal, block_q, block_k)
    window = check_window(window, causal, "pallas attention")
    opts = (("block_q", int(block_q)), ("block_k", int(block_k)), ("interpret", bool(interpret)),
            ("window", window))
    return _pallas(q, k, v, segment_ids, bool(causal), opts)
