"""The model section of the config (`model.*`): the architecture's shapes and settings, and their checks.

Llama-3 / Qwen3 decoders (`jaxlong.models.llama`); `model.from_hf` fills the section from a Hugging Face
checkpoint's `config.json` (`jaxlong.models.hf_config`, read by `jaxlong.config.load_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxlong.core.errors import ConfigError
from jaxlong.layers.blocks import RopeScalingConfig, check_rope

__all__ = ["ModelConfig", "RopeScalingConfig", "check_model"]


@dataclass
class ModelConfig:
    """Llama-3 / Qwen3 architecture shapes (grouped-query attention, SwiGLU MLP, RMSNorm, RoPE; Qwen3 adds
    `qk_norm`, an RMSNorm over head_dim on every query and key head before RoPE).

    `from_hf`: a local Hugging Face checkpoint directory (`config.json`, `*.safetensors`, `tokenizer.json`);
    the shapes then come from its `config.json` (`jaxlong.models.hf_config`), the weights from its safetensors
    and the tokenizer from its `tokenizer.json`. Model keys set explicitly (e.g. `model.rope_theta`,
    `model.rope_scaling.*` to extend the context) override the checkpoint's values; shape keys must agree.
    """

    name: str = "tiny"
    vocab_size: int = 512  # padded vocabulary; must be >= the tokenizer's
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp_hidden: int = 768
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys before RoPE
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    max_position_embeddings: int = 0  # the checkpoint's trained context (exported as the run's seq_len if larger)
    from_hf: str | None = None  # Hugging Face checkpoint directory to start from


def check_model(m: ModelConfig) -> None:
    """Positive shapes, query heads in whole groups of the KV heads (grouped-query attention), RoPE's base and
    scaling (`jaxlong.layers.blocks.check_rope`), a positive norm epsilon and init scale.

    Raises:
      ConfigError: naming the `model.*` option, its value and what would work.
    """
    for key in ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden", "vocab_size"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be positive", key=f"model.{key}",
                              value=getattr(m, key))
    if m.heads % m.kv_heads:
        raise ConfigError(
            f"model.heads={m.heads} must be a multiple of model.kv_heads={m.kv_heads} (grouped-query attention)",
            key="model.kv_heads", value=m.kv_heads, keys=("model.heads",))
    check_rope(m.rope_theta, m.rope_scaling)
    for key in ("norm_eps", "init_std"):
        if not getattr(m, key) > 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be positive")
