"""Ulysses context parallelism: attention over the whole sequence with heads split over the `context` axis.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509, §3): activations arrive sequence-sharded,
`[batch, S/C, H, d]` per device. One all-to-all per tensor turns them into head-sharded
`[batch, S, H/C, d]`; attention runs on whole heads with any single-device kernel; a second all-to-all turns
the output back into `[batch, S/C, H, d]`. Per link, each all-to-all moves O(S * H * d / C) elements.

Grouped-query attention (H query heads, H_kv key/value heads, C context devices):
  - H_kv divisible by C: KV heads are split like query heads. Device r holds query heads
    [r*H/C, (r+1)*H/C) and KV heads [r*H_kv/C, (r+1)*H_kv/C), exactly the groups those queries use.
  - C divisible by H_kv: each KV head is repeated C/H_kv times before the all-to-all, so device r holds one
    KV copy, head r // (C/H_kv), which is the group of all its H/C query heads. The repeat's transpose sums
    the replicas' gradients into the real KV head.
  - anything else raises `ConfigError` before tracing.

Ulysses x ring hybrid (USP, Fang & Zhao 2024, arXiv 2405.07719): when the mesh has a `ring` axis of size
R > 1, the sequence is split over `ring` x `context` (zigzag layout, `jaxlong.parallel.ring`); the all-to-alls run over
`context` only, giving each device `[b, S/R, H/C, d]`, and ring attention over `ring` (K/V blocks passed
around the R ring ranks) replaces the single-device kernel. The all-to-alls stay inside a node and only the
ring's point-to-point sends cross nodes.

Packed documents (docs/data.md): after the all-to-all every device attends over the whole sequence, so it
needs the segment ids `[batch, S]` of the whole sequence, not its `S/C` shard. `ulysses_attention` takes them
already gathered (`gather_segment_ids`, an int32 all-gather over `context` that the model does once per step,
outside its layer scan) and hands them to the kernel unchanged: no per-layer communication is added.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import BATCH_AXES, CONTEXT_AXIS, RING_AXIS, SEQ_AXES, axis_size, seq_axes
from jaxlong.kernels.backend import attention, resolve_backend
from jaxlong.layers import blocks as L
from jaxlong.layers.projection import project_qkv
from jaxlong.parallel.halo import halo_attention_local, halo_over_context
from jaxlong.parallel.ring import ring_attention_local, run_ids


def seq_to_heads(x: jax.Array) -> jax.Array:
    """All-to-all over `context` inside `shard_map`: `[b, S/C, h, d]` (sequence-sharded) -> `[b, S, h/C, d]`
    (head-sharded)."""
    return jax.lax.all_to_all(x, CONTEXT_AXIS, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array) -> jax.Array:
    """Inverse all-to-all: `[b, S, h/C, d]` (head-sharded) -> `[b, S/C, h, d]` (sequence-sharded)."""
    return jax.lax.all_to_all(x, CONTEXT_AXIS, split_axis=1, concat_axis=2, tiled=True)


def replicate_kv_heads(k: jax.Array, context: int) -> jax.Array:
    """`[b, s, H_kv, d]` -> `[b, s, C, d]` when H_kv < C (each KV head repeated C/H_kv times, in order)."""
    return k if k.shape[2] >= context else jnp.repeat(k, context // k.shape[2], axis=2)


def gather_segment_ids(segment_ids: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """Segment ids `[batch, S]` (int32) laid out whole on every context device: `P(('data', 'fsdp'), None)`;
    with a `ring` axis of size R > 1, as ring attention's run ids (`jaxlong.parallel.ring.run_ids`, zigzag
    layout), which mask documents exactly as the segment ids do; pass `ids_are_runs=True` with them.

    From the usual `P(('data', 'fsdp'), 'context')` this is one all-gather of `S * 4` bytes per sequence over the
    `context` axis; call it once per step, outside the layer scan, and pass the result to every layer."""
    sharding = jax.sharding.NamedSharding(mesh, P(BATCH_AXES, None))
    ids = jax.lax.with_sharding_constraint(segment_ids.astype(jnp.int32), sharding)
    ring = axis_size(mesh, RING_AXIS)
    return jax.lax.with_sharding_constraint(run_ids(ids, ring), sharding) if ring > 1 else ids


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    backend: str = "auto",
    causal: bool = True,
    block_q: int = 512,
    block_k: int = 512,
    segment_ids: jax.Array | None = None,
    ids_are_runs: bool = False,
    window: int = 0,
    window_exchange: str = "all_to_all",
) -> jax.Array:
    """Causal attention with Ulysses context parallelism over the mesh's `context` axis (and ring attention
    over its `ring` axis when that has size > 1: the Ulysses x ring hybrid).

    Args:
      q: `[batch, seq, heads, head_dim]`, global array; sharded batch over data x fsdp, seq over
        ring x context (in the zigzag layout when ring > 1, `jaxlong.parallel.ring.zigzag`).
      k, v: `[batch, seq, kv_heads, head_dim]`, same sharding.
      mesh: the `data x fsdp x ring x context` mesh (or `data x fsdp x context`).
      backend, block_q, block_k: the kernel (see `jaxlong.kernels.backend.attention`; `auto` resolved for the
        mesh's devices); with ring > 1 it runs ring attention's blocks (`jaxlong.parallel.ring.ring_kernel`).
      segment_ids: int32 `[batch, seq]` (0 = padding) or None: document masking. Whole sequences per device,
        as `gather_segment_ids` lays them out (passing them sharded over context gathers them on every call);
        with ring > 1 in the zigzag layout like q, and ring attention slices each K/V block's ids from them.
      ids_are_runs: with ring > 1, `segment_ids` are already run ids (`gather_segment_ids` makes them once per
        step); otherwise each call computes them.
      window: 0, or a sliding window of that many positions (a local layer): after the all-to-all each device
        holds whole sequences for its heads (ring = 1), so the kernel skips what the window masks
        (`jaxlong.kernels.blockwise`); with ring > 1 each ring rank receives a halo of the window's K/V from its
        neighbours instead of the ring (`jaxlong.parallel.halo`).
      window_exchange: with a window and ring = 1, `halo` (or `auto` where it sends fewer bytes,
        `jaxlong.parallel.halo.halo_over_context`): no all-to-all; each device keeps its tokens' heads and receives
        the window's K/V from the devices before it over `context`.

    Returns:
      `[batch, seq, heads, head_dim]`, sharded like q.

    Raises:
      ConfigError: heads not divisible by the context degree, or kv_heads and context not dividing one another
        (not for a local layer's halo exchange over `context`).
    """
    context = mesh.shape[CONTEXT_AXIS]
    spec = P(BATCH_AXES, seq_axes(mesh), None, None)
    ring = axis_size(mesh, RING_AXIS)
    seq = q.shape[1]
    halo = ring == 1 and halo_over_context(window_exchange, window, seq, context, q.shape[2], k.shape[2],
                                           q.shape[3], block_q, block_k)
    if not halo:
        check_heads(q.shape[2], k.shape[2], context)
        k = replicate_kv_heads(k, context)
        v = replicate_kv_heads(v, context)
    kernel = dict(backend=backend, causal=causal, block_q=block_q, block_k=block_k, window=window)
    if ring > 1:
        ring_backend = resolve_backend(backend, q, segment_ids, platform=mesh.devices.flat[0].platform)

    def local(q, k, v, seg=None):
        if halo:  # no all-to-all: this device's tokens, every head
            return halo_attention_local(q, k, v, window=window, block_q=block_q, block_k=block_k, segment_ids=seg,
                                        axis_name=CONTEXT_AXIS)
        q, k, v = seq_to_heads(q), seq_to_heads(k), seq_to_heads(v)
        if ring > 1 and 0 < window < seq:  # a window as long as the sequence masks nothing: the ring runs it
            out = halo_attention_local(q, k, v, window=window, block_q=block_q, block_k=block_k, segment_ids=seg,
                                       ids_are_runs=ids_are_runs)
        elif ring > 1:
            out = ring_attention_local(q, k, v, causal=causal, block_q=block_q, block_k=block_k, segment_ids=seg,
                                       backend=ring_backend, ids_are_runs=ids_are_runs)
        else:
            out = attention(q, k, v, segment_ids=seg, **kernel)
        return heads_to_seq(out)

    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, None if seg is None else P(BATCH_AXES, None)),
                         out_specs=spec, check_vma=True)(q, k, v, seg)


def sublayer(x: jax.Array, w, positions: jax.Array, segment_ids: jax.Array | None, ctx) -> jax.Array:
    """The attention sublayer with Ulysses (x ring) attention: `x + W_o attention(RoPE(W_q n(x)), ...)`.

    Projects Q, K, V for all heads from the normalized layer input (sequence-sharded), applies RoPE and
    Qwen3's q/k norms, runs `ulysses_attention` and the output projection. The tensors `attn_norm_out`,
    `query_proj`, `key_proj`, `value_proj` and `attn_out` are named for remat policies
    (`jaxlong.layers.remat`).

    Args:
      x: layer input `[batch, seq, hidden]`, sequence over ring x context.
      w: the layer's `jaxlong.parallel.dispatch.SublayerWeights` (FSDP-sharded; gathered here one by one).
      positions: int32 `[batch, seq]` RoPE positions. segment_ids: int32 `[batch, seq]` whole on every
        device (`gather_segment_ids`) or None.
      ctx: the `jaxlong.parallel.dispatch.SublayerContext` (mesh, kernel, model settings, weight gather).

    Returns:
      `[batch, seq, hidden]`, sharded like x.
    """
    qkv_spec = P(BATCH_AXES, SEQ_AXES, None, None)
    cos, sin = L.rope_tables(positions, ctx.head_dim, ctx.rope_theta, ctx.rope_scaling)

    def project(x, scale, wq, wk, wv, *qk_scales):
        return project_qkv(x, scale, wq, wk, wv, qk_scales or None, (cos, sin), ctx.norm_eps,
                           place=lambda a: ctx.constrain(a, qkv_spec), q_scale=ctx.query_scale)

    if ctx.recompute_projection:
        # The layer is recomputed in its backward anyway; checkpointing the projection as well makes the
        # normalized input `[b, S/C, hidden]` a recomputation at the weight-gradient step instead of a
        # buffer held from the layer's recompute through the whole attention backward (its peak).
        project = jax.checkpoint(project, policy=jax.checkpoint_policies.nothing_saveable)
    weights = (ctx.gather(w.wq), ctx.gather(w.wk), ctx.gather(w.wv))
    q, k, v = project(x, w.norm, *weights, *(w.qk_norm or ()))
    attn = ulysses_attention(q, k, v, mesh=ctx.mesh, backend=ctx.backend, block_q=ctx.block_q,
                             block_k=ctx.block_k, segment_ids=segment_ids,
                             ids_are_runs=axis_size(ctx.mesh, RING_AXIS) > 1, window=ctx.window,
                             window_exchange=ctx.window_exchange)
    attn = checkpoint_name(attn, "attn_out")
    out = jnp.einsum("bsnd,ndh->bsh", attn, ctx.gather(w.wo))
    return x + (out if w.post_norm is None else L.rms_norm(out, w.post_norm, ctx.norm_eps))


def context_degrees(heads: int, kv_heads: int) -> list[int]:
    """The `mesh.context` degrees Ulysses (and U-Pipe) can split `heads` query and `kv_heads` KV heads over:
    C divides `heads`, and KV heads are split (C divides kv_heads) or replicated (kv_heads divides C)."""
    return [c for c in range(1, heads + 1) if heads % c == 0 and (kv_heads % c == 0 or c % kv_heads == 0)]


def check_heads(heads: int, kv_heads: int, context: int) -> None:
    """Ulysses splits heads over the context axis.

    Raises:
      ConfigError: `heads` is not divisible by `context`, or neither of kv_heads and context divides the other
        (`key` mesh.context; the degrees these heads take are `context_degrees`).
    """
    at = dict(key="mesh.context", value=context, keys=("mesh.ring", "model.heads", "model.kv_heads"))
    if heads % context:
        raise ConfigError(
            f"model.heads={heads} is not divisible by mesh.context={context}: Ulysses gives each device "
            f"heads/context whole heads (the rest of the sequence split can go on mesh.ring)", **at)
    if kv_heads % context and context % kv_heads:
        raise ConfigError(
            f"model.kv_heads={kv_heads} and mesh.context={context}: KV heads are split when kv_heads is "
            f"divisible by context and replicated when context is divisible by kv_heads; neither holds", **at)
