"""Hugging Face `config.json` <-> the `model` settings of `jaxlong.config.ModelConfig`, for Llama-3.x
(`model_type: llama`) and Qwen3 (`model_type: qwen3`). Pure Python (no jax): the trainer's CLI builds its config
before any device exists. `model_settings_from_hf` returns plain values (a nested dict of `model.*` keys), which
`jaxlong.config` turns into a `ModelConfig`; this module imports nothing of the config tree.

Every field of `config.json` is either mapped (`MAPPED`), ignorable (`IGNORED`: what transformers'
`PretrainedConfig` writes for every model, 4.x and 5.x: metadata and names starting with "_", token ids, label
maps, output and generation flags, dtype; caching and dropout settings at their inert values) or an error
naming it, so a checkpoint with an architecture variant jaxlong does not implement (biases, sliding windows,
partial rotary, ...) never loads silently wrong.
Both spellings of RoPE settings are read: `rope_theta` + `rope_scaling` (transformers 4.x) and
`rope_parameters` (transformers 5).
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxlong.core.errors import ConfigError

MODEL_TYPES = ("llama", "qwen3")
# config.json field -> ModelConfig field.
MAPPED = {
    "vocab_size": "vocab_size", "hidden_size": "hidden", "num_hidden_layers": "layers",
    "num_attention_heads": "heads", "num_key_value_heads": "kv_heads", "head_dim": "head_dim",
    "intermediate_size": "mlp_hidden", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings", "initializer_range": "init_std",
    "max_position_embeddings": "max_position_embeddings",
}
# Fields that do not change the computation jaxlong does: what transformers' `PretrainedConfig` writes for every
# model (metadata, token ids, label maps, output and generation flags, dtype; 4.x and 5.x), and caching settings.
# Any field whose name starts with "_" is metadata too (`_name_or_path`, `_model_name_or_path`, `_commit_hash`).
IGNORED = (
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
    "decoder_start_token_id", "use_cache", "attention_dropout", "pretraining_tp", "output_attentions",
    "output_hidden_states", "return_dict", "name_or_path", "sliding_window", "max_window_layers",
    "layer_types", "use_sliding_window", "attention_bias", "mlp_bias", "hidden_act", "rope_scaling",
    "rope_parameters", "partial_rotary_factor", "use_return_dict", "chunk_size_feed_forward", "id2label",
    "label2id", "num_labels", "problem_type", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "cross_attention_hidden_size", "finetuning_task", "task_specific_params",
    "tokenizer_class", "prefix", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "output_scores", "return_dict_in_generate", "output_router_logits", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "quantization_config",
)
# Ignorable fields that must still have one of these values (anything else is a variant jaxlong lacks).
REQUIRED_VALUES = {
    "hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "use_sliding_window": (False,),
    "attention_dropout": (0, 0.0), "pretraining_tp": (1, None), "partial_rotary_factor": (1, 1.0, None),
    "pruned_heads": ({}, None), "is_encoder_decoder": (False,), "add_cross_attention": (False,),
    "quantization_config": (None,),
}
ROPE_KEYS = {
    "factor": "factor", "original_max_position_embeddings": "original_max_position_embeddings",
    "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
    "beta_slow": "beta_slow", "attention_factor": "attention_factor", "truncate": "truncate",
}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
# The type of each mapped `model.*` field (config.json may hold 1 for 1.0, or 1e-05 for an int).
FIELD_TYPES = {"vocab_size": int, "hidden": int, "layers": int, "heads": int, "kv_heads": int, "head_dim": int,
               "mlp_hidden": int, "rope_theta": float, "norm_eps": float, "tie_embeddings": bool, "init_std": float,
               "max_position_embeddings": int}


def read_config_json(directory: str | Path) -> dict:
    """The parsed `config.json` of a checkpoint directory.

    Raises:
      ConfigError: the directory or its config.json does not exist (names `model.from_hf`).
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        what = "no config.json in that directory" if Path(directory).is_dir() else "no such directory"
        raise ConfigError(f"model.from_hf={str(directory)!r}: {what}; give a local Hugging Face checkpoint "
                          f"directory (config.json, *.safetensors, tokenizer.json), where it is now")
    return json.loads(path.read_text())


