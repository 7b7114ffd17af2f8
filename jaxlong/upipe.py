"""U-Pipe: head-chunked Ulysses attention (Untied Ulysses, arXiv 2602.21196, §3.3).

Plain Ulysses projects Q, K, V for all H heads, all-to-alls them and runs attention on H/C heads per device at
once, so every head-sized intermediate is live together. U-Pipe runs the heads in H/U *stages* of U heads
(U = `heads_per_stage`, a multiple of the context degree C): each stage projects only its heads from the
layer input x, applies RoPE with global positions, all-to-alls to `[b, S, U/C, d]`, runs attention, all-to-alls
back and writes its slice into one output buffer allocated before the stages. Only one stage's tensors are
live at a time, so head-proportional memory scales with U/C instead of H/C.

GQA schedule (design brief §3). With H_kv' = max(H_kv, C) effective KV heads (KV heads are replicated
C/H_kv times when H_kv < C) and g = H/H_kv' query heads per effective KV head, each device takes
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
and the weight gradients block by block. Differentiating a plain scan instead would stack every stage's
residuals and give the saving back.

Memory model, per device, one attention layer, b sequences, S tokens, elements of the compute dtype
(f = float32 lse). With m = U/C, kc as above and Ulysses' values in brackets:
  query:     projection `[b, S/C, U, d]` + all-to-all'd `[b, S, m, d]`            [H instead of U, H/C instead of m]
  key/value: 2 x (`[b, S/C, C*kc, d]` + `[b, S, kc, d]`)                          [2 x (H_kv' + H_kv'/C)]
  output:    stage `[b, S, m, d]` + back `[b, S/C, U, d]` + buffer `[b, S/C, H, d]`  [H/C + H, no buffer]
  lse:       `[b, H/C, S]` f32 (all stages)                                        [same]
so query-side bytes shrink by U/H and nothing of size `[S, H/C, d]` is live apart from the output buffer and
its gradient. `experiments/upipe_sweep.py` compares this model with `memory_analysis`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlong import layers as L
from jaxlong.attention.kernels import attention_bwd, attention_fwd_with_lse
from jaxlong.config import ConfigError, check_heads
from jaxlong.mesh import BATCH_AXES, CONTEXT_AXIS
from jaxlong.ulysses import heads_to_seq, seq_to_heads

ALL_AXES = (*BATCH_AXES, CONTEXT_AXIS)


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
        """Raises ConfigError when U, H, H_kv and C do not admit a schedule."""
        check_heads(self.heads, self.kv_heads, self.context)
        u, c, h = self.heads_per_stage, self.context, self.heads
        if u <= 0 or u % c or h % u:
            valid = [v for v in range(c, h + 1, c) if h % v == 0]
            raise ConfigError(
                f"attention.heads_per_stage={u} must be a multiple of mesh.context={c} and divide "
                f"model.heads={h}; valid values: {valid}"
            )
        g = self.group_size
        if self.m % g and g % self.m:
            raise ConfigError(
                f"attention.heads_per_stage={u}: per-device query heads per stage U/C={self.m} and query heads "
                f"per KV head {g} must divide one another"
            )

    def query_heads(self, t: int, u: int, r: int) -> list[int]:
        """Query heads device r computes in stage u of KV group t (for documentation and tests)."""
        base = (t * self.context * self.kc + r * self.kc) * self.group_size + u * self.m
        return list(range(base, base + self.m))


def _positions(batch: int, seq_local: int) -> jax.Array:
    """Global token positions `[batch, S/C]` of this device's sequence shard (inside shard_map)."""
    start = jax.lax.axis_index(CONTEXT_AXIS) * seq_local
    return jnp.broadcast_to(start + jnp.arange(seq_local, dtype=jnp.int32), (batch, seq_local))


def _varying(x: jax.Array) -> jax.Array:
    return jax.lax.pcast(x, ALL_AXES, to="varying")


def _kv_weight(w: jax.Array, t, sch: Schedule) -> jax.Array:
    """KV group t's weight `[D, C*kc, d]` (real heads repeated when H_kv < C)."""
    if sch.kv_rep > 1:
        return jnp.repeat(w, sch.kv_rep, axis=1)  # one group holds all C replicas
    n = sch.context * sch.kc
    return jax.lax.dynamic_slice_in_dim(w, t * n, n, axis=1)


def _q_view(a: jax.Array, sch: Schedule, axis: int) -> jax.Array:
    """View the head axis `axis` of `a` as `[groups, C, stages_per_group, m]`."""
    shape = a.shape[:axis] + (sch.groups, sch.context, sch.stages_per_group, sch.m) + a.shape[axis + 1 :]
    return a.reshape(shape)


