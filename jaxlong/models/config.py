"""The model section of the config (`model.*`): the architecture's shapes and settings, and their checks.

Llama-3 / Qwen3 decoders (`jaxlong.models.llama`); `model.from_hf` fills the section from a Hugging Face
checkpoint's `config.json` (`jaxlong.models.hf_config`, read by `jaxlong.config.load_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.layers.blocks import RopeScalingConfig, check_rope
from jaxlong.models.family import FAMILIES, FamilyName

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
    family: FamilyName = "llama"  # the decoder layer's parts (`jaxlong.models.family`): llama, gemma3
    sliding_window: int = 0  # local layers' window W in positions (a query sees itself and W - 1 before); 0: none
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention or sliding_attention
    sliding_window_pattern: int = 6  # without layer_types: every n-th layer global, the others local
    rope_local_theta: float = 10000.0  # local layers' RoPE base (no scaling)
    query_pre_attn_scalar: float = 0.0  # attention scale 1/sqrt(this); 0: head_dim


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
    check_choice("model.family", m.family, FamilyName)
    _check_windows(m)


def _check_windows(m: ModelConfig) -> None:
    """The sliding-window keys: a family that has windows, a window >= 0, a pattern >= 1, one layer type per layer
    (each `full_attention` or `sliding_attention`), positive RoPE base and attention scalar."""
    if m.sliding_window < 0:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be >= 0 (0: every layer global)",
                          key="model.sliding_window", value=m.sliding_window)
    if m.sliding_window and not FAMILIES[m.family].windows:
        raise ConfigError(f"model.sliding_window={m.sliding_window}: model.family={m.family} has no sliding-window "
                          f"layers; give model.family=gemma3 or model.sliding_window=0", key="model.sliding_window",
                          value=m.sliding_window, keys=("model.family",))
    if m.sliding_window_pattern < 1:
        raise ConfigError(f"model.sliding_window_pattern={m.sliding_window_pattern} must be >= 1 (every n-th layer "
                          f"global)", key="model.sliding_window_pattern", value=m.sliding_window_pattern)
    if m.layer_types:
        bad = sorted({t for t in m.layer_types if t not in ("full_attention", "sliding_attention")})
        if bad or len(m.layer_types) != m.layers:
            raise ConfigError(f"model.layer_types: give model.layers={m.layers} entries, each full_attention or "
                              f"sliding_attention (got {len(m.layer_types)}{', with ' + str(bad) if bad else ''})",
                              key="model.layer_types", value=m.layer_types)
    if not m.rope_local_theta > 0:
        raise ConfigError(f"model.rope_local_theta={m.rope_local_theta} must be positive")
    if m.query_pre_attn_scalar < 0:
        raise ConfigError(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} must be positive (0: head_dim)")
