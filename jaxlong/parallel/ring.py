"""Ring attention over the mesh axis `ring`, causal with the zigzag layout (load-balanced).

Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers", arXiv 2310.01889):
the sequence is split over R ring ranks. Each rank keeps its queries; the K/V blocks travel around the ring
with `lax.ppermute` (R - 1 steps) and each step's partial attention is merged into the running output by its
log-sum-exp (Ring Attention, arXiv 2310.01889, §3; FlashAttention-2, arXiv 2307.08691):

    lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

Backward (a `custom_vjp`; it saves only q, k, v, the output and the lse -- nothing per ring step). It sends
K/V around the ring again; the dK/dV accumulator of each block travels with it, every rank adds its
contribution, and one last `ppermute` hands the finished dK/dV back to the block's owner. Each step's
`ppermute` of the next K/V block is issued before the step's attention, so XLA can overlap the transfer with
the compute. The accumulators (dQ of the local queries, the travelling dK/dV) are kept in the dtype of q, k, v
and every contribution is added in float32 and rounded once (`add_rounded`), the rule of U-Pipe's sums over a
KV group's stages and of the cuDNN kernel's sums over head calls; float32 accumulators would be 3 more
`[b, S/R, h, d]` bf16-sized buffers at the backward's peak (7.4 GiB per H100 at 1.3M tokens per GPU on
Llama-3.1-8B). In bf16, dK/dV are then rounded once per ring step.

Memory that does not grow with the ring (the context per GPU holds from R = 2 to R = 8, measured on the GPU
compile: `docs/multi-node.md`). The device holds one visiting K/V block and one pair of travelling
accumulators at a time. The loops over the middle ring steps are `lax.while_loop`s: a `fori_loop` of static
length is a `scan`, and when the forward runs under `jax.checkpoint` (layer remat replays it), JAX's partial
evaluation of that scan can split it and stack every step's K/V halves, `[R-2, b, S/(2R), h, d]` each.
`ring_attention_fwd` / `ring_attention_bwd` can take the caller's dK/dV accumulators (`dkv`) and send the K/V
block home after its trip (`return_kv`), so U-Pipe keeps no second copy of a KV group's K/V and dK/dV while its
stages run the ring.

Zigzag layout (causal load balance, as in `zigzag_ring_flash_attn`): the sequence is cut into 2R chunks of
c = S/(2R) tokens and ring rank r holds chunks r and 2R-1-r, in that order (`zigzag`). Then with the K/V
block of rank `src`:
  - src == r: ordinary causal attention on the local 2c tokens (local order is causal order);
  - src <  r: all 2c queries see the first K/V chunk (chunk src) and none of the second;
  - src >  r: only the second query chunk (chunk 2R-1-r) sees the K/V block, all of it.
One call per step: either case is one unmasked kernel call of 2c x c scores, 2c queries to c keys or c queries to 2c
keys (`lax.cond` on src < r), so every rank does the same work at every step and no block is ever fully masked. The
slices a call takes (the first K/V chunk, or the second chunk of q, out and dout) are the only copies: selecting between
the two cases element by element would copy ten c-token halves per step. Token positions (RoPE) follow the permutation
(`zigzag_positions`); the loss, a mean over tokens, is unchanged when inputs, targets and mask are permuted together.

The per-block kernel (`BlockKernel`) is the one `attention.backend` resolves to: cuDNN flash attention on GPUs
(the diagonal block causal, the off-diagonal ones unmasked), the Pallas kernel when the batches carry segment
ids, the blockwise one (`jaxlong.kernels.blockwise`, pure JAX) elsewhere. Each returns `(out, lse)` and its
backward takes the *global* output and lse of the block's queries, so the per-block gradients of the ring are
exact; GQA is native in all three (KV heads are never repeated).

Packed documents (segment ids, the kernels' document masking): every rank holds the whole sequence's int32 ids
`[batch, S]` (zigzag layout) as run ids (`run_ids`: each token's document start in natural order, O(S)) -- the
model makes them once per step where it gathers the segment ids (`jaxlong.parallel.ulysses.gather_segment_ids`,
`ids_are_runs=True`); a direct call with segment ids converts them -- and slices each step's K/V block's ids from
them, so no ids travel around the ring. The diagonal block is the kernel's causal document mask; an
off-diagonal block (all its keys before all its queries) masks query i from key j unless their run ids are
equal (`kv_segment_ids` of the blockwise kernel; the Pallas kernel's `kv_starts`, the number of the block's
keys before the query's run start, counted over the block's chunks, is the same mask since keys precede
queries). A query may then see no key of a block: that block's lse is -inf and its merge weight 0. Run ids never
decrease along a chunk, so the kernel skips the tiles whose id ranges do not meet, forward and backward: with many short
documents most remote blocks cost next to nothing. Nothing `[S, S]`-shaped or per head is added.

Hybrids: with a `context` axis as well, `jaxlong.parallel.ulysses.ulysses_attention` all-to-alls heads over `context`
and runs `ring_attention_local` over `ring` (USP, Fang & Zhao 2024, arXiv 2405.07719); `jaxlong.parallel.upipe` runs it
for each stage's heads.

Memory per device: q, k, v, out (`[b, S/R, h, d]` each, h the heads this device holds), the lse, one extra
K/V block in flight, the accumulators and one call's slices, and the kernels' O(tile^2) scratch: O(S/R) for a
fixed head count, O(S/(R*C)) per device with Ulysses over C (heads split C ways), whatever R.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import RING_AXIS
from jaxlong.core.kept import keep_attention_residuals
from jaxlong.kernels import cudnn as cudnn_kernel
from jaxlong.kernels import pallas_gpu as pallas_kernel
from jaxlong.core import segments
from jaxlong.kernels.blockwise import blockwise_attention_bwd, blockwise_attention_fwd
from jaxlong.core.segments import segment_starts
from jaxlong.kernels.merge import add_rounded, merge_into


# ----------------------------------------------------------------------------- zigzag layout


def zigzag(x: jax.Array, ring: int, axis: int = 1) -> jax.Array:
    """Permute a global array's sequence axis into the zigzag layout: `out[..., i, ...] = x[..., order[i], ...]`
    with `order = jaxlong.core.batch.zigzag_order(S, ring)`. A reshape and a reversal, no gather."""
    if ring == 1:
        return x
    x = jnp.moveaxis(x, axis, 0)
    s = x.shape[0]
    if s % (2 * ring):
        raise ValueError(f"zigzag layout: sequence length {s} must be divisible by 2*ring = {2 * ring}")
    c = x.shape[0] // (2 * ring)
    chunks = x.reshape(2 * ring, c, *x.shape[1:])
    out = jnp.stack([chunks[:ring], chunks[ring:][::-1]], axis=1).reshape(x.shape)
    return jnp.moveaxis(out, 0, axis)


def unzigzag(x: jax.Array, ring: int, axis: int = 1) -> jax.Array:
    """Inverse of `zigzag`: back to natural token order along `axis`."""
    if ring == 1:
        return x
    x = jnp.moveaxis(x, axis, 0)
    c = x.shape[0] // (2 * ring)
    pairs = x.reshape(ring, 2, c, *x.shape[1:])
    out = jnp.concatenate([pairs[:, 0], pairs[:, 1][::-1]], axis=0).reshape(x.shape)
    return jnp.moveaxis(out, 0, axis)


def zigzag_positions(slot: jax.Array, seq_len: int, ring: int) -> jax.Array:
    """Original token positions of zigzag-layout slots `slot` (int array of any shape, traced or not)."""
    if ring == 1:
        return slot
    c = seq_len // (2 * ring)
    r, within = slot // (2 * c), slot % (2 * c)
    return jnp.where(within < c, r * c + within, (2 * ring - 1 - r) * c + within - c)


# ----------------------------------------------------------------------------- per-step math


def run_ids(segment_ids: jax.Array, ring: int) -> jax.Array:
    """Each token's run id: the original position of the first token of its run of one document (its
    document's start), with the token's shared-prefix branch (`jaxlong.core.segments`), int32 `[batch, S]`.
    `segment_ids` (int `[batch, S]`) and the result are in the zigzag layout for `ring`.

    Two tokens share a run iff they are in the same run of the natural order, so for a key before a query
    `segments.visible` of their run ids is exactly the kernel's mask (`jaxlong.kernels.blockwise`, module
    docstring), and the runs never decrease along either of a rank's two chunks. O(S) work and memory."""
    ids = segment_ids.astype(jnp.int32)
    starts = zigzag(segment_starts(unzigzag(ids, ring)), ring)
    return segments.encode(starts, segments.branches(ids))


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """The attention kernel of ring attention's blocks: `backend` `blockwise` (pure JAX, any device, `block_q` x
    `block_k` tiles), `cudnn` (GPUs, no segment ids) or `pallas` (GPUs, segment ids; `interpret` runs it in Pallas'
    interpreter for CPU tests). Arrays as `ring_attention_fwd`'s local ones.

    `diagonal_*` is the rank's own block (`causal`, segment ids = run ids of the block); `block_*` an
    off-diagonal block of `[b, Lk]` keys for `[b, Lq]` queries (Lk and Lq each S/(2R) or S/R), unmasked or, with
    run ids, query i sees key j iff their run ids are equal (`k_starts`: the original positions of the first
    tokens of the key block's zigzag chunks, in order, for the Pallas kernel's `kv_starts`). The backwards take
    the global output and lse of the block's queries."""

    backend: str = "blockwise"
    block_q: int = 512
    block_k: int = 512
    interpret: bool = False

    def _run(self, backward: bool, *arrays, causal: bool, **masks):
        """This backend's forward or backward on `arrays`; cuDNN takes no masks (it never gets segment ids)."""
        if self.backend == "cudnn":
            fn = cudnn_kernel.cudnn_attention_bwd if backward else cudnn_kernel.cudnn_attention_fwd
            return fn(*arrays, causal=causal)
        if self.backend == "pallas":
            fn = pallas_kernel.pallas_attention_bwd if backward else pallas_kernel.pallas_attention_fwd
            return fn(*arrays, causal=causal, interpret=self.interpret, **masks)
        fn = blockwise_attention_bwd if backward else blockwise_attention_fwd
        return fn(*arrays, causal=causal, block_q=self.block_q, block_k=self.block_k, **masks)

    def _block_masks(self, k, q_ids, k_ids, k_starts) -> dict:
        """An off-diagonal block's masks: none, or the run ids (and the Pallas kernel's `kv_starts`)."""
        if q_ids is None:
            return {}
        masks = dict(segment_ids=q_ids, kv_segment_ids=k_ids)
        if self.backend == "pallas":
            masks["kv_starts"] = kv_starts_of_chunks(q_ids, k_starts, k.shape[1] // max(len(k_starts), 1))
        return masks

    def diagonal_fwd(self, q, k, v, causal, ids=None):
        return self._run(False, q, k, v, causal=causal, segment_ids=ids)

    def diagonal_bwd(self, q, k, v, out, lse, dout, causal, ids=None):
        return self._run(True, q, k, v, out, lse, dout, causal=causal, segment_ids=ids)

    def block_fwd(self, q, k, v, q_ids=None, k_ids=None, k_starts=()):
        return self._run(False, q, k, v, causal=False, **self._block_masks(k, q_ids, k_ids, k_starts))

    def block_bwd(self, q, k, v, out, lse, dout, q_ids=None, k_ids=None, k_starts=()):
        return self._run(True, q, k, v, out, lse, dout, causal=False, **self._block_masks(k, q_ids, k_ids, k_starts))


def kv_starts_of_chunks(q_runs: jax.Array, k_starts, chunk: int) -> jax.Array:
    """The Pallas kernel's `kv_starts` `[b, Lq]` for a key block of zigzag chunks of `chunk` tokens starting at
    the original positions `k_starts` (increasing, every key before every query): the number of the block's keys
    before each query's run start `q_runs` `[b, Lq]`, so key j is seen iff j >= it (same document)."""
    return sum(jnp.clip(segments.documents(q_runs) - start, 0, chunk) for start in k_starts)


def ring_kernel(backend: str, block_q: int = 512, block_k: int = 512) -> BlockKernel:
    """The `BlockKernel` for a resolved `attention.backend` (`jaxlong.kernels.backend.resolve_backend`): cuDNN and
    Pallas as named, the blockwise kernel for anything else (`blockwise`, and `reference`, which has no
    per-block form)."""
    return BlockKernel(backend if backend in ("cudnn", "pallas") else "blockwise", int(block_q), int(block_k))


def _chunk_starts(src, n: int, c: int):
    """Original positions of the first tokens of ring rank `src`'s two zigzag chunks of `c` tokens."""
    return src * c, (2 * n - 1 - src) * c


def _head(x, c: int, axis: int = 1):
    return None if x is None else lax.slice_in_dim(x, 0, c, axis=axis)


def _tail(x, c: int, axis: int = 1):
    return None if x is None else lax.slice_in_dim(x, c, 2 * c, axis=axis)


def _add_at(total, part, start: int):
    """`add_rounded` of `part` into `total[:, start:start + len(part)]` (a zigzag chunk along axis 1)."""
    end = start + part.shape[1]
    return total.at[:, start:end].set(add_rounded(total[:, start:end], part))


def _fwd_step(q, k, v, out, lse, before, causal, kernel: BlockKernel, q_ids=None, k_ids=None, src=None, n=1):
    """Merge the attention of the local queries to one remote K/V block (owner `src` of the ring of `n`;
    `before`: src precedes this rank) into `(out, lse)`: one kernel call (module docstring, "One call per
    step"). `q_ids`, `k_ids`: run ids `[b, S/R]` of the queries and of the block (`run_ids`), or None."""
    if not causal:
        return merge_into(out, lse, *kernel.block_fwd(q, k, v))
    c = q.shape[1] // 2
    first, second = _chunk_starts(src, n, c)

    def early(out, lse):  # every local query sees the block's first chunk, none of its second
        o, l = kernel.block_fwd(q, _head(k, c), _head(v, c), q_ids, _head(k_ids, c), (first,))
        return merge_into(out, lse, o, l)

    def late(out, lse):  # only the second query chunk sees the block, all of it
        o, l = kernel.block_fwd(_tail(q, c), k, v, _tail(q_ids, c), k_ids, (first, second))
        m, ml = merge_into(_tail(out, c), _tail(lse, c, 2), o, l)
        return out.at[:, c:].set(m), lse.at[:, :, c:].set(ml)

    return lax.cond(before, early, late, out, lse)


def _bwd_step(q, k, v, out, lse, dout, acc, before, causal, kernel: BlockKernel, q_ids=None, k_ids=None,
              src=None, n=1):
    """Add the gradient contributions of one remote K/V block (see `_fwd_step`) into `acc` = (dq of the local
    queries, dk and dv of the block), in the accumulators' dtypes (`add_rounded`): one kernel call."""
    dq, dk, dv = acc
    if not causal:
        gq, gk, gv = kernel.block_bwd(q, k, v, out, lse, dout)
        return add_rounded(dq, gq), add_rounded(dk, gk), add_rounded(dv, gv)
    c = q.shape[1] // 2
    first, second = _chunk_starts(src, n, c)

    def early(dq, dk, dv):
        gq, gk, gv = kernel.block_bwd(q, _head(k, c), _head(v, c), out, lse, dout, q_ids, _head(k_ids, c), (first,))
        return add_rounded(dq, gq), _add_at(dk, gk, 0), _add_at(dv, gv, 0)

    def late(dq, dk, dv):
        gq, gk, gv = kernel.block_bwd(_tail(q, c), k, v, _tail(out, c), _tail(lse, c, 2), _tail(dout, c),
                                      _tail(q_ids, c), k_ids, (first, second))
        return _add_at(dq, gq, c), add_rounded(dk, gk), add_rounded(dv, gv)

    return lax.cond(before, early, late, dq, dk, dv)


def _ring_perm(n: int):
    return [(i, (i + 1) % n) for i in range(n)]  # rank i sends to i+1, receives from i-1


def _middle_steps(n: int, body, carry):
    """Run `body(i, carry) -> carry` for the ring steps i = 1 .. n-2 (the last step, which sends no K/V on, is
    the caller's), in a `lax.while_loop`, not a `fori_loop` (module docstring, memory)."""
    if n <= 2:
        return carry
    i, carry = lax.while_loop(lambda ic: ic[0] < n - 1, lambda ic: (ic[0] + 1, body(ic[0], ic[1])),
                              (jnp.int32(1), carry))
    return carry


def _block_ids(segment_ids, q, n: int, axis_name: str, causal: bool, ids_are_runs: bool = False):
    """`(ids_of(rank), q_ids)`: run ids `[b, S/R]` of any ring rank's block, sliced from the whole sequence's
    (nothing is communicated); `(None, None)` without segment ids. `ids_are_runs`: `segment_ids` are run ids
    already (`run_ids`, computed once per step by the model), else they are computed here.

    Raises:
      ValueError: segment ids with `causal=False`, or not `[batch, R * S/R]` integers."""
    if segment_ids is None:
        return (lambda rank: None), None
    b, s_loc = q.shape[:2]
    if not causal:
        raise ValueError("ring attention: segment_ids (document masking) requires causal=True")
    if tuple(segment_ids.shape) != (b, n * s_loc) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"ring attention: segment_ids must be the whole sequence's integer ids [batch, S] = "
                         f"{[b, n * s_loc]} (zigzag layout); got {segment_ids.dtype}{list(segment_ids.shape)}")
    runs = segment_ids.astype(jnp.int32) if ids_are_runs else run_ids(segment_ids, n)
    ids_of = lambda rank: lax.dynamic_slice_in_dim(runs, rank * s_loc, s_loc, axis=1)
    return ids_of, ids_of(lax.axis_index(axis_name))


