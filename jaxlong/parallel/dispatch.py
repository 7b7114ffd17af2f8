"""The model's one entry into context-parallel attention: `attention_sublayer(x, weights, positions,
segment_ids, rt)` runs the attention sublayer `x + W_o attention(RMSNorm(x))` with the method
`attention.impl` names, on the mesh `data x fsdp x ring x context`.

Methods (`METHODS`), each a module of `jaxlong.parallel` with its algorithm, the validators it calls before
tracing (`jaxlong.config.check_heads`, `check_upipe_schedule`, `check_ring`, run by `jaxlong.config.validate`
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
from typing import Callable

import jax

from jaxlong.parallel import ulysses, upipe


@dataclasses.dataclass(frozen=True)
class SublayerWeights:
    """The attention sublayer's weights as the decoder layer holds them (FSDP-sharded, `param_dtype`); each
    method gathers them in the compute dtype where it uses them.

    Attributes:
      norm: the attention RMSNorm's scale `[hidden]`.
      wq: `[hidden, heads, head_dim]`; wk, wv: `[hidden, kv_heads, head_dim]`; wo: `[heads, head_dim, hidden]`.
      qk_norm: Qwen3's (q_norm, k_norm) RMSNorm scales `[head_dim]`, or None.
    """

    norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    qk_norm: tuple[jax.Array, jax.Array] | None = None


# attention.impl -> the sublayer of that method; every one takes (x, weights, positions, segment_ids, rt).
METHODS: dict[str, Callable[..., jax.Array]] = {"ulysses": ulysses.sublayer, "upipe": upipe.sublayer}


def attention_sublayer(x: jax.Array, weights: SublayerWeights, positions: jax.Array,
                       segment_ids: jax.Array | None, rt) -> jax.Array:
    """The attention sublayer with its residual, by `rt.cfg.attention.impl`.

    Args:
      x: layer input `[batch, seq, hidden]`, batch over data x fsdp, sequence over ring x context (zigzag
        layout when ring > 1).
      weights: `SublayerWeights` of the layer.
      positions: int32 `[batch, seq]` RoPE positions, sharded like x.
      segment_ids: int32 `[batch, seq]` whole on every device (`jaxlong.parallel.ulysses.gather_segment_ids`),
        or None (one causal stream per row); with `mesh.ring` > 1 in the zigzag layout like x.
      rt: the model's `Runtime` (`mesh`, `cfg`, `gather`, `constrain`, `attention_backend`).

    Returns:
      `x + W_o attention(RMSNorm(x))`, `[batch, seq, hidden]`, sharded like x.

    Raises:
      KeyError: `attention.impl` names no method (`jaxlong.config.validate` rejects such configs first).
    """
    return METHODS[rt.cfg.attention.impl](x, weights, positions, segment_ids, rt)