def _rope_scaling(hf: dict, where: str) -> tuple[float | None, dict]:
    """(rope_theta from rope_parameters if there, the `model.rope_scaling.*` settings) from `rope_scaling` or
    `rope_parameters`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope scaling type {kind!r} is not supported; supported: "
                          f"{', '.join(ROPE_TYPES)}")
    unknown = sorted(set(params) - set(ROPE_KEYS) - {"rope_type", "type", "rope_theta", "mscale", "mscale_all_dim"})
    if unknown:
        raise ConfigError(f"{where}: rope scaling fields {unknown} are not supported")
    if params.get("mscale") or params.get("mscale_all_dim"):
        raise ConfigError(f"{where}: rope scaling with mscale/mscale_all_dim (DeepSeek's YaRN) is not supported")
    scaling = {"type": ROPE_TYPES[kind]}
    for key, field in ROPE_KEYS.items():
        if params.get(key) is not None:
            value = params[key]
            kind_of = {"original_max_position_embeddings": int, "truncate": bool}.get(field, float)
            scaling[field] = kind_of(value)
    if scaling["type"] in ("llama3", "yarn") and not scaling.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = int(hf.get("max_position_embeddings") or 0)
    return theta, scaling


def model_settings_from_hf(directory: str | Path) -> dict:
    """The `model.*` settings of a Hugging Face Llama-3.x or Qwen3 checkpoint from its `config.json`: a nested
    dict of field values (`rope_scaling` a dict too), for `jaxlong.config.model_config_from_hf`.

    Raises:
      ConfigError: no config.json; an unsupported `model_type`; a field jaxlong does not implement or an
        ignorable one at a value that changes the model (each named); an unsupported rope scaling type.
    """
    hf = read_config_json(directory)
    where = f"model.from_hf={str(directory)!r} (config.json)"
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; supported: {', '.join(MODEL_TYPES)}")
    unknown = sorted(k for k in hf if k not in MAPPED and k not in IGNORED and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"{where}: fields {unknown} are not supported by jaxlong's {mt}: they may change the "
                          f"computation (mapped: {', '.join(sorted(MAPPED))}; the fields transformers writes for "
                          f"every model, such as token ids, label maps, output flags, dtype and names starting "
                          f"with '_', are ignored)")
    for key, allowed in REQUIRED_VALUES.items():
        if key in hf and hf[key] not in allowed:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (jaxlong implements {allowed[0]!r})")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{where}: layer_types other than full_attention (sliding windows) are not supported")
    m = {"name": str(Path(directory).name or mt), "from_hf": str(directory), "qk_norm": mt == "qwen3"}
    for key, field in MAPPED.items():
        if hf.get(key) is not None:
            m[field] = FIELD_TYPES[field](hf[key])
    if hf.get("num_key_value_heads") is None:
        m["kv_heads"] = m["heads"]
    if hf.get("head_dim") is None:
        m["head_dim"] = m["hidden"] // m["heads"]
    if hf.get("tie_word_embeddings") is None:  # transformers' defaults (Llama and Qwen3 alike)
        m["tie_embeddings"] = False
    if hf.get("rms_norm_eps") is None:
        m["norm_eps"] = 1e-6
    if hf.get("rope_theta") is None:
        m["rope_theta"] = 10000.0
    theta, m["rope_scaling"] = _rope_scaling(hf, where)
    if theta is not None:
        m["rope_theta"] = float(theta)
    return m


def hf_config_dict(m, *, model_type: str, context: int, dtype: str = "float32") -> dict:
    """The `config.json` of `m` for `transformers` (Llama or Qwen3), with `max_position_embeddings` = `context`
    (the trained context length) and the RoPE settings as `rope_theta` + `rope_scaling`.

    Raises:
      ConfigError: `model_type` is not llama or qwen3, or does not match `model.qk_norm` (Llama has no q/k norm).
    """
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"export: model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}")
    if (model_type == "qwen3") != m.qk_norm:
        raise ConfigError(f"export: model.qk_norm={m.qk_norm} does not fit model_type {model_type!r} "
                          f"(qwen3 has q/k norms, llama has none)")
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    out = {
        "architectures": [arch], "model_type": model_type, "vocab_size": m.vocab_size, "hidden_size": m.hidden,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim, "intermediate_size": m.mlp_hidden, "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": int(context), "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "torch_dtype": dtype, "use_cache": True,
    }
    if model_type == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    rs = m.rope_scaling
    if rs.type != "none":
        scaling = {"rope_type": rs.type, "factor": rs.factor}
        if rs.type in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
        if rs.type == "llama3":
            scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
        if rs.type == "yarn":
            scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
            if rs.attention_factor is not None:
                scaling["attention_factor"] = rs.attention_factor
        out["rope_scaling"] = scaling
    return out
