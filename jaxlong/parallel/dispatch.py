"""The attention section of the config (`attention.*`, `AttentionConfig`) and the model's one entry into
context-parallel attention: `attention_sublayer(x, weights, positions, segment_ids, ctx)` runs the attention
sublayer `x + W_o attention(RMSNorm(x))` with the method `attention.impl` names (`METHODS`: `ulysses.sublayer`,
`upipe.sublayer`; each method's module, validators and memory model are listed in `jaxlong.parallel`), on the mesh
`data x fsdp x ring x context`. With `mesh.context=1` and `mesh.ring=R` the `ulysses` method is plain ring
attention (`jaxlong.parallel.ring`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, get_args

import jax

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.kernels.backend import Backend
from jaxlong.parallel import ulysses, upipe
from jaxlong.parallel.record import SublayerContext, SublayerWeights


AttentionImpl = Literal["ulysses", "upipe"]  # `attention.impl`
WindowExchange = Literal["auto", "all_to_all", "halo"]  # `attention.window_exchange`
IMPLS = get_args(AttentionImpl)


@dataclasses.dataclass
class AttentionConfig:
    """How attention is parallelized (`impl`) and which kernel runs it (`backend`)."""

    impl: AttentionImpl = "ulysses"  # the context-parallel method (`METHODS`)
    backend: Backend = "auto"  # the kernel (`jaxlong.kernels.backend`)
    block_q: int = 256  # the blockwise kernel's query tile (tokens)
    block_k: int = 256  # its key tile (tokens)
    heads_per_stage: int = 0  # U-Pipe heads per stage U; 0 means U = context degree C
    window_exchange: WindowExchange = "auto"  # a local layer over `context`: all_to_all, halo or auto (fewer bytes)


def check_attention(a: AttentionConfig) -> None:
    """The attention section's own rules: a method and a kernel jaxlong has, and `heads_per_stage` >= 0. The rules
    that involve the model, the mesh or the sequence (heads per device, U-Pipe's schedule, the tiles against
    `seq_len`, the kernels' size limits) are `jaxlong.config.validate`'s, which calls each method's validator.

    Raises:
      ConfigError: naming the `attention.*` option, its value and what would work.
    """
    check_choice("attention.impl", a.impl, AttentionImpl)
    check_choice("attention.backend", a.backend, Backend)
    check_choice("attention.window_exchange", a.window_exchange, WindowExchange)
    if a.heads_per_stage < 0:
        raise ConfigError(f"attention.heads_per_stage={a.heads_per_stage} must be >= 0 (0: U = mesh.context)",
                          key="attention.heads_per_stage", value=a.heads_per_stage)


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
