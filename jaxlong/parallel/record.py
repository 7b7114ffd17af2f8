"""The records an attention sublayer takes: its weights (`SublayerWeights`) and how it runs (`SublayerContext`, one
per kind of layer: the method, the kernel and its tiles, RoPE, a local layer's window, the query scale, U-Pipe's
heads per stage and offload). Every context-parallel method (`jaxlong.parallel.ulysses`, `upipe`, `ring`, `halo`)
reads these two and nothing else of the model; `jaxlong.models.llama.Runtime.attention_context` builds the context
from the run's config (docs/architecture.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["SublayerWeights", "SublayerContext"]


@dataclasses.dataclass(frozen=True)
class SublayerWeights:
    """The attention sublayer's weights as the decoder layer holds them (FSDP-sharded, `param_dtype`); each
    method gathers them in the compute dtype where it uses them.

    Attributes:
      norm: the attention RMSNorm's scale `[hidden]`, or None where the input is normalized already (U-Pipe's
        unfused op, `jaxlong.parallel.upipe.upipe_attention`).
      wq: `[hidden, heads, head_dim]`; wk, wv: `[hidden, kv_heads, head_dim]`; wo: `[heads, head_dim, hidden]`, or
        None for the attention output before W_o (U-Pipe's unfused op).
      qk_norm: the (q_norm, k_norm) RMSNorm scales `[head_dim]` (Qwen3, Gemma 3), or None.
      post_norm: the post-attention RMSNorm's scale `[hidden]` (Gemma 3's sandwich norms: `x + post_norm(W_o
        attention)`), or None.
    The norms' scales are as the norm multiplies by them (Gemma's `1 + w` already added).
    """

    norm: jax.Array | None
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array | None = None
    qk_norm: tuple[jax.Array, jax.Array] | None = None
    post_norm: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SublayerContext:
    """Everything an attention sublayer reads besides its inputs and weights: static (not traced), typed, built
    once per kind of layer from the run's config (`jaxlong.models.llama.Runtime.attention_context`); the defaults
    are a float32 global layer on the blockwise-or-better kernel (`auto`), for ops called directly.

    Attributes:
      mesh: the `data x fsdp x ring x context` mesh.
      impl: `attention.impl`, the method (`jaxlong.parallel.dispatch.METHODS`).
      backend: the attention kernel (`jaxlong.kernels.backend`; resolved for the mesh's devices under ring).
      block_q, block_k: the blockwise kernel's tiles (`attention.block_q`, `attention.block_k`).
      heads_per_stage: U-Pipe's U (`attention.heads_per_stage`; 0: mesh.context).
      head_dim, rope_theta, rope_scaling, norm_eps: the model's (`model.*`; `rope_scaling` a
        `jaxlong.layers.blocks.RopeScalingConfig` or None), for this kind of layer.
      compute_dtype: matmuls and activations (`compute_dtype`).
      recompute_projection: the layer is recomputed in its backward anyway (`remat.policy` full or offload), so
        the Ulysses path also checkpoints its q/k/v projection.
      offload_attention_output: U-Pipe keeps its output buffer (the attention output before W_o, the op's
        saved residual) in pinned host memory until its backward (`remat.policy=offload`).
      window: 0 for a global layer; a local layer's sliding window in positions (a query sees itself and the
        window - 1 before it; `jaxlong.kernels.blockwise`).
      query_scale: multiplies the queries after RoPE, so that the kernels' `1/sqrt(head_dim)` makes the scale
        `1/sqrt(model.query_pre_attn_scalar)` (Gemma 3); 1 otherwise.
      window_exchange: how a local layer meets its window over `context` (`attention.window_exchange`): `all_to_all`
        (Ulysses: whole sequences per head group through the window kernel), `halo` (each device keeps its tokens'
        heads and receives the window's K/V from the devices before it, `jaxlong.parallel.halo`), or `auto` (the
        fewer bytes for the layer's shapes, `jaxlong.parallel.halo.exchange_bytes`).
    """

    mesh: jax.sharding.Mesh
    impl: str = "ulysses"
    backend: str = "auto"
    block_q: int = 512
    block_k: int = 512
    heads_per_stage: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: object = None
    norm_eps: float = 1e-5
    compute_dtype: jnp.dtype = jnp.float32
    recompute_projection: bool = False
    offload_attention_output: bool = False
    window: int = 0
    query_scale: float = 1.0
    window_exchange: str = "auto"

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """`x` with the sharding `spec` on the mesh (a `with_sharding_constraint`)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def gather(self, w: jax.Array) -> jax.Array:
        """FSDP all-gather of one layer's weight in the compute dtype (cast first: half the bytes moved)."""
        return self.constrain(w.astype(self.compute_dtype), P())