# ----------------------------------------------------------------------------- forward / backward


def ring_attention_fwd(q, k, v, *, axis_name: str = RING_AXIS, causal: bool = True, block_q: int = 512,
                       block_k: int = 512, segment_ids=None, backend: str = "blockwise", ids_are_runs: bool = False,
                       return_kv: bool = False):
    """Ring attention forward inside `jax.shard_map`; returns `(out, lse)` like
    `jaxlong.kernels.backend.attention_fwd_with_lse`.

    Args:
      q: local `[batch, S/R, heads, head_dim]`; k, v: local `[batch, S/R, kv_heads, head_dim]`, this ring
        rank's zigzag shard (chunks r and 2R-1-r; for `causal=False` any layout).
      axis_name: the mesh axis of the ring (size R).
      causal: causal mask in original token order (zigzag layout required).
      block_q, block_k: the blockwise kernel's tiles; with `causal` they must divide S/(2R) (after clamping).
      segment_ids: int `[batch, S]` (0 = padding) or None: document masking (as the kernels'). The *whole*
        sequence's ids in the zigzag layout, on every rank (`jaxlong.parallel.ulysses.gather_segment_ids`): each
        step slices its K/V block's ids from them, so no ids travel around the ring. Requires `causal`.
      backend: the blocks' kernel, a resolved `attention.backend` (`ring_kernel`: cuDNN, Pallas or blockwise).
      ids_are_runs: `segment_ids` are already run ids (`run_ids`; the model computes them once per step).
      return_kv: the K/V block makes one more hop, home, and is returned too: a caller that needs k, v again
        (U-Pipe's next stage of the KV group) holds no copy of its own while the ring runs.

    Returns:
      out `[batch, S/R, heads, head_dim]` (dtype of q), lse float32 `[batch, heads, S/R]`; with `return_kv`
      also k, v (the same values, back from their trip).

    Raises:
      ValueError: an odd local length with `causal`, tiles not dividing the blocks, or segment ids without
        `causal` or not of shape `[batch, S]`.
    """
    kernel = ring_kernel(backend, block_q, block_k)
    n = lax.axis_size(axis_name)
    if causal and q.shape[1] % 2:
        raise ValueError(f"ring attention (zigzag): local sequence length {q.shape[1]} must be even")
    ids_of, q_ids = _block_ids(segment_ids, q, n, axis_name, causal, ids_are_runs)
    if n > 1:
        nxt = lax.ppermute((k, v), axis_name, _ring_perm(n))  # issued before the diagonal block
    out, lse = kernel.diagonal_fwd(q, k, v, causal, q_ids)
    out = out.astype(jnp.float32)
    if n == 1:
        return (out.astype(q.dtype), lse) + ((k, v) if return_kv else ())
    r = lax.axis_index(axis_name)

    def step(i, out, lse, k_i, v_i):
        src = (r - i) % n
        return _fwd_step(q, k_i, v_i, out, lse, src < r, causal, kernel, q_ids, ids_of(src), src, n)

    def body(i, carry):
        out, lse, k_i, v_i = carry
        nxt = lax.ppermute((k_i, v_i), axis_name, _ring_perm(n))  # issued before this step's block
        return (*step(i, out, lse, k_i, v_i), *nxt)

    out, lse, k_i, v_i = _middle_steps(n, body, (out, lse, *nxt))
    out, lse = step(n - 1, out, lse, k_i, v_i)
    home = lax.ppermute((k_i, v_i), axis_name, _ring_perm(n)) if return_kv else ()
    return (out.astype(q.dtype), lse, *home)


