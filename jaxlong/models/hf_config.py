"""Hugging Face `config.json` <-> the `model` settings of `jaxlong.config.ModelConfig`, for Llama-3.x
(`model_type: llama`), Qwen3 (`model_type: qwen3`) and Gemma 3 (`gemma3_text`, and the multimodal `gemma3`, whose
`text_config` is read: the vision tower is left out). Pure Python (no jax): the trainer's CLI builds its config
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

MODEL_TYPES = ("llama", "qwen3", "gemma3_text", "gemma3")
GEMMA3 = ("gemma3_text", "gemma3")
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
# rope scaling fields, each the `model.rope_scaling.*` field of that name.
ROPE_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
             "beta_slow", "attention_factor", "truncate")
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
    for key in ROPE_KEYS:
        if params.get(key) is not None:
            scaling[key] = {"original_max_position_embeddings": int, "truncate": bool}.get(key, float)(params[key])
    if scaling["type"] in ("llama3", "yarn") and not scaling.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = int(hf.get("max_position_embeddings") or 0)
    return theta, scaling


# Gemma 3: what `Gemma3TextConfig` (transformers 4.5x and 5.x) defaults a field to when a config omits it.
GEMMA3_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
}
# Gemma 3's own fields -> ModelConfig field (besides `MAPPED`).
GEMMA3_MAPPED = {"query_pre_attn_scalar": "query_pre_attn_scalar", "sliding_window": "sliding_window",
                 "sliding_window_pattern": "sliding_window_pattern"}
# Gemma 3 fields jaxlong reads elsewhere or that must keep their inert value (None: unset).
GEMMA3_REQUIRED = {"hidden_activation": ("gelu_pytorch_tanh",), "final_logit_softcapping": (None,),
                   "attn_logit_softcapping": (None,), "use_bidirectional_attention": (False, None),
                   "attention_bias": (False,)}
# The multimodal `gemma3` config's own fields: the vision tower's and the image tokens', left out with it.
GEMMA3_VISION = ("vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index",
                 "boi_token_id", "eoi_token_id", "image_token_id", "text_config")


def _gemma3_settings(hf: dict, where: str) -> dict:
    """The `model.*` settings of a Gemma 3 text config (`gemma3_text`, or a `gemma3` config's `text_config`), as
    transformers reads it: omitted fields take Gemma 3's defaults; `layer_types` from `sliding_window_pattern`
    where absent; RoPE per layer type (`rope_parameters` with `full_attention` and `sliding_attention` in 5.x;
    `rope_theta`, `rope_local_base_freq` and `rope_scaling` on global layers only in 4.x).

    Raises:
      ConfigError: a field that changes the math and is not implemented (soft-capping set to a number,
        `attention_bias: true`, `use_bidirectional_attention: true`), named; an unknown field; a RoPE scaling on the
        local layers."""
    hf = {**GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k in GEMMA3_REQUIRED}}
    for key, allowed in GEMMA3_REQUIRED.items():
        if key in hf and hf[key] not in allowed:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported for Gemma 3 (jaxlong implements "
                              f"{allowed[0]!r})")
    known = set(MAPPED) | set(IGNORED) | set(GEMMA3_MAPPED) | set(GEMMA3_REQUIRED) | {
        "rope_local_base_freq", "cache_implementation", "layer_types"}
    unknown = sorted(k for k in hf if k not in known and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"{where}: fields {unknown} are not supported by jaxlong's Gemma 3: they may change the "
                          f"computation")
    m = {"family": "gemma3", "qk_norm": False}
    for key, field in {**MAPPED, **GEMMA3_MAPPED}.items():
        if hf.get(key) is not None and key not in ("rope_theta",):
            m[field] = (FIELD_TYPES.get(field) or type(GEMMA3_DEFAULTS.get(key, 0.0)))(hf[key])
    m["query_pre_attn_scalar"] = float(hf["query_pre_attn_scalar"])
    if hf.get("layer_types"):
        m["layer_types"] = list(hf["layer_types"])
    params = hf.get("rope_parameters") or {}
    full, local = params.get("full_attention"), params.get("sliding_attention")
    if full is None:  # 4.x: rope_theta and rope_scaling are the global layers'
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    theta, m["rope_scaling"] = _rope_scaling({"rope_parameters": full, **{k: hf[k] for k in (
        "max_position_embeddings",) if k in hf}}, where)
    m["rope_theta"] = float(theta if theta is not None else 1_000_000.0)
    local = local or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(f"{where}: a RoPE scaling on the sliding-window layers ({local}) is not supported; "
                          f"Gemma 3 scales the global layers only")
    m["rope_local_theta"] = float(local.get("rope_theta", 10_000.0))
    return m


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
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; supported: {', '.join(MODEL_TYPES)}"
                          + (" (Gemma 3n is not Gemma 3)" if str(mt).startswith("gemma3n") else ""))
    if mt in GEMMA3:
        text = hf.get("text_config") or {} if mt == "gemma3" else hf
        ignored = set(GEMMA3_VISION) | {"tie_word_embeddings", "initializer_range"} if mt == "gemma3" else set()
        unknown = sorted(k for k in hf if mt == "gemma3" and k not in ignored and k not in IGNORED
                         and not k.startswith("_"))
        if unknown:
            raise ConfigError(f"{where}: fields {unknown} of the gemma3 config are not supported")
        if mt == "gemma3" and "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
            text = {**text, "tie_word_embeddings": hf["tie_word_embeddings"]}
        return {"name": str(Path(directory).name or mt), "from_hf": str(directory),
                **_gemma3_settings(text, where + (" text_config" if mt == "gemma3" else ""))}
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
    m = {"name": str(Path(directory).name or mt), "from_hf": str(directory), "qk_norm": mt == "qwen3",
         "tie_embeddings": False, "norm_eps": 1e-6, "rope_theta": 10000.0}  # transformers' defaults (Llama, Qwen3)
    for key, field in MAPPED.items():
        if hf.get(key) is not None:
            m[field] = FIELD_TYPES[field](hf[key])
    if hf.get("num_key_value_heads") is None:
        m["kv_heads"] = m["heads"]
    if hf.get("head_dim") is None:
        m["head_dim"] = m["hidden"] // m["heads"]
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
    if model_type in GEMMA3:
        return _gemma3_config_dict(m, context, dtype)
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
    if m.rope_scaling.type != "none":
        out["rope_scaling"] = _scaling_dict(m.rope_scaling)
    return out


def _gemma3_config_dict(m, context: int, dtype: str) -> dict:
    """`config.json` of a `model.family=gemma3` model as a `gemma3_text` checkpoint (the text model alone), with the
    RoPE settings in both spellings: `rope_parameters` per layer type (transformers 5) and `rope_theta`,
    `rope_local_base_freq`, `rope_scaling` (4.x)."""
    scaling = _scaling_dict(m.rope_scaling) if m.rope_scaling.type != "none" else {"rope_type": "default"}
    full = {**scaling, "rope_theta": m.rope_theta}
    types = ["sliding_attention" if k else "full_attention" for k in _kinds(m)]
    out = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": m.vocab_size,
        "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "intermediate_size": m.mlp_hidden,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": int(context), "attention_bias": False,
        "attention_dropout": 0.0, "query_pre_attn_scalar": _number(m.query_pre_attn_scalar or m.head_dim),
        "sliding_window": m.sliding_window or None, "layer_types": types, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "torch_dtype": dtype, "use_cache": True,
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": m.rope_local_theta}},
        "rope_theta": m.rope_theta, "rope_local_base_freq": m.rope_local_theta,
    }
    if m.rope_scaling.type != "none":
        out["rope_scaling"] = _scaling_dict(m.rope_scaling)
    return out


def _number(x: float) -> int | float:
    """An int where `x` is whole (transformers 5 types `query_pre_attn_scalar` as an int and refuses 24.0)."""
    return int(x) if float(x).is_integer() else float(x)


def _kinds(m) -> list[int]:
    """1 for a sliding-window layer, 0 for a global one (`jaxlong.models.family.layer_kinds`, which this module may
    not import: it is pure Python)."""
    if not m.sliding_window:
        return [0] * m.layers
    if m.layer_types:
        return [int(t == "sliding_attention") for t in m.layer_types]
    return [int((i + 1) % m.sliding_window_pattern != 0) for i in range(m.layers)]


def _scaling_dict(rs) -> dict:
    """A `RopeScalingConfig` as transformers' `rope_scaling` dict."""
    scaling = {"rope_type": rs.type, "factor": rs.factor}
    if rs.type in ("llama3", "yarn"):
        scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
    if rs.type == "llama3":
        scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    if rs.type == "yarn":
        scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
        if rs.attention_factor is not None:
            scaling["attention_factor"] = rs.attention_factor
    return scaling
