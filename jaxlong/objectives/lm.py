"""Language modelling: next-token cross-entropy over the targets the batch's mask counts (`objective: lm`).

It covers pretraining, context extension and SFT on chat data, whose batches mask all but the assistant's tokens
(`jaxlong.data.chat_data`). The loss is the mean over the counted targets of the whole accumulated batch: sums over
micro-batches divided once by the batch's count, so micro-batches of unequal counts weigh each token alike. With a
data mixture (`data.sources`) the training batches carry each token's source (`source`, index + 1, 0 on padding) and
the step also reports each source's mean loss over its counted targets (`source_loss`, `source_tokens_trained`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlong.core.errors import ConfigError
from jaxlong.data.mixture import SOURCE_FEATURE
from jaxlong.layers.loss import IGNORE_INDEX, effective_mask
from jaxlong.objectives.base import Objective, loss_sum, token_losses

__all__ = ["LanguageModeling"]


class LanguageModeling(Objective):
    """Next-token cross-entropy (nats per counted target).

    Args:
      sources: the data mixture's source count (`len(data.sources)`); > 0 adds each source's loss to the metrics.
    """

    name = "lm"

    def __init__(self, sources: int = 0):
        self.sources = sources

    @classmethod
    def from_config(cls, cfg) -> LanguageModeling:
        return cls(len(cfg.data.sources))

    def check(self, data) -> None:
        """No preference pairs: they are `objective: dpo`'s.

        Raises:
          ConfigError: `data.format` (or a source's) is `preference`.
        """
        formats = [data.format] if not data.sources else [s.format or data.format for s in data.sources]
        if "preference" in formats:
            where = "data.format" if not data.sources else "a source's format"
            raise ConfigError(f"{where}=preference is preference pairs, for objective=dpo", key="objective",
                              value=self.name)

    def denominator(self, batch: dict, mesh) -> jax.Array:
        return jnp.sum(effective_mask(batch["targets"], batch["mask"]))

    def sum_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"source_loss": (self.sources,)} if self.sources else {}

    def sums(self, params: dict, batch: dict, graphdef, rt) -> tuple[jax.Array, dict]:
        if not self.sources or SOURCE_FEATURE not in batch:  # validation batches: the first source's
            return loss_sum(params, batch, graphdef, rt), {}
        counted = effective_mask(batch["targets"], batch["mask"])
        losses = token_losses(params, batch, graphdef, rt) * counted
        return jnp.sum(losses), {"source_loss": self._by_source(jax.lax.stop_gradient(losses), batch)}

    def _by_source(self, values: jax.Array, batch: dict) -> jax.Array:
        onehot = (batch[SOURCE_FEATURE][..., None] == jnp.arange(1, self.sources + 1)).astype(jnp.float32)
        return jnp.einsum("bs,bsk->k", values, onehot)

    def metrics(self, sums: dict, denominator: jax.Array, batch: dict) -> dict:
        if not self.sources or SOURCE_FEATURE not in batch:
            return {}
        counts = self._by_source(effective_mask(batch["targets"], batch["mask"]), batch)
        return {"source_loss": jnp.where(counts > 0, sums["source_loss"] / jnp.maximum(counts, 1.0), jnp.nan),
                "source_tokens_trained": counts}

    def host_denominator(self, batch: dict) -> float:
        """The counted targets in float64: the step's float32 count rounds once a sum passes 2^24 tokens
        (docs/numerics.md)."""
        mask = np.where(np.asarray(batch["targets"]) == IGNORE_INDEX, 0.0, np.asarray(batch["mask"], np.float64))
        return float(np.sum(mask))

    def summary(self, loss_sum: float, sums: dict, denominator: float) -> dict:
        loss = loss_sum / max(denominator, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": denominator}

    def describe(self, ev: dict) -> str:
        return f"{ev['loss']:.4f} (perplexity {ev['perplexity']:.2f}, {ev['tokens']:.0f} held-out tokens)"