def ring_attention_bwd(q, k, v, out, lse, dout, *, axis_name: str = RING_AXIS, causal: bool = True,
                       block_q: int = 512, block_k: int = 512, segment_ids=None, backend: str = "blockwise",
                       ids_are_runs: bool = False, dkv=None, return_kv: bool = False):
    """Ring attention backward inside `jax.shard_map`; returns `(dq, dk, dv)` (dtypes of q, k, v).

    `out` and `lse` are `ring_attention_fwd`'s, `segment_ids`, `backend`, `ids_are_runs` the same as its (each
    block's backward gets the global out and lse of its queries). K/V travel around the ring again and each
    block's dK/dV accumulator travels with it, arriving back at its owner after R sends (module docstring,
    "Backward"). `dkv`: None, or accumulators (dk, dv) (shapes of k, v) that this call's gradients are added
    into (U-Pipe's sums over a KV group's stages): they start the trip, so the caller keeps no copy meanwhile,
    and the returned dk, dv are in their dtype. `return_kv`: as `ring_attention_fwd`'s, then returns
    `(dq, dk, dv, k, v)`. Raises as `ring_attention_fwd`."""
    kernel = ring_kernel(backend, block_q, block_k)
    n = lax.axis_size(axis_name)
    ids_of, q_ids = _block_ids(segment_ids, q, n, axis_name, causal, ids_are_runs)
    if n > 1:
        nxt = lax.ppermute((k, v), axis_name, _ring_perm(n))
    dq, dk, dv = kernel.diagonal_bwd(q, k, v, out, lse, dout, causal, q_ids)
    dq, dk, dv = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if dkv is not None:
        dk, dv = add_rounded(dkv[0], dk), add_rounded(dkv[1], dv)
    if n == 1:
        return (dq, dk, dv) + ((k, v) if return_kv else ())
    r = lax.axis_index(axis_name)
    dkv = lax.ppermute((dk, dv), axis_name, _ring_perm(n))  # this rank's dK/dV start their trip

    def step(i, dq, k_i, v_i, dk_i, dv_i):
        src = (r - i) % n
        return _bwd_step(q, k_i, v_i, out, lse, dout, (dq, dk_i, dv_i), src < r, causal, kernel, q_ids,
                         ids_of(src), src, n)

    def body(i, carry):
        dq, k_i, v_i, dk_i, dv_i = carry
        nxt = lax.ppermute((k_i, v_i), axis_name, _ring_perm(n))
        dq, dk_i, dv_i = step(i, dq, k_i, v_i, dk_i, dv_i)
        return (dq, *nxt, *lax.ppermute((dk_i, dv_i), axis_name, _ring_perm(n)))  # on to the next rank

    dq, k_i, v_i, dk_i, dv_i = _middle_steps(n, body, (dq, *nxt, *dkv))
    dq, dk_i, dv_i = step(n - 1, dq, k_i, v_i, dk_i, dv_i)
    home = (k_i, v_i) if return_kv else ()
    dk, dv, *home = lax.ppermute((dk_i, dv_i, *home), axis_name, _ring_perm(n))  # back to their owner
    return (dq, dk, dv, *home)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, segment_ids, axis_name, causal, opts):
    return ring_attention_fwd(q, k, v, axis_name=axis_name, causal=causal, segment_ids=segment_ids,
                              **dict(opts))[0]


