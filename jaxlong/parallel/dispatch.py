"""The attention section of the config (`attention.*`, `AttentionConfig`) and the model's one entry into
context-parallel attention: `attention_sublayer(x, weights, positions,
segment_ids, ctx)` runs the attention sublayer `x + W_o attention(RMSNorm(x))` with the method
`attention.impl` names, on the mesh `data x fsdp x ring x context`.

Methods (`METHODS`), each a module of `jaxlong.parallel` with its algorithm, the validators it calls before
tracing (`ulysses.check_heads`, `upipe.check_upipe_schedule`, `ring.check_ring`, run by `jaxlong.config.validate`
so a config the mesh cannot run fails before compiling) and, where there is one, its memory model:
  ulysses  `jaxlong.parallel.ulysses.sublayer`: all-to-all over `context` around a single-device kernel
           (DeepSpeed-Ulysses); with `mesh.ring` > 1 the Ulysses x ring hybrid (USP).
  upipe    `jaxlong.parallel.upipe.sublayer`: U-Pipe, head-chunked Ulysses in stages of U heads (Untied
           Ulysses); with `mesh.ring` > 1 each stage runs ring attention over `ring` (U-Pipe x ring).
Ring attention (`jaxlong.parallel.ring`) is the `ring`-axis half of both: with `mesh.context=1` and
`mesh.ring=R` the `ulysses` method is plain ring attention.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.kernels.backend import Backend
from jaxlong.parallel import ulysses, upipe


@dataclasses.dataclass(frozen=True)
class SublayerWeights:
    """The attention sublayer's weights as the decoder layer holds them (FSDP-sharded, `param_dtype`); each
    method gathers them in the compute dtype where it uses them.

    Attributes:
      norm: the attention RMSNorm's scale `[hidden]`.
      wq: `[hidden, heads, head_dim]`; wk, wv: `[hidden, kv_heads, head_dim]`; wo: `[heads, head_dim, hidden]`.
      qk_norm: the (q_norm, k_norm) RMSNorm scales `[head_dim]` (Qwen3, Gemma 3), or None.
      post_norm: the post-attention RMSNorm's scale `[hidden]` (Gemma 3's sandwich norms: `x + post_norm(W_o
        attention)`), or None.
    The norms' scales are as the norm multiplies by them (Gemma's `1 + w` already added).
    """

    norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    qk_norm: tuple[jax.Array, jax.Array] | None = None
    post_norm: jax.Array | None = None


AttentionImpl = Literal["ulysses", "upipe"]  # `attention.impl`
IMPLS = get_args(AttentionImpl)


@dataclasses.dataclass
class AttentionConfig:
    """How attention is parallelized (`impl`) and which kernel runs it (`backend`)."""

    impl: AttentionImpl = "ulysses"  # the context-parallel method (`METHODS`)
    backend: Backend = "auto"  # the kernel (`jaxlong.kernels.backend`)
    block_q: int = 256  # the blockwise kernel's query tile (tokens)
    block_k: int = 256  # its key tile (tokens)
    heads_per_stage: int = 0  # U-Pipe heads per stage U; 0 means U = context degree C


def check_attention(a: AttentionConfig) -> None:
    """The attention section's own rules: a method and a kernel jaxlong has, and `heads_per_stage` >= 0. The rules
    that involve the model, the mesh or the sequence (heads per device, U-Pipe's schedule, the tiles against
    `seq_len`, the kernels' size limits) are `jaxlong.config.validate`'s, which calls each method's validator.

    Raises:
      ConfigError: naming the `attention.*` option, its value and what would work.
    """
    check_choice("attention.impl", a.impl, AttentionImpl)
    check_choice("attention.backend", a.backend, Backend)
    if a.heads_per_stage < 0:
        raise ConfigError(f"attention.heads_per_stage={a.heads_per_stage} must be >= 0 (0: U = mesh.context)",
                          key="attention.heads_per_stage", value=a.heads_per_stage)


@dataclasses.dataclass(frozen=True)
class SublayerContext:
    """Everything an attention sublayer reads besides its inputs and weights: static (not traced), typed, built
    once per model from the run's config (`jaxlong.models.llama.Runtime.sublayer`).

    Attributes:
      mesh: the `data x fsdp x ring x context` mesh.
      impl: `attention.impl`, the method (`METHODS`).
      backend: the attention kernel, resolved (`jaxlong.kernels.backend.resolve_backend`; `blockwise` under ring).
      block_q, block_k: the blockwise kernel's tiles (`attention.block_q`, `attention.block_k`).
      heads_per_stage: U-Pipe's U (`attention.heads_per_stage`; 0: mesh.context).
      head_dim, rope_theta, rope_scaling, norm_eps: the model's (`model.*`; `rope_scaling` a
        `jaxlong.layers.blocks.RopeScalingConfig`).
      compute_dtype: matmuls and activations (`compute_dtype`).
      recompute_projection: the layer is recomputed in its backward anyway (`remat.policy` full or offload), so
        the Ulysses path also checkpoints its q/k/v projection.
      offload_attention_output: U-Pipe keeps its output buffer (the attention output before W_o, the op's
        saved residual) in pinned host memory until its backward (`remat.policy=offload`).
      window: 0 for a global layer; a local layer's sliding window in positions (a query sees itself and the
        window - 1 before it; `jaxlong.kernels.blockwise`).
      query_scale: multiplies the queries after RoPE, so that the kernels' `1/sqrt(head_dim)` makes the scale
        `1/sqrt(model.query_pre_attn_scalar)` (Gemma 3); 1 otherwise.
    """

    mesh: jax.sharding.Mesh
    impl: AttentionImpl
    backend: str
    block_q: int
    block_k: int
    heads_per_stage: int
    head_dim: int
    rope_theta: float
    rope_scaling: object
    norm_eps: float
    compute_dtype: jnp.dtype
    recompute_projection: bool
    offload_attention_output: bool = False
    window: int = 0
    query_scale: float = 1.0

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """`x` with the sharding `spec` on the mesh (a `with_sharding_constraint`)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def gather(self, w: jax.Array) -> jax.Array:
        """FSDP all-gather of one layer's weight in the compute dtype (cast first: half the bytes moved)."""
        return self.constrain(w.astype(self.compute_dtype), P())


# attention.impl -> the sublayer of that method; every one takes (x, weights, positions, segment_ids, ctx).
METHODS: dict[str, Callable[..., jax.Array]] = {"ulysses": ulysses.sublayer, "upipe": upipe.sublayer}


def attention_sublayer(x: jax.Array, weights: SublayerWeights, positions: jax.Array,
                       segment_ids: jax.Array | None, ctx: SublayerContext) -> jax.Array:
    """The attention sublayer with its residual, by `ctx.impl`.

    Args:
      x: layer input `[batch, seq, hidden]`, batch over data x fsdp, sequence over ring x context (zigzag
        layout when ring > 1).
      weights: `SublayerWeights` of the layer.
      positions: int32 `[batch, seq]` RoPE positions, sharded like x.
      segment_ids: int32 `[batch, seq]` whole on every device (`jaxlong.parallel.ulysses.gather_segment_ids`),
        or None (one causal stream per row); with `mesh.ring` > 1 in the zigzag layout like x.
      ctx: the `SublayerContext` (mesh, method, kernel, model settings, weight gather).

    Returns:
      `x + W_o attention(RMSNorm(x))`, `[batch, seq, hidden]`, sharded like x.

    Raises:
      KeyError: `attention.impl` names no method (`jaxlong.config.validate` rejects such configs first).
    """
    return METHODS[ctx.impl](x, weights, positions, segment_ids, ctx)