def _q_slice(a_view: jax.Array, t, u, axis: int) -> jax.Array:
    """Stage (t, u)'s `[.., C, m, ..]` slice of a head-viewed array, flattened to `[.., U, ..]`."""
    x = jax.lax.dynamic_index_in_dim(a_view, t, axis, keepdims=False)
    x = jax.lax.dynamic_index_in_dim(x, u, axis + 1, keepdims=False)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def _q_write(a_view: jax.Array, val: jax.Array, t, u, axis: int, sch: Schedule) -> jax.Array:
    """Write `[.., U, ..]` `val` into slice (t, u) of the head-viewed array."""
    val = val.reshape(val.shape[:axis] + (1, sch.context, 1, sch.m) + val.shape[axis + 1 :])
    zero = jnp.zeros((), jnp.int32)
    idx = [zero] * a_view.ndim
    idx[axis], idx[axis + 2] = t, u
    return jax.lax.dynamic_update_slice(a_view, val.astype(a_view.dtype), idx)


def _project(x, w, cos, sin, rope: bool):
    y = jnp.einsum("bsh,hnd->bsnd", x, w)
    return L.apply_rope(y, cos, sin) if rope else y


def _forward(x, wq, wk, wv, sch: Schedule, opts: dict):
    """Stage scan. Returns the output `[b, S/C, H, d]` and lse `[groups, stages_per_group, b, m, S]`."""
    b, s_local, _ = x.shape
    d = wq.shape[-1]
    cos, sin = L.rope_tables(_positions(b, s_local), d, opts["theta"])
    wq_v = _q_view(wq, sch, axis=1)
    out = _q_view(_varying(jnp.zeros((b, s_local, sch.heads, d), x.dtype)), sch, axis=2)

    def group(out, t):
        k = seq_to_heads(_project(x, _kv_weight(wk, t, sch), cos, sin, True))
        v = seq_to_heads(_project(x, _kv_weight(wv, t, sch), cos, sin, False))

        def stage(out, u):
            q = seq_to_heads(_project(x, _q_slice(wq_v, t, u, 1), cos, sin, True))
            o, lse = attention_fwd_with_lse(q, k, v, **opts["kernel"])
            return _q_write(out, heads_to_seq(o), t, u, 2, sch), lse

        return jax.lax.scan(stage, out, jnp.arange(sch.stages_per_group))

    out, lse = jax.lax.scan(group, out, jnp.arange(sch.groups))
    return out.reshape(b, s_local, sch.heads, d), lse