def _ring_vjp_fwd(q, k, v, segment_ids, axis_name, causal, opts):
    out, lse = ring_attention_fwd(q, k, v, axis_name=axis_name, causal=causal, segment_ids=segment_ids,
                                  **dict(opts))
    out, lse = keep_attention_residuals(out, lse)  # `remat.keep_attention` may keep them
    return out, (q, k, v, segment_ids, out, lse)  # nothing per ring step


def _ring_vjp_bwd(axis_name, causal, opts, res, dout):
    q, k, v, segment_ids, out, lse = res
    return (*ring_attention_bwd(q, k, v, out, lse, dout, axis_name=axis_name, causal=causal,
                                segment_ids=segment_ids, **dict(opts)), None)


_ring.defvjp(_ring_vjp_fwd, _ring_vjp_bwd)


def ring_attention_local(q, k, v, *, axis_name: str = RING_AXIS, causal: bool = True, block_q: int = 512,
                         block_k: int = 512, segment_ids=None, backend: str = "blockwise",
                         ids_are_runs: bool = False) -> jax.Array:
    """Differentiable ring attention on local shards inside `jax.shard_map` (`custom_vjp`: forward
    `ring_attention_fwd`, backward `ring_attention_bwd`, residuals q, k, v, segment ids, out, lse). Shapes
    (`segment_ids`: the whole sequence's, `[batch, S]`), `backend`, `ids_are_runs` and errors as
    `ring_attention_fwd`; returns out `[batch, S/R, heads, head_dim]`."""
    opts = (("block_q", int(block_q)), ("block_k", int(block_k)), ("backend", str(backend)),
            ("ids_are_runs", bool(ids_are_runs)))
    return _ring(q, k, v, segment_ids, axis_name, bool(causal), opts)


