"""U-Pipe: head-chunked Ulysses attention (Untied Ulysses, arXiv 2602.21196, §3.3).

Plain Ulysses projects Q, K, V for all H heads, all-to-alls them and runs attention on H/C heads per device at
once, so every head-sized intermediate is live together. U-Pipe runs the heads in H/U *stages* of U heads
(U = `heads_per_stage`, a multiple of the context degree C): each stage projects only its heads from the
layer input x, applies RoPE (global positions, or the batch's per-document positions for packed documents),
all-to-alls to `[b, S, U/C, d]`, runs attention (with the whole sequence's segment ids, if any), all-to-alls
back and writes its slice into one output buffer allocated before the stages. Only one stage's tensors are
live at a time, so head-proportional memory scales with U/C instead of H/C.

GQA schedule (§3.3). With H_kv' = max(H_kv, C) effective KV heads (KV heads are replicated C/H_kv times when
H_kv < C) and g = H/H_kv' query heads per effective KV head, each device takes
m = U/C query heads per stage and holds kc = max(1, m/g) KV heads per *KV group*; a group of C*kc KV heads is
projected and all-to-all'd once and reused by its max(1, g/m) stages. Stage u of group t gives device r the
query heads `(t*C*kc + r*kc)*g + u*m + j`, j < m — all of them belong to the KV heads r holds, so no device
needs another's KV. (U = C, H_kv >= C gives the paper's `kv = t*C + r`, `q = kv*g + u`.) Viewing the head
axis as `[groups, C, stages_per_group, m]`, stage (t, u) owns the slice `[t, :, u, :]` of W_q and of the output,
so outputs land in natural head order and pretrained weights give the same result as Ulysses. Requires
m | g or g | m.

Backward (a `custom_vjp`; forward and backward are both scans over stages). The forward saves only x, the
weights, the output buffer and the per-stage log-sum-exp. The backward recomputes each stage's projection,
RoPE and all-to-all, all-to-alls the saved output slice and the incoming gradient to head-sharded layout, runs
the attention backward, accumulates dK, dV over the group's stages, all-to-alls dQ (and dK, dV at the group's
end) back, un-rotates them (RoPE is orthogonal: its transpose is the rotation by -angle), and accumulates dx
and the weight gradients stage by stage. Each stage's `[b, S/C, hidden]` term of dx (dQ W_q^T, and dK W_k^T +
dV W_v^T at a group's end) is added into dx in place, one block of rows at a time (`accumulate_product`): the
whole product never exists beside dx (at 10M tokens on Llama-3.1-8B, C = 8, it was a 10 GiB buffer at the
backward's peak). Differentiating a plain scan instead would stack every stage's residuals and give the saving
back (`tests/parallel/test_upipe_memory.py` checks the compiled gradient for this).
With mesh.ring > 1 each stage's attention is ring attention (`jaxlong.parallel.ring`): the KV group's K/V and
its dK/dV accumulators travel the ring with the stage (`return_kv`, `dkv`) and come home for the next stage,
so the device holds one K/V block and one pair of accumulators at a time, whatever the ring degree.

Fused attention sublayer (`SublayerWeights.norm` and `.wo`, what `jaxlong.models.llama` uses). The op can take the
raw layer input and the attention RMSNorm's scale and normalize inside: the forward then saves the layer input
(alive anyway under layer remat) instead of the normalized copy. The norm is folded into the projections
(`_linear`): with h = x * (r * scale), r the per-token 1/rms, each stage computes `h @ W = r * (x @ (scale * W))`
and the weight gradients `h^T dY = scale * (x^T (r * dY))`, so no normalized `[b, S/C, hidden]` copy of x exists in
the forward or the backward (at 3M tokens on Llama-3.1-8B, C = 8, that is 3 GiB per device at the backward's peak);
the backward pulls the accumulated dh back through the norm (`jaxlong.layers.blocks.rms_norm_bwd`). Otherwise the
normalized input is a residual alive through the whole backward of the layer's MLP. With W_o as well, the op returns
`x + out @ W_o` and its backward takes the `[b, S/C, hidden]` gradient of the sublayer: each stage projects it onto
its own heads (`dy @ W_o[s]^T`, `[b, S/C, U, d]`) and accumulates its rows of dW_o, so the full-width output
gradient `[b, S/C, H, d]` that autodiff of `out @ W_o` would hand the op never exists, and the residual branch's
gradient goes straight into dx. Buffers the op allocates (the output buffer, the accumulators) are created with
`jaxlong.core.ordering.zeros_after`, so the compiler does not hoist them out of the decoder-layer scan.

Qwen3's q/k norms (`SublayerWeights.qk_norm`) and RoPE scaling (`SublayerContext.rope_scaling`). Each stage
normalizes its own query heads and its KV group's key heads over head_dim before RoPE, inside the op; the backward
recomputes `rope(norm(x @ w))` for the stage as a `jax.vjp` and pulls dQ (dK) back through it, accumulating the
norm scales' gradients over the stages. The RoPE tables carry the scaled frequencies (and YaRN's attention
factor, which the rotation's transpose carries too).

Memory model (`attention_memory_model`), per device, one attention layer: the tensors live at the peak of the
compiled program, i.e. what `memory_analysis().temp_size_in_bytes` counts (x, the weights and the incoming
gradient are arguments; the output, dx and the weight gradients are outputs). Sizes, with B bytes per element
(everything is float32 on the CPU, see below), m = U/C, kc as above, H_kv' = max(H_kv, C):
  T_q  = b*S*m*d*B        one stage's query-side tensor, `[b, S, m, d]` (= `[b, S/C, U, d]`)
  T_kv = b*S*kc*d*B       one KV group's K or V, `[b, S, kc, d]`        (Ulysses: b*S*(H_kv'/C)*d*B)
  T_o  = b*(S/C)*H*d*B    the output buffer `[b, S/C, H, d]`            (= Ulysses' Q, `[b, S, H/C, d]`)
  T_w  = hidden*(H + 2*C*kc)*d*B   W_q and one group's W_k, W_v (Ulysses: hidden*(H + 2*H_kv)*d*B)
  T_r  = 2*b*(S/C)*d*4    the RoPE tables (cos, sin and the stacked rotation tables, float32)
U-Pipe, forward only, at a stage's output all-to-all (U < H):
  K, V of the group 2*T_kv; the stage's attention output T_q; the all-to-all's send and receive chunks 2*T_q; T_r.
  With one stage (U = H) the peak is the query all-to-all instead: K, V 2*T_kv; the projection x W_q T_q; its
  send chunks T_q; T_r.
U-Pipe, forward + backward, at a backward stage's all-to-alls before the attention backward (U < H):
  the output buffer T_o (forward residual); K, V, their float32 accumulators dK, dV and the attention
  backward's fresh dK, dV 6*T_kv (4*T_kv when a KV group has a single stage: no accumulators); q, o, dout, the
  dq accumulator and one all-to-all's chunks 5*T_q; the weights transposed to the CPU's dot layout for dx,
  hoisted out of the loop, T_w; T_r. With one stage (U = H) the stage consumes the output buffer at once and
  there are no accumulators: 4*T_kv + 5*T_q + T_w + T_r. (Accumulators are float32 whatever B.)
Ulysses (`jaxlong.models.llama` path: project all heads, RoPE, `ulysses_attention`), the same layer:
  forward, at the query RoPE: Q projection T_o, its two rotated halves T_o, K, V projections 2*T_kv; T_r.
  forward + backward, at the dout all-to-all of the attention backward: q and o (residuals), the dq
  accumulator, dout's send and receive chunks 5*T_o; K, V and the attention backward's dK, dV 4*T_kv; T_w;
  T_r.
So every head-proportional term is T_q (U/C heads) instead of T_o (H/C heads): the query side shrinks by U/H
(87.5% at H = 64, U = C = 8), and per stage nothing of size `[S, H/C, d]` is live apart from the output buffer
(and its gradient, an argument). What remains at U = C is the output buffer, the KV group (K, V and dK, dV:
GQA keeps them for g/m stages), T_w and T_r. Two terms are CPU-specific: XLA's CPU backend lowers each
all-to-all as C sliced copies, a tuple exchange and a concatenation (the chunk terms) and transposes the
weights for the dx product (T_w). It also computes bf16 matmuls and all-to-alls in float32: measure in float32.
The model is checked against `memory_analysis` (within 15%, Llama3-8B and Qwen3-32B shapes, S = 256K, C = 8)
in `tests/parallel/test_upipe_memory.py`; `experiments/upipe_sweep.py` tabulates both.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import BATCH_AXES, CONTEXT_AXIS, RING_AXIS, axis_size, seq_axes
from jaxlong.core.ordering import opaque_one, zeros_after
from jaxlong.core.kept import keep_attention_residuals
from jaxlong.kernels.backend import attention_bwd, attention_fwd_with_lse, resolve_backend
from jaxlong.kernels.merge import add_rounded
from jaxlong.layers import blocks as L
from jaxlong.layers.remat import ATTENTION_NAMES
from jaxlong.parallel import ulysses
from jaxlong.parallel.halo import halo_attention_bwd, halo_attention_fwd, halo_over_context
from jaxlong.parallel.record import SublayerContext, SublayerWeights
from jaxlong.parallel.ring import ring_attention_bwd, ring_attention_fwd, zigzag_positions
from jaxlong.parallel.ulysses import check_heads, ulysses_attention


def _all_axes() -> tuple[str, ...]:
    """The axes of the enclosing `jax.shard_map`'s mesh (the op's arrays vary over all of them)."""
    return tuple(jax.sharding.get_abstract_mesh().axis_names)


def _ring_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return int(mesh.shape[RING_AXIS]) if RING_AXIS in mesh.axis_names else 1


def _halo(q, kernel: dict) -> bool:
    """Whether this stage's attention is a local layer's under ring: the halo exchange (`jaxlong.parallel.halo`)
    instead of the ring, unless the window spans the whole sequence (then it masks nothing)."""
    return _ring_size() > 1 and 0 < kernel["window"] < q.shape[1] * _ring_size()


def _ring_args(kernel: dict) -> dict:
    return {k: v for k, v in kernel.items() if k != "window"}


def _halo_args(kernel: dict) -> dict:
    return dict(window=kernel["window"], block_q=kernel["block_q"], block_k=kernel["block_k"])


def _attention_fwd(q, k, v, kernel: dict, seg=None, runs: bool = False):
    """The stage's attention on `[b, S/R, U/C, d]`: ring attention over `ring` (U-Pipe x ring) when R > 1, its
    blocks on `kernel["backend"]` (resolved for the mesh's devices), or a local layer's halo exchange
    (`kernel["window"]`); `seg`: segment ids of the whole sequence `[b, S]` (document masking; zigzag layout with
    ring attention, where `runs` says they are run ids).
    Returns (out, lse, k, v): under ring attention the KV group's K/V come back from their trip around the ring
    (`return_kv`), so the next stage uses them and no second copy stays on the device while the ring runs."""
    if _halo(q, kernel):  # only the window's K/V move, one way; the group's K/V stay home
        return (*halo_attention_fwd(q, k, v, segment_ids=seg, ids_are_runs=runs, **_halo_args(kernel)), k, v)
    if _ring_size() > 1:
        return ring_attention_fwd(q, k, v, segment_ids=seg, ids_are_runs=runs, return_kv=True, **_ring_args(kernel))
    return (*attention_fwd_with_lse(q, k, v, segment_ids=seg, **kernel), k, v)


def _attention_bwd(q, k, v, o, lse, do, dkv, kernel: dict, seg=None, runs: bool = False):
    """The stage's attention backward: (dq, the KV group's accumulators `dkv` with this stage's dK, dV added,
    k, v); under ring attention the accumulators and K/V travel the ring (`ring_attention_bwd`'s `dkv`,
    `return_kv`), so the device holds one KV block and one pair of accumulators at a time."""
    if _halo(q, kernel):
        dq, dk, dv = halo_attention_bwd(q, k, v, o, lse, do, segment_ids=seg, ids_are_runs=runs,
                                        **_halo_args(kernel))
    elif _ring_size() > 1:
        return ring_attention_bwd(q, k, v, o, lse, do, segment_ids=seg, ids_are_runs=runs, dkv=dkv,
                                  return_kv=True, **_ring_args(kernel))
    else:
        dq, dk, dv = attention_bwd(q, k, v, o, lse, do, segment_ids=seg, **kernel)
    return dq, add_rounded(dkv[0], dk), add_rounded(dkv[1], dv), k, v


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static U-Pipe stage schedule for H query heads, H_kv KV heads, C devices, U heads per stage."""

    heads: int
    kv_heads: int
    context: int
    heads_per_stage: int

    @property
    def kv_eff(self) -> int:  # effective KV heads (replicated up to C)
        return max(self.kv_heads, self.context)

    @property
    def kv_rep(self) -> int:  # copies of each real KV head
        return self.kv_eff // self.kv_heads

    @property
    def group_size(self) -> int:  # g: query heads per effective KV head
        return self.heads // self.kv_eff

    @property
    def m(self) -> int:  # query heads per device per stage
        return self.heads_per_stage // self.context

    @property
    def kc(self) -> int:  # KV heads per device per KV group
        return max(1, self.m // self.group_size)

    @property
    def stages_per_group(self) -> int:
        return max(1, self.group_size // self.m)

    @property
    def groups(self) -> int:
        return self.kv_eff // (self.context * self.kc)

    @property
    def stages(self) -> int:
        return self.heads // self.heads_per_stage

    def validate(self) -> None:
        """Raises ConfigError when U, H, H_kv and C do not admit a schedule (`config.check_upipe_schedule`)."""
        check_upipe_schedule(self.heads, self.kv_heads, self.context, self.heads_per_stage)

    def query_heads(self, t: int, u: int, r: int) -> list[int]:
        """Query heads device r computes in stage u of KV group t (for documentation and tests)."""
        base = (t * self.context * self.kc + r * self.kc) * self.group_size + u * self.m
        return list(range(base, base + self.m))


def attention_memory_model(
    impl: str, b: int, S: int, H: int, H_kv: int, d: int, hidden: int, C: int, U: int | None = None,
    dtype_bytes: int = 4, backward: bool = False,
) -> dict[str, int]:
    """Per-device bytes of the tensors live at the peak of one attention layer (module docstring), by tensor.

    Args:
      impl: "upipe" or "ulysses".
      b, S, H, H_kv, d, hidden: batch per device, global sequence length, query heads, KV heads, head_dim, hidden.
      C: context-parallel degree; U: heads per stage (U-Pipe only; a valid `Schedule`).
      dtype_bytes: bytes per activation/weight element (4 on the CPU, where everything is measured in float32).
      backward: False for the forward alone, True for forward + backward (a `jax.vjp` with the cotangent given).

    Returns:
      {tensor description: bytes}; the sum is the model of `memory_analysis().temp_size_in_bytes`.
    """
    B, s_loc = dtype_bytes, S // C
    t_r = 2 * b * s_loc * d * 4
    if impl == "ulysses":
        kv_eff = max(H_kv, C)
        t_o, t_kv, t_w = b * s_loc * H * d * B, b * S * (kv_eff // C) * d * B, hidden * (H + 2 * H_kv) * d * B
        if not backward:
            return {"Q projection [b,S/C,H,d]": t_o, "rotated halves of Q": t_o, "K, V projections": 2 * t_kv,
                    "RoPE tables": t_r}
        return {"q, o (residuals, [b,S,H/C,d])": 2 * t_o, "dq accumulator (float32)": t_o * 4 // B,
                "dout all-to-all send + receive chunks": 2 * t_o, "K, V": 2 * t_kv,
                "dK, dV of the attention backward": 2 * t_kv, "weights in dot layout": t_w, "RoPE tables": t_r}
    if impl != "upipe":
        raise ValueError(f"impl must be 'upipe' or 'ulysses', got {impl!r}")
    sch = Schedule(H, H_kv, C, U)
    sch.validate()
    t_q, t_kv = b * S * sch.m * d * B, b * S * sch.kc * d * B
    t_o, t_w = b * s_loc * H * d * B, hidden * (H + 2 * C * sch.kc) * d * B
    one_stage = sch.stages == 1
    if not backward:
        if one_stage:
            return {"K, V": 2 * t_kv, "query projection [b,S/C,U,d]": t_q, "all-to-all send chunks": t_q,
                    "RoPE tables": t_r}
        return {"K, V": 2 * t_kv, "stage attention output [b,S,U/C,d]": t_q,
                "all-to-all send + receive chunks": 2 * t_q, "RoPE tables": t_r}
    model = {} if one_stage else {"output buffer [b,S/C,H,d] (residual)": t_o}
    model["K, V"] = 2 * t_kv
    if sch.stages_per_group > 1:
        model["dK, dV accumulators (float32)"] = 2 * t_kv * 4 // B
    model["dK, dV of the attention backward"] = 2 * t_kv
    model["q, o, dout [b,S,U/C,d]"] = 3 * t_q
    model["dq accumulator (float32)"] = t_q * 4 // B
    model["one all-to-all's chunks"] = t_q
    model["weights in dot layout"] = t_w
    model["RoPE tables"] = t_r
    return model


def _rope_tables(x, pos, head_dim: int, opts: dict):
    """RoPE's (cos, sin) for this device's shard of x `[b, S/(R*C), hidden]` (inside shard_map), at the batch's
    positions `pos` `[b, S/(R*C)]` (per-document positions of packed documents), or when None at the global token
    positions (with a ring (R > 1) the shard is slot block `ring_index * C + context_index` of the zigzag layout)."""
    if pos is None:
        (batch, seq_local), ring, context = x.shape[:2], _ring_size(), _context_size()
        block = jax.lax.axis_index(CONTEXT_AXIS)
        if ring > 1:
            block = jax.lax.axis_index(RING_AXIS) * context + block
        slots = block * seq_local + jnp.arange(seq_local, dtype=jnp.int32)
        pos = jnp.broadcast_to(zigzag_positions(slots, seq_local * ring * context, ring), (batch, seq_local))
    return L.rope_tables(pos, head_dim, opts["theta"], opts.get("scaling"))


def _varying(x: jax.Array) -> jax.Array:
    return jax.lax.pcast(x, _all_axes(), to="varying")


def _kv_weight(w: jax.Array, t, sch: Schedule) -> jax.Array:
    """KV group t's weight `[D, C*kc, d]` (real heads repeated when H_kv < C)."""
    if sch.kv_rep > 1:
        return jnp.repeat(w, sch.kv_rep, axis=1)  # one group holds all C replicas
    n = sch.context * sch.kc
    return jax.lax.dynamic_slice_in_dim(w, t * n, n, axis=1)


def _stage_view(a: jax.Array, axis: int, sch: Schedule) -> jax.Array:
    """View the head axis `axis` of `a` (natural head order, followed by head_dim) as
    `[groups*C, stages_per_group, m*d]` (m and d merged so no unit axis reaches the layout assignment)."""
    d = a.shape[axis + 1]
    shape = a.shape[:axis] + (sch.groups * sch.context, sch.stages_per_group, sch.m * d) + a.shape[axis + 2 :]
    return a.reshape(shape)


def _stage_get(a: jax.Array, t, u, axis: int, sch: Schedule) -> jax.Array:
    """Stage (t, u)'s `[.., U, d, ..]` slice of the head axis `axis`: heads `[t*C:(t+1)*C, u, :]` of the view."""
    v = _stage_view(a, axis, sch)
    zero = jnp.zeros((), jnp.int32)
    start = [zero] * v.ndim
    start[axis], start[axis + 1] = t * sch.context, u
    size = list(v.shape)
    size[axis], size[axis + 1] = sch.context, 1
    out = jax.lax.dynamic_slice(v, start, size)
    return out.reshape(a.shape[:axis] + (sch.heads_per_stage,) + a.shape[axis + 1 :])


def _stage_set(a: jax.Array, val: jax.Array, t, u, axis: int, sch: Schedule) -> jax.Array:
    """Write `[.., U, d, ..]` `val` into stage (t, u)'s slice of the head axis `axis` of `a`."""
    v = _stage_view(a, axis, sch)
    val = val.reshape(val.shape[:axis] + (sch.context, 1, sch.m * val.shape[axis + 1]) + val.shape[axis + 2 :])
    zero = jnp.zeros((), jnp.int32)
    start = [zero] * v.ndim
    start[axis], start[axis + 1] = t * sch.context, u
    return jax.lax.dynamic_update_slice(v, val.astype(a.dtype), start).reshape(a.shape)


def _seq_to_heads(x: jax.Array) -> jax.Array:
    """`[b, S/C, U, d]` -> `[b, S, U/C, d]`, as `jaxlong.parallel.ulysses.seq_to_heads`, but all-to-all'd along a
    leading device axis (split = concat = 0) so each peer's chunk is contiguous and the received chunks are already
    in sequence order: no transposition after the exchange (for b = 1)."""
    b, s, u, d = x.shape
    c = u // _context_size()
    xt = x.reshape(b, s, _context_size(), c, d).transpose(2, 0, 1, 3, 4)
    y = jax.lax.all_to_all(xt, CONTEXT_AXIS, 0, 0, tiled=True)
    return y.transpose(1, 0, 2, 3, 4).reshape(b, -1, c, d)


def _heads_to_seq(y: jax.Array) -> jax.Array:
    """Inverse of `_seq_to_heads`: `[b, S, U/C, d]` -> `[b, S/C, U, d]`."""
    b, s_full, c, d = y.shape
    n = _context_size()
    yt = y.reshape(b, n, s_full // n, c, d).transpose(1, 0, 2, 3, 4)
    x = jax.lax.all_to_all(yt, CONTEXT_AXIS, 0, 0, tiled=True)
    return x.transpose(1, 2, 0, 3, 4).reshape(b, s_full // n, n * c, d)


def _context_size() -> int:
    return jax.lax.axis_size(CONTEXT_AXIS)


def _rope(x, cos, sin):
    """RoPE as `jaxlong.layers.blocks.apply_rope` (same pairing and values) written without slices and concatenation:
    with the head dim viewed as `[2, d/2]`, `x*cos + reverse(x)*[-sin, sin]`, one fusible elementwise loop."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, half)
    c = cos[:, :, None, None, :]
    s = jnp.stack([-sin, sin], axis=-2)[:, :, None, :, :]
    return (xf * c + jax.lax.rev(xf, (xf.ndim - 2,)) * s).reshape(x.shape).astype(x.dtype)


def _linear(x, w, fold=None):
    """`h @ w` `[b, S/C, n, d]` for `w` `[hidden, n, d]`, where h is x, or, with `fold` = (r, scale), the
    RMSNorm'd input `h = x * (r * scale)` (r: per-token `1/rms` `[b, S/C, 1]` float32, scale `[hidden]`)
    computed without forming h: `h @ w = r * (x @ (scale * w))` (scale folded into the weight rows, r applied to
    the `[b, S/C, n, d]` product). So no normalized `[b, S/C, hidden]` copy of the layer input exists."""
    if fold is None:
        return jnp.einsum("bsh,hnd->bsnd", x, w)
    r, scale = fold
    ws = (w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, None]).astype(w.dtype)
    y = jnp.einsum("bsh,hnd->bsnd", x, ws, preferred_element_type=jnp.float32)
    return (y * r[..., None]).astype(x.dtype)


def _project(x, w, cos, sin, rope: bool, norm=None, eps: float = 0.0, fold=None):
    """`h @ w` `[b, S/C, n, d]` (`_linear`; h = x, or RMSNorm(x) with `fold`); with `norm` (a `[d]` scale,
    Qwen3's q/k norm) RMSNorm over d per head, then RoPE when `rope`."""
    y = _linear(x, w, fold)
    if norm is not None:
        y = L.rms_norm(y, norm, eps)
    return _rope(y, cos, sin) if rope else y


def _weight_grad(x, g, fold=None):
    """`sum_bs h[b,s,k] g[b,s,n,d]` -> `[hidden, n, d]` (float32), with x as the un-transposed right operand;
    h = x, or with `fold` = (r, scale) the normalized `x * (r * scale)`: `scale * (x^T (r * g))`."""
    if fold is not None:
        r, scale = fold
        g = (g.astype(jnp.float32) * r[..., None]).astype(g.dtype)
    dw = jnp.einsum("bsnd,bsh->ndh", g, x, preferred_element_type=jnp.float32).transpose(2, 0, 1)
    return dw if fold is None else dw * fold[1].astype(jnp.float32)[:, None, None]


def accumulate_product(dx: jax.Array, dy: jax.Array, w: jax.Array, tiles: int = 1) -> jax.Array:
    """`dx + dy @ w^T`, the way U-Pipe's backward gathers dx (module docstring, "Backward").

    Args:
      dx: the accumulator `[b, S/C, hidden]`; dy: `[b, S/C, n, d]`; w: `[hidden, n, d]`.
      tiles: row blocks of the local sequence (must divide S/C). With `tiles` > 1 a loop adds each block's
        product into dx in place, so the full-width `[b, S/C, hidden]` product never exists beside the
        accumulator, only one block of it.

    Returns:
      `[b, S/C, hidden]` in dx's dtype: each product rounded to it and added in float32 (the same values for
      any `tiles`).
    """
    def part(rows_dy):
        return jnp.einsum("bsnd,hnd->bsh", rows_dy, w, preferred_element_type=dx.dtype)

    if tiles <= 1:
        return add_rounded(dx, part(dy))
    rows = dx.shape[1] // tiles

    def body(i, dx):
        at = i * rows
        block = add_rounded(jax.lax.dynamic_slice_in_dim(dx, at, rows, axis=1),
                            part(jax.lax.dynamic_slice_in_dim(dy, at, rows, axis=1)))
        return jax.lax.dynamic_update_slice_in_dim(dx, block, at, axis=1)

    return jax.lax.fori_loop(0, tiles, body, dx)


def _q_scaled(q, opts: dict):
    """Queries times the layer's query scale (`SublayerContext.query_scale`, Gemma 3's `query_pre_attn_scalar`),
    after RoPE; the backward applies the same scalar to dq (its own transpose)."""
    return q if opts["q_scale"] == 1.0 else (q * opts["q_scale"]).astype(q.dtype)


def _forward(x, wq, wk, wv, pos, seg, sch: Schedule, opts: dict, qk=None, fold=None):
    """Stage scan. Returns the output `[b, S/C, H, d]` and lse `[groups, stages_per_group, b, m, S]`.
    `pos`: RoPE positions `[b, S/C]` or None; `seg`: segment ids of the whole sequence `[b, S]` or None;
    `qk`: None, or the (q_norm, k_norm) scales `[d]` normalizing each stage's query and key heads;
    `fold`: None (x is the attention's input), or (1/rms `[b, S/C, 1]`, the RMSNorm scale `[hidden]`) of the
    raw layer input x, folded into every projection (`_linear`)."""
    qn, kn = (None, None) if qk is None else qk
    eps = opts["eps"]
    b, s_local, _ = x.shape
    d = wq.shape[-1]
    cos, sin = _rope_tables(x, pos, d, opts)
    out = zeros_after(x, (b, s_local, sch.heads, d), x.dtype, _all_axes())

    def group(out, t):
        k = _seq_to_heads(_project(x, _kv_weight(wk, t, sch), cos, sin, True, kn, eps, fold))
        v = _seq_to_heads(_project(x, _kv_weight(wv, t, sch), cos, sin, False, fold=fold))

        def stage(carry, u):
            out, k, v = carry
            q = _seq_to_heads(_project(x, _stage_get(wq, t, u, 1, sch), cos, sin, True, qn, eps, fold))
            o, lse, k, v = _attention_fwd(_q_scaled(q, opts), k, v, opts["kernel"], seg, opts.get("runs", False))
            return (_stage_set(out, _heads_to_seq(o), t, u, 2, sch), k, v), lse

        (out, _, _), lse = jax.lax.scan(stage, (out, k, v), jnp.arange(sch.stages_per_group))
        return out, lse

    return jax.lax.scan(group, out, jnp.arange(sch.groups))


def _stage_output(out, dout, wo, dwo, tu, sch: Schedule, one, opts: dict):
    """Stage (t, u)'s slice of the saved output buffer `[b, S/C, U, d]` (back from the host if offloaded) and of its
    gradient: `dout`'s slice, or with `wo` the stage's own `dout @ W_o[s]^T` from the `[b, S/C, hidden]` gradient,
    whose rows of dW_o (`out_s^T dout`) are written into `dwo` (returned)."""
    t, u = tu
    o_s = _stage_get(out, t, u, 2, sch)
    if opts.get("offload_output"):  # this stage's slice of the output buffer, back from the host
        o_s = jax.device_put(o_s, jax.memory.Space.Device)
    if wo is None:
        return o_s, _stage_get(dout, t, u, 2, sch), dwo
    wo_s = _stage_get(wo, t, u, 0, sch) * one
    do_s = jnp.einsum("bsh,ndh->bsnd", dout, wo_s).astype(dout.dtype)
    dwo_s = jnp.einsum("bsnd,bsh->ndh", o_s, dout, preferred_element_type=jnp.float32)
    return o_s, do_s, _stage_set(dwo, dwo_s, t, u, 0, sch)


def _place_kv_grads(dwk, dwv, dwkv, t, sch: Schedule):
    """Add KV group t's weight gradients `dwkv` `[hidden, 2 C kc, d]` (K's then V's) into dW_k, dW_v `[hidden,
    kv_heads, d]`: at the group's heads, or summed over the replicas of each real KV head (H_kv < C)."""
    n_kv, d = sch.context * sch.kc, dwkv.shape[-1]
    dwk_t, dwv_t = dwkv[:, :n_kv], dwkv[:, n_kv:]
    if sch.kv_rep > 1:  # replicas' gradients sum into the real KV head
        return (dwk + dwk_t.reshape(dwk_t.shape[0], sch.kv_heads, sch.kv_rep, d).sum(2),
                dwv + dwv_t.reshape(dwv_t.shape[0], sch.kv_heads, sch.kv_rep, d).sum(2))
    return (jax.lax.dynamic_update_slice_in_dim(dwk, dwk_t, t * n_kv, axis=1),
            jax.lax.dynamic_update_slice_in_dim(dwv, dwv_t, t * n_kv, axis=1))


def _backward(x, wq, wk, wv, pos, seg, out, lse, dout, sch: Schedule, opts: dict, wo=None, qk=None, fold=None):
    """Stage scan of the backward; returns dh, dWq, dWk, dWv, dWo, d(q_norm, k_norm) (this device's partial
    weight gradients; dWo None without `wo`, the last None without `qk`). `pos`, `seg`, `fold` as for
    `_forward`; dh is the gradient of the attention's input h (h = x, or RMSNorm(x) with `fold`, never formed:
    `_linear`, `_weight_grad`; the caller pulls dh back through the norm).

    With `qk` (the q/k RMSNorm scales `[d]`, Qwen3) each recomputed projection's `rope(norm(y))` is a
    `jax.vjp` of the projection y `[b, S/C, n, d]`, whose pullback gives dY (and the norm scale's gradient);
    dY then gives dh and the weight rows as without `qk`.

    `dout` is the gradient of the output `[b, S/C, H, d]`, or with `wo` (W_o `[H, d, hidden]`) that of
    `out @ W_o`, `[b, S/C, hidden]`, from which each stage forms its own slice (`_stage_output`).

    The recomputed projections use weight slices times a 1 that XLA cannot fold and that depends on the forward's
    lse: otherwise, with a single stage, XLA merges them with the forward's projections (its CPU pipeline runs CSE
    again after expanding optimization barriers) or schedules them in the forward, and Q, K, V stay alive."""
    cos, sin = _rope_tables(x, pos, wq.shape[-1], opts)
    f32 = jnp.float32
    # Sequence-sized accumulators (dx `[b, S/C, hidden]`, dK/dV `[b, S, kc, d]`) are kept in the activation
    # dtype; each stage's contribution is a matmul or kernel output with float32 accumulation inside, rounded
    # once, and the running sum is added in float32 and rounded again. In bf16 this is what autodiff of the
    # Ulysses path does (its gradients are bf16 tensors), and a float32 accumulator of `[S/C, hidden]` would
    # be the largest buffer of the backward (twice the bf16 layer input). Weight gradients stay float32.
    acc = x.dtype
    eps = opts["eps"]

    def rope_norm(y, scale):  # rope(norm(y)) of a projection y, differentiated with jax.vjp
        return _rope(L.rms_norm(y, scale, eps), cos, sin)

    # dx gathers one `[b, S/C, hidden]` product per stage and per KV group: added block by block in place
    # (`accumulate_product`), in as many row blocks as there are stages, so a block is the size of one stage's
    # projection `[b, S/C, U, d]` (when hidden = H*d) and no full-width product exists beside dx.
    tiles = math.gcd(x.shape[1], sch.stages)

    def pull(dx, w_, dy):  # dY of a projection y = h @ w_ -> (dx + its dh term, its weight gradient)
        return accumulate_product(dx, dy, w_, tiles), _weight_grad(x, dy, fold)

    def group(carry, xs):
        dx, dwq, dwk, dwv, dwo, dqk = carry
        t, lse_t = xs
        one = opaque_one(lse, wk.dtype, _all_axes())
        wk_t, wv_t = _kv_weight(wk, t, sch) * one, _kv_weight(wv, t, sch) * one
        if qk is None:
            k = _seq_to_heads(_project(x, wk_t, cos, sin, True, fold=fold))
        else:
            k_loc, k_vjp = jax.vjp(rope_norm, _linear(x, wk_t, fold), qk[1])
            k = _seq_to_heads(k_loc)
        v = _seq_to_heads(_project(x, wv_t, cos, sin, False, fold=fold))

        def stage(carry, xs):
            dx, dwq, dwo, dk_acc, dv_acc, dqk, k, v = carry
            u, lse_s = xs
            wq_s = _stage_get(wq, t, u, 1, sch) * one
            if qk is None:
                q = _seq_to_heads(_project(x, wq_s, cos, sin, True, fold=fold))
            else:
                q_loc, q_vjp = jax.vjp(rope_norm, _linear(x, wq_s, fold), qk[0])
                q = _seq_to_heads(q_loc)
            o_s, do_s, dwo = _stage_output(out, dout, wo, dwo, (t, u), sch, one, opts)
            o, do, q = _seq_to_heads(o_s), _seq_to_heads(do_s), _q_scaled(q, opts)
            if wo is not None:  # dW_o's rows first: the stage's output slice then dies before the attention backward
                o, do, dwo = jax.lax.optimization_barrier((o, do, dwo))
            dq, dk_acc, dv_acc, k, v = _attention_bwd(q, k, v, o, lse_s, do, (dk_acc, dv_acc), opts["kernel"], seg,
                                                      opts.get("runs", False))
            dq = _q_scaled(dq, opts)  # the scale's transpose: dq of the unscaled queries
            if qk is None:
                dq = _rope(_heads_to_seq(dq), cos, -sin)  # transpose of the rotation
            else:  # through RoPE and the q norm
                dq, dqn = q_vjp(_heads_to_seq(dq).astype(q_loc.dtype))
                dqk = (dqk[0] + dqn.astype(f32), dqk[1])
            dx, dwq_s = pull(dx, wq_s, dq)
            dwq = _stage_set(dwq, dwq_s, t, u, 1, sch)
            return (dx, dwq, dwo, dk_acc, dv_acc, dqk, k, v), None

        zeros_kv = zeros_after(k, k.shape, acc, _all_axes())
        (dx, dwq, dwo, dk, dv, dqk, _, _), _ = jax.lax.scan(
            stage, (dx, dwq, dwo, zeros_kv, zeros_kv, dqk, k, v), (jnp.arange(sch.stages_per_group), lse_t)
        )
        dv = _heads_to_seq(dv.astype(x.dtype))
        if qk is None:
            dk = _rope(_heads_to_seq(dk.astype(x.dtype)), cos, -sin)
        else:  # through RoPE and the k norm
            dk, dkn = k_vjp(_heads_to_seq(dk.astype(x.dtype)).astype(k_loc.dtype))
            dqk = (dqk[0], dqk[1] + dkn.astype(f32))
        dkv = jnp.concatenate([dk.astype(dv.dtype), dv], axis=2)  # one [S/C, hidden] product for both
        dx, dwkv = pull(dx, jnp.concatenate([wk_t, wv_t], axis=1), dkv)
        dwk, dwv = _place_kv_grads(dwk, dwv, dwkv, t, sch)
        return (dx, dwq, dwk, dwv, dwo, dqk), None

    init = (zeros_after(dout, x.shape, acc, _all_axes()),
            *jax.tree.map(lambda a: zeros_after(dout, a.shape, f32, _all_axes()), (wq, wk, wv, wo, qk)))
    (dx, dwq, dwk, dwv, dwo, dqk), _ = jax.lax.scan(group, init, (jnp.arange(sch.groups), lse))
    dwo = None if wo is None else dwo.astype(wo.dtype)
    dqk = None if qk is None else tuple(g.astype(s.dtype) for g, s in zip(dqk, qk))
    return dx.astype(x.dtype), dwq.astype(wq.dtype), dwk.astype(wk.dtype), dwv.astype(wv.dtype), dwo, dqk


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _upipe_local(x, wq, wk, wv, qk, pos, seg, sch, opts):
    return _forward(x, wq, wk, wv, pos, seg, sch, opts, qk)[0]


def _upipe_local_fwd(x, wq, wk, wv, qk, pos, seg, sch, opts):
    out, lse = _forward(x, wq, wk, wv, pos, seg, sch, opts, qk)
    out, lse = keep_attention_residuals(out, lse)  # `remat.keep_attention` may keep them
    return out, (x, wq, wk, wv, qk, pos, seg, out, lse)


def _upipe_local_bwd(sch, opts, res, dout):
    # The barrier marks the recomputation as distinct from the forward for passes that respect it (see also
    # `opaque_one`, which the CPU pipeline needs because it runs CSE again after expanding barriers).
    x, wq, wk, wv, qk, pos, seg, out, lse = jax.lax.optimization_barrier(res)
    dx, dwq, dwk, dwv, _, dqk = _backward(x, wq, wk, wv, pos, seg, out, lse, dout, sch, opts, qk=qk)
    return dx, dwq, dwk, dwv, dqk, None, None


_upipe_local.defvjp(_upipe_local_fwd, _upipe_local_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _upipe_norm_local(x, scale, wq, wk, wv, wo, qk, post, pos, seg, sch, opts):
    """U-Pipe on `rms_norm(x, scale)`, with the norm inside the op (see `upipe_attention`); with `wo` (not None)
    the attention sublayer's output `x + out @ W_o` (`x + post_norm(out @ W_o)` with `post`, Gemma 3's
    post-attention norm scale) instead of `out`; `qk`: None or the q/k norm scales; `pos`, `seg`: RoPE positions
    and segment ids (or None)."""
    return _upipe_norm_local_fwd(x, scale, wq, wk, wv, wo, qk, post, pos, seg, sch, opts)[0]


def _out_proj(out, wo, post, eps: float, dtype):
    """`out @ W_o` `[b, S/C, hidden]`, through the post-attention norm when `post` is a scale."""
    z = jnp.einsum("bsnd,ndh->bsh", out, wo).astype(dtype)
    return z if post is None else L.rms_norm(z, post, eps)


def _upipe_norm_local_fwd(x, scale, wq, wk, wv, wo, qk, post, pos, seg, sch, opts):
    r = L.inv_rms(x, opts["eps"])  # the norm itself is folded into the projections
    out, lse = _forward(x, wq, wk, wv, pos, seg, sch, opts, qk, fold=(r, scale))
    # Tagged for `remat.keep_attention`: a layer that keeps them finds the output buffer and lse where the policy
    # kept them, and its recomputation skips the stages' attention (y is then formed from the kept buffer).
    out, lse = keep_attention_residuals(out, lse)
    y = out if wo is None else x + _out_proj(out, wo, post, opts["eps"], x.dtype)
    if opts["offload_output"]:  # kept in pinned host memory until the backward's stages fetch their slices
        out = jax.device_put(out, jax.memory.Space.Host)
    return y, (x, scale, r, wq, wk, wv, wo, qk, post, pos, seg, out, lse)  # the layer input x, not the normalized h


def _upipe_norm_local_bwd(sch, opts, res, dy):
    x, scale, r, wq, wk, wv, wo, qk, post, pos, seg, out, lse = jax.lax.optimization_barrier(res)
    d_post, dz = None, dy
    if post is not None:  # through the post-attention norm: out @ W_o recomputed from the saved buffer
        whole = jax.device_put(out, jax.memory.Space.Device) if opts["offload_output"] else out
        z = _out_proj(whole, wo, None, opts["eps"], x.dtype)
        _, pull = jax.vjp(lambda z, p: L.rms_norm(z, p, opts["eps"]), z, post)
        dz, d_post = pull(dy)
    # The norm stays folded into the recomputed projections (no normalized `[b, S/C, hidden]` copy of x); the
    # opaque 1 keeps the compiler from reusing the forward's folded weights and products instead.
    fold = (r, scale.astype(jnp.float32) * opaque_one(dy, jnp.float32, _all_axes()))
    dh, dwq, dwk, dwv, dwo, dqk = _backward(x, wq, wk, wv, pos, seg, out, lse, dz, sch, opts, wo=wo, qk=qk,
                                            fold=fold)
    dx, d_scale = L.rms_norm_bwd(opts["eps"], (x, scale, r), dh)
    if wo is not None:  # the residual connection
        dx = (dy.astype(jnp.float32) + dx.astype(jnp.float32)).astype(x.dtype)
    return dx, d_scale, dwq, dwk, dwv, dwo, dqk, d_post, None, None


_upipe_norm_local.defvjp(_upipe_norm_local_fwd, _upipe_norm_local_bwd)


class _Opts(dict):
    """Hashable static options (nondiff_argnums must be hashable)."""

    def __hash__(self):
        return hash(repr(sorted(self.items())))


def _options(x, w: SublayerWeights, ctx: SublayerContext, segment_ids, ids_are_runs: bool) -> _Opts:
    """The op's static options from the layer's record: the kernel (resolved for the mesh's devices under ring,
    compile-only GPUs included), RoPE, the norms' epsilon, the query scale, offload."""
    ring = axis_size(ctx.mesh, RING_AXIS)
    backend = ctx.backend
    if ring > 1:
        probe = jax.ShapeDtypeStruct((w.wq.shape[2],), x.dtype)
        backend = resolve_backend(backend, probe, segment_ids, platform=ctx.mesh.devices.flat[0].platform)
    kernel = _Opts(backend=backend, causal=True, block_q=ctx.block_q, block_k=ctx.block_k, window=int(ctx.window))
    scaling = ctx.rope_scaling
    scaling = None if scaling is None or scaling.type == "none" else scaling
    return _Opts(theta=float(ctx.rope_theta), kernel=kernel, eps=float(ctx.norm_eps), scaling=scaling,
                 runs=bool(ids_are_runs and ring > 1), q_scale=float(ctx.query_scale),
                 offload_output=bool(ctx.offload_attention_output and w.wo is not None))


def _check_weights(x, w: SublayerWeights) -> None:
    if w.norm is None and (w.wo is not None or w.post_norm is not None):
        raise ValueError("upipe_attention: W_o (and a post-attention norm) need the attention norm's scale: the op "
                         "then computes x + W_o attention(RMSNorm(x)); give SublayerWeights.norm, or neither")
    want = (w.wq.shape[1], w.wq.shape[2], x.shape[-1])
    if w.wo is not None and tuple(w.wo.shape) != want:
        raise ValueError(f"upipe_attention: wo has shape {tuple(w.wo.shape)}; W_o must be [heads, head_dim, hidden] "
                         f"= {list(want)}")


def upipe_attention(x: jax.Array, w: SublayerWeights, ctx: SublayerContext, *, positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, ids_are_runs: bool = False) -> jax.Array:
    """Head-chunked Ulysses attention from the layer input (projection, RoPE, all-to-alls, attention).

    Args:
      x: layer input `[batch, seq, hidden]`, global; batch over data x fsdp, seq over ring x context (zigzag
        layout when ring > 1). Normalized already, unless `w.norm` is given.
      w: the layer's weights, gathered (replicated) in the compute dtype: wq `[hidden, heads, head_dim]`; wk, wv
        `[hidden, kv_heads, head_dim]`. With `w.norm` (the attention RMSNorm's scale `[hidden]`) x is normalized
        inside the op, folded into the projections (module docstring: fused attention sublayer). With `w.wo`
        (`[heads, head_dim, hidden]`, needs `w.norm`) the op returns the whole sublayer with its residual,
        `x + W_o attention(RMSNorm(x))` (`x + post_norm(...)` with `w.post_norm`, Gemma 3), and no
        `[b, S/C, H, d]` output gradient is ever live. `w.qk_norm`: Qwen3's and Gemma 3's q/k RMSNorm scales
        `[head_dim]`, applied per stage before RoPE.
      ctx: the layer's attention record: U = `ctx.heads_per_stage` (0: the context degree C; a multiple of C
        dividing heads), RoPE (`rope_theta`, `rope_scaling`, global token indices unless `positions`), the kernel
        (`backend`, `block_q`, `block_k`; under ring, `auto` is resolved for the mesh's devices and runs ring
        attention's blocks), `norm_eps`, `query_scale`, a local layer's `window` (whole sequences per head group
        through the window kernel; under ring the halo exchange, `jaxlong.parallel.halo`), and
        `offload_attention_output`: with `w.wo`, keep the output buffer `[batch, seq, heads, head_dim]` (the
        residual the backward needs) in pinned host memory from the forward to the backward, which brings back one
        stage's slice at a time (`remat.policy=offload`; ALST, arXiv 2506.13996, §3.4 offloads checkpoints the
        same way).
      positions: int32 `[batch, seq]` RoPE positions (per-document positions of packed documents), sharded like
        the tokens; None: global token indices.
      segment_ids: int32 `[batch, seq]` (0 = padding) or None: document masking. Every device attends over the
        whole sequence, so they enter whole (`jaxlong.parallel.ulysses.gather_segment_ids`: gathered once per step,
        outside the layer scan) and every stage's kernel reuses them; with mesh.ring > 1 in the zigzag layout like
        x, and each ring step slices its K/V block's ids from them (nothing extra is communicated).
      ids_are_runs: with mesh.ring > 1, `segment_ids` are already run ids (`gather_segment_ids` makes them once
        per step); otherwise every stage's ring computes them.

    Returns:
      attention output before W_o, `[batch, seq, heads, head_dim]` in natural head order, sharded like x;
      with `w.wo`, the sublayer output `[batch, seq, hidden]`.

    Raises:
      ValueError: `w.wo` or `w.post_norm` without `w.norm`, or `w.wo` not of shape `[heads, head_dim, hidden]`.
      ConfigError: U not a multiple of C or not dividing H, heads/KV heads not splittable over C, or
        U/C and H/max(H_kv, C) not dividing one another.
    """
    mesh = ctx.mesh
    sch = Schedule(w.wq.shape[1], w.wk.shape[1], mesh.shape[CONTEXT_AXIS],
                   ctx.heads_per_stage or mesh.shape[CONTEXT_AXIS])
    sch.validate()
    _check_weights(x, w)
    opts = _options(x, w, ctx, segment_ids, ids_are_runs)
    act, rep, tok = P(BATCH_AXES, seq_axes(mesh), None), P(), P(BATCH_AXES, seq_axes(mesh))
    out_spec = act if w.wo is not None else P(BATCH_AXES, seq_axes(mesh), None, None)
    # Weights enter replicated (unvarying); marking them varying makes the shard_map transpose sum the per-device
    # weight gradients (psum), so the custom backward must not sum them itself.
    weights = (w.norm, w.wq, w.wk, w.wv, w.wo, w.qk_norm, w.post_norm)  # None where absent
    extra = [None if a is None else a.astype(jnp.int32) for a in (positions, segment_ids)]
    specs = (act, jax.tree.map(lambda _: rep, weights), None if positions is None else tok,
             None if segment_ids is None else P(BATCH_AXES, None))

    def local(x, weights, pos, seg):
        scale, wq, wk, wv, wo, qk, post = jax.tree.map(_varying, weights)
        if scale is None:
            return _upipe_local(x, wq, wk, wv, qk, pos, seg, sch, opts)
        return _upipe_norm_local(x, scale, wq, wk, wv, wo, qk, post, pos, seg, sch, opts)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=True)(x, weights, *extra)


def sublayer(x: jax.Array, w: SublayerWeights, positions: jax.Array, segment_ids: jax.Array | None,
             ctx: SublayerContext) -> jax.Array:
    """The attention sublayer run by U-Pipe as one op: RMSNorm, the head stages, W_o (and Gemma 3's post-attention
    norm) and the residual (`upipe_attention` with `w.norm` and `w.wo`), U = `attention.heads_per_stage` (0: C).

    Args and returns as `jaxlong.parallel.ulysses.sublayer` (`w`: `SublayerWeights`, its matrices gathered here).
    The tensors named `attn_norm_out`, `query_proj`, `key_proj`, `value_proj` and `attn_out` do not exist on
    this path: the op saves only the layer input and its output buffer. A local layer whose window meets its K/V by
    the halo exchange over `context` (`SublayerContext.window_exchange`, ring = 1) has no all-to-all to stage: it
    runs the Ulysses sublayer's halo path, every head of its tokens at once.
    """
    mesh = ctx.mesh
    if axis_size(mesh, RING_AXIS) == 1 and halo_over_context(
            ctx.window_exchange, ctx.window, x.shape[1], mesh.shape[CONTEXT_AXIS], w.wq.shape[1], w.wk.shape[1],
            w.wq.shape[2], ctx.block_q, ctx.block_k):
        return ulysses.sublayer(x, w, positions, segment_ids, ctx)
    gathered = dataclasses.replace(w, wq=ctx.gather(w.wq), wk=ctx.gather(w.wk), wv=ctx.gather(w.wv),
                                   wo=ctx.gather(w.wo))
    return upipe_attention(x, gathered, ctx, positions=positions, segment_ids=segment_ids,
                           ids_are_runs=axis_size(ctx.mesh, RING_AXIS) > 1)


def attention_layer(impl: str, mesh: jax.sharding.Mesh, *, heads_per_stage: int | None = None,
                    rope_theta: float = 500000.0, backend: str = "auto", block_q: int = 512, block_k: int = 512):
    """One attention layer from its normalized input, as `jaxlong.models.llama` runs it: `(x, wq, wk, wv) -> out`
    `[b, S, H, d]` before W_o. `impl`: "upipe" (`upipe_attention`) or "ulysses" (project all heads, RoPE with
    global positions, `ulysses_attention`). For memory and speed comparisons of the two (tests, sweeps)."""
    kernel = dict(backend=backend, block_q=block_q, block_k=block_k)
    if impl == "upipe":
        ctx = SublayerContext(mesh, impl="upipe", heads_per_stage=heads_per_stage or 0, rope_theta=rope_theta,
                              **kernel)
        return lambda x, wq, wk, wv: upipe_attention(x, SublayerWeights(None, wq, wk, wv), ctx)
    if impl != "ulysses":
        raise ValueError(f"impl must be 'upipe' or 'ulysses', got {impl!r}")
    spec = jax.sharding.NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS, None, None))

    def layer(x, wq, wk, wv):
        pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        cos, sin = L.rope_tables(pos, wq.shape[-1], rope_theta)
        q = L.apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wq), cos, sin)
        k = L.apply_rope(jnp.einsum("bsh,hnd->bsnd", x, wk), cos, sin)
        v = jnp.einsum("bsh,hnd->bsnd", x, wv)
        q, k, v = (jax.lax.with_sharding_constraint(t, spec) for t in (q, k, v))
        return ulysses_attention(q, k, v, mesh=mesh, **kernel)

    return layer


def check_upipe_schedule(heads: int, kv_heads: int, context: int, heads_per_stage: int) -> None:
    """U-Pipe's stage schedule exists (`jaxlong.parallel.upipe.Schedule`, Untied Ulysses §3.3 with GQA).

    Raises:
      ConfigError: heads/KV heads not splittable over `context` (`check_heads`); `heads_per_stage` (U) not a
        positive multiple of `context` dividing `heads`; or the per-device query heads per stage U/C and the
        query heads per effective KV head H/max(H_kv, C) not dividing one another.
    """
    check_heads(heads, kv_heads, context)
    g = heads // max(kv_heads, context)

    def fits_gqa(m: int) -> bool:
        return m % g == 0 or g % m == 0

    u = heads_per_stage
    at = dict(key="attention.heads_per_stage", value=u, keys=("mesh.context",))
    if u <= 0 or u % context or heads % u:
        raise ConfigError(
            f"attention.heads_per_stage={u} must be a multiple of mesh.context={context} and divide "
            f"model.heads={heads}", **at)
    if not fits_gqa(u // context):
        raise ConfigError(
            f"attention.heads_per_stage={u}: per-device query heads per stage U/C={u // context} and query heads "
            f"per KV head {g} must divide one another", **at)


def check_upipe_remat_names(names: list[str]) -> None:
    """U-Pipe computes the attention sublayer's tensors inside its op and saves only the layer input and its
    output buffer, so `remat.save` / `remat.offload` (`remat.policy=custom`) cannot name them.

    Raises:
      ConfigError: `names` holds one of `jaxlong.layers.remat.ATTENTION_NAMES`.
    """
    inside = sorted(set(names) & set(ATTENTION_NAMES))
    if inside:
        raise ConfigError(
            f"remat.save/remat.offload name {inside}, which attention.impl=upipe computes inside its op (it "
            f"saves only the layer input and the attention output buffer; drop those names)",
            key="attention.impl", value="upipe")