def _backward(x, wq, wk, wv, out, lse, dout, sch: Schedule, opts: dict):
    """Stage scan of the backward; returns dx, dWq, dWk, dWv (this device's partial weight gradients)."""
    b, s_local, _ = x.shape
    d = wq.shape[-1]
    cos, sin = L.rope_tables(_positions(b, s_local), d, opts["theta"])
    f32 = jnp.float32
    wq_v = _q_view(wq, sch, axis=1)
    out_v, dout_v = _q_view(out, sch, axis=2), _q_view(dout, sch, axis=2)
    n_kv = sch.context * sch.kc

    def group(carry, xs):
        dx, dwq, dwk, dwv = carry
        t, lse_t = xs
        wk_t, wv_t = _kv_weight(wk, t, sch), _kv_weight(wv, t, sch)
        k = seq_to_heads(_project(x, wk_t, cos, sin, True))
        v = seq_to_heads(_project(x, wv_t, cos, sin, False))

        def stage(carry, xs):
            dx, dwq, dk_acc, dv_acc = carry
            u, lse_s = xs
            wq_s = _q_slice(wq_v, t, u, 1)
            q = seq_to_heads(_project(x, wq_s, cos, sin, True))
            o = seq_to_heads(_q_slice(out_v, t, u, 2))
            do = seq_to_heads(_q_slice(dout_v, t, u, 2))
            dq, dk, dv = attention_bwd(q, k, v, o, lse_s, do, **opts["kernel"])
            dq = L.apply_rope(heads_to_seq(dq), cos, -sin)  # transpose of the rotation
            dx = dx + jnp.einsum("bsnd,hnd->bsh", dq, wq_s, preferred_element_type=f32)
            dwq = _q_write(dwq, jnp.einsum("bsh,bsnd->hnd", x, dq, preferred_element_type=f32), t, u, 1, sch)
            return (dx, dwq, dk_acc + dk.astype(f32), dv_acc + dv.astype(f32)), None

        zeros_kv = jnp.zeros_like(k, dtype=f32)
        (dx, dwq, dk, dv), _ = jax.lax.scan(
            stage, (dx, dwq, zeros_kv, zeros_kv), (jnp.arange(sch.stages_per_group), lse_t)
        )
        dk = L.apply_rope(heads_to_seq(dk.astype(x.dtype)), cos, -sin)
        dv = heads_to_seq(dv.astype(x.dtype))
        dx = dx + jnp.einsum("bsnd,hnd->bsh", dk, wk_t, preferred_element_type=f32)
        dx = dx + jnp.einsum("bsnd,hnd->bsh", dv, wv_t, preferred_element_type=f32)
        dwk_t = jnp.einsum("bsh,bsnd->hnd", x, dk, preferred_element_type=f32)
        dwv_t = jnp.einsum("bsh,bsnd->hnd", x, dv, preferred_element_type=f32)
        if sch.kv_rep > 1:  # replicas' gradients sum into the real KV head
            dwk = dwk + dwk_t.reshape(dwk_t.shape[0], sch.kv_heads, sch.kv_rep, d).sum(2)
            dwv = dwv + dwv_t.reshape(dwv_t.shape[0], sch.kv_heads, sch.kv_rep, d).sum(2)
        else:
            dwk = jax.lax.dynamic_update_slice_in_dim(dwk, dwk_t, t * n_kv, axis=1)
            dwv = jax.lax.dynamic_update_slice_in_dim(dwv, dwv_t, t * n_kv, axis=1)
        return (dx, dwq, dwk, dwv), None

    init = (
        jnp.zeros_like(x, dtype=f32),
        _q_view(jnp.zeros_like(wq, dtype=f32), sch, axis=1),
        jnp.zeros_like(wk, dtype=f32),
        jnp.zeros_like(wv, dtype=f32),
    )
    (dx, dwq, dwk, dwv), _ = jax.lax.scan(group, init, (jnp.arange(sch.groups), lse))
    return dx.astype(x.dtype), dwq.reshape(wq.shape).astype(wq.dtype), dwk.astype(wk.dtype), dwv.astype(wv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _upipe_local(x, wq, wk, wv, sch, opts):
    return _forward(x, wq, wk, wv, sch, opts)[0]


def _upipe_local_fwd(x, wq, wk, wv, sch, opts):
    out, lse = _forward(x, wq, wk, wv, sch, opts)
    return out, (x, wq, wk, wv, out, lse)


def _upipe_local_bwd(sch, opts, res, dout):
    x, wq, wk, wv, out, lse = res
    return _backward(x, wq, wk, wv, out, lse, dout, sch, opts)


_upipe_local.defvjp(_upipe_local_fwd, _upipe_local_bwd)


class _Opts(dict):
    """Hashable static options (nondiff_argnums must be hashable)."""

    def __hash__(self):
        return hash(repr(sorted(self.items())))


def upipe_attention(
    x: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    heads_per_stage: int,
    rope_theta: float,
    backend: str = "auto",
    causal: bool = True,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Head-chunked Ulysses attention from the layer input (projection, RoPE, all-to-alls, attention).

    Args:
      x: normalized layer input `[batch, seq, hidden]`, global; batch over data x fsdp, seq over context.
      wq: `[hidden, heads, head_dim]`; wk, wv: `[hidden, kv_heads, head_dim]` (replicated, i.e. gathered).
      heads_per_stage: U, a multiple of the context degree C that divides `heads`.
      rope_theta: RoPE base; positions are global token indices.
      backend, causal, block_q, block_k: the attention kernel (`jaxlong.attention.kernels`).

    Returns:
      attention output before W_o, `[batch, seq, heads, head_dim]` in natural head order, sharded like x.

    Raises:
      ConfigError: U not a multiple of C or not dividing H, heads/KV heads not splittable over C, or
        U/C and H/max(H_kv, C) not dividing one another.
    """
    sch = Schedule(wq.shape[1], wk.shape[1], mesh.shape[CONTEXT_AXIS], heads_per_stage)
    sch.validate()
    opts = _Opts(theta=float(rope_theta), kernel=_Opts(backend=backend, causal=causal, block_q=block_q, block_k=block_k))
    act, rep = P(BATCH_AXES, CONTEXT_AXIS, None), P()

    def local(x, wq, wk, wv):
        # Weights enter replicated (unvarying); marking them varying makes the shard_map transpose sum the
        # per-device weight gradients (psum), so the custom backward must not sum them itself.
        wq, wk, wv = _varying(wq), _varying(wk), _varying(wv)
        return _upipe_local(x, wq, wk, wv, sch, opts)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(act, rep, rep, rep), out_specs=P(BATCH_AXES, CONTEXT_AXIS, None, None),
        check_vma=True,
    )(x, wq, wk, wv)