def ring_attention(q, k, v, *, mesh: jax.sharding.Mesh, causal: bool = True, block_q: int = 512,
                   block_k: int = 512, segment_ids=None, backend: str = "blockwise") -> jax.Array:
    """Ring attention on global arrays whose sequence is split over the mesh axis `ring` only.

    Args:
      q: `[batch, seq, heads, head_dim]`, k, v: `[batch, seq, kv_heads, head_dim]`, global, sequence in the
        zigzag layout (`zigzag`) when `causal`; batch over the mesh's `data`/`fsdp` axes if it has them.
      mesh: a mesh with a `ring` axis; any `context` axis must have size 1 (with context > 1 use the
        Ulysses x ring hybrid, `jaxlong.parallel.ulysses.ulysses_attention`).
      segment_ids: int `[batch, seq]` (0 = padding) in the same layout as q, or None: document masking
        (requires `causal`); every ring rank gets them whole (`S * 4` bytes per sequence).
      backend: the blocks' kernel (`ring_kernel`): `blockwise`, `cudnn` or `pallas`.

    Returns:
      `[batch, seq, heads, head_dim]` in the same layout as q.

    Raises:
      ValueError: no `ring` axis, a `context` axis of size > 1, seq not divisible by 2 * ring (causal), or
        segment ids not `[batch, seq]` integers or without `causal`.
    """
    if RING_AXIS not in mesh.axis_names:
        raise ValueError(f"ring_attention needs a mesh axis {RING_AXIS!r}; mesh axes are {mesh.axis_names}")
    if mesh.shape.get("context", 1) != 1:
        raise ValueError("ring_attention: the mesh's context axis has size > 1; use ulysses_attention (hybrid)")
    n = mesh.shape[RING_AXIS]
    if causal and q.shape[1] % (2 * n):
        raise ValueError(f"ring attention (zigzag): seq={q.shape[1]} must be divisible by 2*ring = {2 * n}")
    batch = tuple(a for a in mesh.axis_names if a in ("data", "fsdp")) or None
    spec = P(batch, RING_AXIS, None, None)
    fn = functools.partial(ring_attention_local, causal=causal, block_q=block_q, block_k=block_k, backend=backend)
    ids_spec = None if segment_ids is None else P(batch, None)
    return jax.shard_map(lambda q, k, v, ids: fn(q, k, v, segment_ids=ids), mesh=mesh,
                         in_specs=(spec,) * 3 + (ids_spec,), out_specs=spec, check_vma=True)(q, k, v, segment_ids)


def check_ring(seq_len: int, ring: int, context: int, block_q: int, block_k: int) -> None:
    """Ring attention's zigzag layout (`jaxlong.parallel.ring`) cuts the sequence into 2*ring chunks, each split over
    `context`, and runs the kernel on blocks of seq_len/(2*ring) tokens.

    Raises:
      ConfigError: seq_len not divisible by 2*ring*context, or a kernel tile not dividing the block.
    """
    m = 2 * ring * context
    if seq_len % m:
        raise ConfigError(
            f"seq_len={seq_len} is not divisible by 2*mesh.ring*mesh.context = 2*{ring}*{context} = {m} (ring "
            f"attention's zigzag layout)", key="seq_len", value=seq_len, keys=("mesh.ring", "mesh.context"))
    block = seq_len // (2 * ring)
    for key, value in (("attention.block_q", block_q), ("attention.block_k", block_k)):
        if value <= 0 or block % min(value, block):
            raise ConfigError(
                f"{key}={value} must divide ring attention's block of seq_len/(2*mesh.ring) = {block} tokens (or be "
                f"at least as long)", key=key, value=value, keys=("seq_len", "mesh.ring"))
