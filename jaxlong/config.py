"""Typed configuration: dataclasses, YAML files in `configs/`, and `key=value` overrides.

A config file is a nested YAML mapping whose keys mirror the dataclasses below; any key it does not set
keeps its default. Command-line overrides use dotted keys (`mesh.context=8`, `seq_len=1048576`) and are
parsed as YAML scalars, then checked against the field's type.

Every check that can be made without compiling is made in `validate` (called by `load_config`):
unknown keys, wrong types, and impossible combinations raise `ConfigError` naming the key, the value
and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import resolve_mesh_shape
from jaxlong.core.suggest import advice, fixes, sides
from jaxlong.data.chat_data import ChatTurns, DataFormat, TooLong
from jaxlong.data.imported import config_source
from jaxlong.data.mixture import source_name
from jaxlong.data.pipeline import Packing, SplitPositions
from jaxlong.data.tokenizer import TOKENIZERS
from jaxlong.kernels.backend import Backend, check_backend, check_kernel_size, kernel_that_runs
from jaxlong.kernels.blockwise import check_attention_block
from jaxlong.layers.blocks import RopeScaling
from jaxlong.layers.remat import RematPolicy, check_keep_attention, check_offload_every
from jaxlong.models.hf_config import model_settings_from_hf
from jaxlong.parallel.dispatch import AttentionImpl
from jaxlong.parallel.ring import check_ring
from jaxlong.parallel.ulysses import check_heads
from jaxlong.parallel.upipe import check_upipe_remat_names, check_upipe_schedule

__all__ = ["Config", "ModelConfig", "RopeScalingConfig", "MeshConfig", "AttentionConfig", "RematConfig", "TilingConfig",
           "DataConfig", "OptimConfig", "DPOConfig", "ConfigError", "load_config", "from_dict", "to_dict",
           "parse_override",
           "apply_setting", "read_yaml", "validate", "validate_optim", "schedule_length", "refusal", "advise",
           "with_settings", "changed_keys"]


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling for context extension (`rope_scaling` of Hugging Face configs).

    `type`: `none`; `linear` (position interpolation, Chen et al. 2023: every frequency / `factor`);
    `llama3` (Llama-3.1: wavelengths above `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, those below `original_max_position_embeddings / high_freq_factor` kept, those between
    interpolated); `yarn` (Peng et al. 2023, YaRN: a ramp between `beta_fast` and `beta_slow` rotations, and
    the attention temperature `attention_factor`, default `0.1 ln(factor) + 1`, applied to cos and sin).
    `jaxlong.layers.blocks.rope_frequencies` computes them as `transformers` does.
    """

    type: RopeScaling = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # pretraining context (llama3, yarn); 0: none given
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; null: 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: round the correction range to whole dimensions


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


@dataclass
class MeshConfig:
    """Device mesh `data x fsdp x ring x context`. -1 on one axis means "all remaining devices".

    The sequence is split over `ring` x `context`: Ulysses all-to-alls over `context` (inside a node), ring
    attention over `ring` (across nodes; `jaxlong.parallel.ring`). With ring > 1 both `attention.impl`s run as hybrids.

    `num_devices` is the number of simulated devices when the platform is the CPU (the entry point sets
    `--xla_force_host_platform_device_count` before importing jax); on GPUs the real device count is used.
    """

    data: int = 1
    fsdp: int = -1
    ring: int = 1
    context: int = 4
    num_devices: int = 8


@dataclass
class AttentionConfig:
    """How attention is parallelized (`impl`) and which kernel runs it (`backend`)."""

    impl: AttentionImpl = "ulysses"
    backend: Backend = "auto"
    block_q: int = 256
    block_k: int = 256
    heads_per_stage: int = 0  # U-Pipe heads per stage U; 0 means U = context degree C


@dataclass
class RematConfig:
    """Activation checkpointing of the scanned decoder layer."""

    policy: RematPolicy = "none"
    save: list[str] = field(default_factory=list)  # custom: names kept on device
    offload: list[str] = field(default_factory=list)  # custom: names moved to pinned host memory
    offload_every: int = 1  # offload: keep every k-th layer input on host, recompute the groups (grouped checkpointing)
    keep_attention: int = 0  # full/offload: the first N layers keep attention output + lse (forward runs once)
    keep_attention_memory: str = "host"  # where they are kept: "host" (pinned host memory) or "device"


@dataclass
class TilingConfig:
    """Sequence tiling (ALST §3.2-3.3): loss and MLP over tiles of the local sequence, recomputed in the
    backward pass, so `[S/C, vocab]` logits and `[S/C, mlp_hidden]` intermediates never exist at once."""

    loss: bool = False
    loss_tile: int = 0  # tokens per loss tile; 0 derives it from a 256 MiB float32 logits budget
    mlp: bool = False
    mlp_tiles: int = 0  # tiles per local sequence; 0 means ceil(S_local / hidden) as in ALST


@dataclass
class SourceConfig:
    """One corpus of a data mixture (`data.sources`, `jaxlong.data.mixture`): its share of the training tokens
    and its length rules, in tokens of `data.tokenizer` (a document is `[BOS] text [EOS]`)."""

    path: str | None = None  # as `data.path`; null: the embedded corpus
    weight: float = 1.0  # share of the training tokens, relative to the other sources' weights
    name: str = ""  # the name TensorBoard's data/share/NAME uses; "" derives it from the path
    text_field: str | None = None  # null: `data.text_field`
    min_doc_tokens: int = 0  # shorter documents are dropped
    max_doc_tokens: int | None = None  # longer documents are dropped (null: none)
    long_doc_tokens: int = 0  # a document this long or longer is "long"; 0: seq_len // 2
    upsample_long: float = 1.0  # long documents are drawn this many times as often (>= 1)
    format: str | None = None  # "text" or "chat" (conversations, docs/post-training.md); null: `data.format`


@dataclass
class DataConfig:
    """Training text. `path: null` is the embedded corpus: the Python standard library's source files.
    `sources` (a list of `SourceConfig`) mixes several corpora instead; `path` must be null then."""

    path: str | None = None
    tokenizer: str = "byte"  # "byte", or a path to a Hugging Face tokenizer.json
    max_tokens: int | None = None  # cap on corpus tokens read (None: all)
    text_field: str = "text"  # the field of each .jsonl / .parquet record that holds the document
    packing: Packing = "documents"  # "documents" (whole documents, segment ids) or "concat" (concatenate and cut)
    split_positions: SplitPositions = "restart"  # pieces of a document longer than seq_len: "restart" at 0 or "continue"
    shuffle: bool = True  # shuffle the documents each epoch (seeded by `seed` and the epoch)
    # Per packing stream: threads that read and tokenize ahead, and documents read ahead (Grain's ReadOptions;
    # its defaults of 16 and 500 cost seconds of start-up per stream and are slower on a few cores). No batch
    # depends on them.
    read_threads: int = 4
    read_buffer: int = 64
    sources: list[SourceConfig] = field(default_factory=list)
    # Post-training (docs/post-training.md): "chat" reads conversations ({"messages": [...]} or prompt/completion
    # records), renders them with the chat template and trains on the assistant's tokens only.
    format: DataFormat = "text"
    chat_turns: ChatTurns = "all"  # assistant turns trained: "all", or the "last" of each conversation
    too_long: TooLong = "refuse"  # a conversation longer than seq_len: "refuse" (stop) or "drop" (counted)
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's template (or gives one)
    # For plans only (`python -m jaxlong.memory --estimate/--fit`, jaxlong.plan.packing): a sample of the data's
    # document lengths in tokens, so a plan of packed documents counts the attention tiles the kernels skip between
    # documents; [] measures a chat or preference file where it exists, else counts dense causal attention.
    doc_lengths: list[int] = field(default_factory=list)


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay, global-norm gradient clipping (optax)."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    decay_steps: int = 0  # length of the warmup + cosine schedule; 0 means `steps` (see `schedule_length`)
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0  # global-norm gradient clipping; null disables it
    # The global step at which this schedule's warmup starts (a recipe's stage, `jaxlong.training.recipe`): the
    # learning rate at step s is the schedule's at s - schedule_start, over `steps - schedule_start` steps.
    schedule_start: int = 0
    # Start AdamW afresh (moments zero, bias correction from 1) at a recipe stage's first step, or where a resumed
    # checkpoint's config did not ask for it (`--resume-with-changes optim.reset_state=true`), instead of carrying
    # the checkpoint's optimizer state; the parameters and the schedule's global step carry on.
    reset_state: bool = False


Objective = Literal["lm", "dpo"]  # `objective`
PreferenceLoss = Literal["sigmoid", "ipo", "simpo"]  # `dpo.loss`


@dataclass
class DPOConfig:
    """Preference optimization (`objective: dpo`, docs/post-training.md, `jaxlong.training.preference`) on
    `data.format: preference` pairs."""

    loss: PreferenceLoss = "sigmoid"  # sigmoid (DPO), ipo, or simpo (no reference)
    beta: float = 0.1  # the KL penalty's strength (DPO's beta); under simpo the reward scale
    simpo_gamma: float = 0.5  # SimPO's target margin (nats, on per-token averaged log-probs)
    # The frozen reference whose log-probs are computed once, before the first DPO step, and kept in
    # RUN_DIR/reference/: "policy" (the weights the run or the recipe's stage starts from), or a Hugging Face
    # model directory of the same architecture.
    reference: str = "policy"


@dataclass
class Config:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    tiling: TilingConfig = field(default_factory=TilingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    objective: Objective = "lm"  # "lm" (next-token loss; SFT with chat data) or "dpo" (preference pairs)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    seq_len: int = 4096  # tokens per sequence
    global_batch: int = 2  # sequences per optimizer step, over all data-parallel replicas and micro-batches
    grad_accum: int = 1  # micro-batches per step (gradient accumulation); each has global_batch / grad_accum
    steps: int = 20
    seed: int = 0
    param_dtype: Dtype = "float32"  # master weights, gradients, optimizer state
    compute_dtype: Dtype = "float32"  # matmuls and activations
    run_name: str = "default"
    run_dir: str = "runs"
    log_every: int = 1
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    profile_steps: int = 3  # steps traced by --profile
    eval_every: int = 10  # validation every N steps and after the last step; 0 disables it
    eval_batches: int = 2  # held-out batches (of global_batch / grad_accum sequences) per validation
    eval_fraction: float = 0.01  # share of the corpus's documents held out for validation (fixed by seed)
    ruler_tasks: list[str] = field(default_factory=list)  # RULER tasks scored with each validation; [] disables it
    ruler_lengths: list[int] = field(default_factory=list)  # their context lengths (tokens); [] means [seq_len]
    ruler_cases: int = 4  # RULER cases per task and length (needle depths evenly spread)
    ruler_scoring: str = "generate"  # "generate" (greedy generation, string_match_all) or "forced" (teacher-forced)
    # Generation (`jaxlong.generation`): prompts longer than this are prefilled in chunks of this many tokens, the
    # cache filled chunk by chunk (`jaxlong.generation.chunked`); 0: the whole prompt in one forward.
    prefill_chunk: int = 0
    # Where the decode step reads the weights: "replicated" (every device holds them whole in the compute dtype,
    # gathered once before decoding), "sharded" (FSDP-sharded as trained, each layer's gathered for every token:
    # the least memory), or "auto": replicated when they take at most half of each device's free memory.
    decode_weights: Literal["auto", "replicated", "sharded"] = "auto"
    lost_process_timeout_s: float = 120  # several processes: one silent this long ends the others (docs/multi-node.md)
    # A recipe (docs/recipes.md, `jaxlong.training.recipe`): a list of stages, each a mapping of `name`, its own
    # `steps` and any config keys it changes; a run of one stage has `stage` set to its index.
    stages: list[dict] = field(default_factory=list)
    stage: int = 0
    # Written by the trainer: the sha256 of each file the run copied into RUN_DIR/imported/ from model.from_hf or
    # data.tokenizer's directory (`jaxlong.data.imported`), saved with every checkpoint so a changed copy is caught.
    imported: dict = field(default_factory=dict)


Dtype = Literal["float32", "bfloat16", "float16"]


# ----------------------------------------------------------------------------------------------
# Loading and overriding.


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def apply_setting(obj: Any, key: str, value: Any, raw: str | None = None) -> None:
    """Set dotted `key` (e.g. `mesh.context`) on the dataclass tree `obj` (a `Config`), checking the key exists
    and the value's type fits (a mapping sets a section's fields).

    Raises:
      ConfigError: unknown key, a section given a value or a value given a section, or the wrong type.

    `raw` is the override's text, used as is for string options."""
    parts = key.split(".")
    target = obj
    for i, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(target)}
        if part not in names:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"unknown config key {key!r}: {where} has no field {part!r}; allowed: {', '.join(sorted(names))}"
            )
        hints = typing.get_type_hints(type(target))
        tp = hints[part]
        if i < len(parts) - 1:
            target = getattr(target, part)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"config key {key!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            continue
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {key!r} is a section; give a mapping or set its fields")
            for k, v in value.items():
                apply_setting(obj, f"{key}.{k}", v)
            return
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if item is not None and dataclasses.is_dataclass(item):  # a list of sections, each a mapping
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"config key {key!r} is a list of sections; give a list of mappings, e.g. "
                                  f"{key}=[{{path: a.jsonl, weight: 0.6}}, {{path: b.jsonl, weight: 0.4}}]")
            sections = []
            for i, v in enumerate(value):
                section = item()
                for k, x in v.items():
                    try:
                        apply_setting(section, k, x)
                    except ConfigError as e:
                        raise ConfigError(f"{key}[{i}]: {str(e).replace('the top level', f'{key}[{i}]')}") from None
                sections.append(section)
            setattr(target, part, sections)
            return
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()) and (tp is float or (
                typing.get_origin(tp) in (typing.Union, types.UnionType) and float in typing.get_args(tp))):
            value = float(value)  # YAML 1.1 reads `lr: 3e-4` (no dot) as a string
        is_str = tp is str or typing.get_origin(tp) is Literal or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp))
        if raw is not None and is_str and value is not None and not isinstance(value, str):
            value = raw  # string options keep their text: run_name=off is 'off', not False
        if raw is not None and (tp is str or typing.get_origin(tp) is Literal) and value is None:
            value = raw
        if typing.get_origin(tp) is Literal and not _type_ok(value, tp):
            _check_choice(key, value, tp)
        if not _type_ok(value, tp):
            raise ConfigError(
                f"config key {key!r} must be of type {_type_name(tp)}, got {value!r} ({type(value).__name__})"
            )
        setattr(target, part, value)


def parse_override(text: str) -> tuple[str, Any, str]:
    """`'mesh.context=8'` -> `('mesh.context', 8, '8')`: key, the value read as a YAML scalar (so `1e-3`, `null`,
    `true`), and the raw text (string options use it)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. seq_len=16384)")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str):
        try:  # YAML 1.1 reads '3e-4' as a string
            value = float(value) if any(c in value for c in "eE.") and value[0] in "0123456789.-+" else value
        except ValueError:
            pass
    return key.strip(), value, raw.strip()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from defaults, then the YAML file at `path`, then `key=value` overrides; validate it (a
    recipe, a config with `stages`, is validated stage by stage by `jaxlong.training.recipe.expand` instead).

    Raises:
      ConfigError: `path` missing, unreadable or not valid YAML (with line and column); unknown key, wrong
        type, or impossible combination (see `validate`).
    """
    cfg = Config()
    settings: list[tuple] = []
    if path is not None:
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path} must hold a mapping of keys, got {type(data).__name__}")
        settings += [(k, v) for k, v in data.items()]
    in_file = len(settings)
    settings += [parse_override(text) for text in overrides]
    for s in settings:
        apply_setting(cfg, *s)
    if cfg.model.from_hf:
        cfg = _with_hf_model(cfg, settings)
    if cfg.stages:  # a recipe: no run uses the base config alone; each stage is validated whole, and named, by
        return cfg  # `jaxlong.training.recipe.expand`
    # advice about the options set here, the command line's first; a file's model is the model, not a knob
    validate(cfg, changed=changed_keys(settings[in_file:]) +
             [k for k in changed_keys(settings[:in_file]) if not k.startswith("model.")])
    return cfg


# Model keys that must agree with a `model.from_hf` checkpoint's config.json (the weights have these shapes).
HF_SHAPE_KEYS = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden", "tie_embeddings",
                 "qk_norm")


def model_config_from_hf(directory: str | Path) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face Llama-3.x or Qwen3 checkpoint directory, from its `config.json`
    (`jaxlong.models.hf_config.model_settings_from_hf`).

    Raises:
      ConfigError: no config.json, or a model type, field or rope scaling jaxlong does not implement (named).
    """
    out = Config()
    apply_setting(out, "model", model_settings_from_hf(directory))
    return out.model


def _with_hf_model(cfg: Config, settings: list[tuple]) -> Config:
    """`cfg` with its model taken from `model.from_hf`'s config.json, then the explicit settings applied again
    (so `model.rope_theta=...` or `model.rope_scaling.*` override the checkpoint's values)."""
    source = config_source(cfg)  # the run's copy once model.from_hf is moved away
    base = model_config_from_hf(source)
    if source != Path(cfg.model.from_hf):  # named as model.from_hf names it, not as the copy's directory
        base.name, base.from_hf = Path(cfg.model.from_hf).name or base.name, cfg.model.from_hf
    out = Config()
    out.model = copy.deepcopy(base)
    for s in settings:
        apply_setting(out, *s)
    for key in HF_SHAPE_KEYS:
        if getattr(out.model, key) != getattr(base, key):
            raise ConfigError(
                f"model.{key}={getattr(out.model, key)!r} conflicts with model.from_hf={cfg.model.from_hf!r}, whose "
                f"config.json gives {getattr(base, key)!r}; drop model.{key} (the weights have the checkpoint's shapes)"
            )
    return out


def from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A `Config` from a nested mapping (e.g. `to_dict` output saved with a checkpoint), then `key=value`
    overrides; validated. Keys the mapping omits keep their defaults.

    Raises:
      ConfigError: unknown key, wrong type, or impossible combination (see `validate`).
    """
    cfg = Config()
    for k, v in data.items():
        apply_setting(cfg, k, v)
    settings = [parse_override(text) for text in overrides]
    for s in settings:
        apply_setting(cfg, *s)
    validate(cfg, changed=changed_keys(settings))
    return cfg


def read_yaml(path: str | Path) -> Any:
    """The YAML document at `path` (`--config`).

    Raises:
      ConfigError: one line: the file does not exist or cannot be read, or is not valid YAML (line and column).
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a directory; give a YAML file, e.g. configs/default.yaml") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path} cannot be read: {e}") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (a NUL byte, a control character)
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        code = e.character if isinstance(e.character, int) else ord(e.character)
        raise ConfigError(f"--config {path} is not valid YAML at line {line}, column {column}: character "
                          f"U+{code:04X} is not allowed in YAML; remove it or save the file as plain text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"--config {path} is not valid YAML at {where}: {what}") from None


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------------------------
# Validation of combinations (no jax needed).


def _check_choice(key: str, value: str, tp: Any) -> None:
    """A field typed `Literal[...]` holds one of its values (a dataclass field can be set past `apply_setting`)."""
    allowed = typing.get_args(tp)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def validate(cfg: Config, num_devices: int | None = None, *, platform: str | None = None,
             changed: typing.Sequence[str] = ()) -> None:
    """Check every combination that can be checked before compiling, and where one fails, say what would pass.

    Args:
      cfg: the config.
      num_devices: the device count the run will have (default `mesh.num_devices`); never suggested.
      platform: the devices' platform (`cpu`, `gpu`) where it is known: the size limits of the GPU kernel that
        `attention.backend=auto` picks there are checked too (`jaxlong.kernels.backend.kernel_that_runs`).
      changed: the options the user set, most specific first (`changed_keys`): the advice is about the first of
        them in the broken rule that has a passing value, else about the option whose rule broke.

    Raises:
      ConfigError: naming the key, its value and what would work (`advise`): its `suggestions` each pass
        `validate` with the rest of `cfg` unchanged.
    """
    error = refusal(cfg, num_devices, platform)
    if error is not None:
        raise advise(cfg, error, num_devices, platform, changed)


def refusal(cfg: Config, num_devices: int | None = None, platform: str | None = None) -> ConfigError | None:
    """The first rule of `validate` that `cfg` breaks, as a `ConfigError` without advice (its message the rule,
    its fields the options involved), or None when `cfg` passes. Cheap: a search for passing values calls it."""
    try:
        _check(cfg, cfg.mesh.num_devices if num_devices is None else num_devices, platform)
    except ConfigError as e:
        return e
    return None


def _check(cfg: Config, n: int, platform: str | None) -> None:
    m = cfg.model
    for key in ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden", "vocab_size"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be positive", key=f"model.{key}",
                              value=getattr(m, key))
    if m.heads % m.kv_heads:
        raise ConfigError(
            f"model.heads={m.heads} must be a multiple of model.kv_heads={m.kv_heads} (grouped-query attention)",
            key="model.kv_heads", value=m.kv_heads, keys=("model.heads",))
    rs = m.rope_scaling
    _check_choice("model.rope_scaling.type", rs.type, RopeScaling)
    if m.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be positive")
    if rs.type != "none" and rs.factor <= 0:
        raise ConfigError(f"model.rope_scaling.factor={rs.factor} must be positive")
    if rs.type in ("llama3", "yarn") and rs.original_max_position_embeddings <= 0:
        raise ConfigError(
            f"model.rope_scaling.type={rs.type} needs model.rope_scaling.original_max_position_embeddings (the "
            f"pretraining context length, e.g. 8192 for Llama-3.1), got {rs.original_max_position_embeddings}"
        )
    if rs.type == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
        raise ConfigError(
            f"model.rope_scaling.high_freq_factor={rs.high_freq_factor} must exceed "
            f"model.rope_scaling.low_freq_factor={rs.low_freq_factor}"
        )
    _check_choice("param_dtype", cfg.param_dtype, Dtype)
    _check_choice("compute_dtype", cfg.compute_dtype, Dtype)
    _check_choice("attention.impl", cfg.attention.impl, AttentionImpl)
    _check_choice("attention.backend", cfg.attention.backend, Backend)
    _check_choice("remat.policy", cfg.remat.policy, RematPolicy)
    check_offload_every(cfg.remat.offload_every, cfg.remat.policy, m.layers)
    check_keep_attention(cfg.remat.keep_attention, cfg.remat.keep_attention_memory, cfg.remat.policy, m.layers)
    if cfg.tiling.loss_tile < 0 or cfg.tiling.mlp_tiles < 0:
        raise ConfigError("tiling.loss_tile and tiling.mlp_tiles must be >= 0 (0 = derived default)")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    if cfg.data.path is not None and not str(cfg.data.path).strip():
        raise ConfigError("data.path is empty; give a .txt/.jsonl file or directory, or null for the embedded corpus")
    if cfg.data.tokenizer not in TOKENIZERS and not str(cfg.data.tokenizer).endswith(".json"):
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r} is not allowed; choose one of: "
                          f"{', '.join(sorted(TOKENIZERS))}, or the path of a Hugging Face tokenizer.json")
    _check_choice("data.packing", cfg.data.packing, Packing)
    _check_choice("data.split_positions", cfg.data.split_positions, SplitPositions)
    check_backend(cfg.attention.backend, head_dim=m.head_dim, compute_dtype=cfg.compute_dtype,
                  segment_ids=cfg.data.packing == "documents")
    if not str(cfg.data.text_field).strip():
        raise ConfigError("data.text_field is empty; give the name of the field that holds each document's text")
    if cfg.data.read_threads < 0:
        raise ConfigError(f"data.read_threads={cfg.data.read_threads} must be >= 0 (0 reads in the training thread)")
    if cfg.data.read_buffer < 1:
        raise ConfigError(f"data.read_buffer={cfg.data.read_buffer} must be >= 1 document")
    validate_sources(cfg)
    validate_chat(cfg)
    validate_objective(cfg)
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps} must be >= 1")
    if not 0 <= cfg.optim.schedule_start < cfg.steps:
        raise ConfigError(f"optim.schedule_start={cfg.optim.schedule_start} must be >= 0 and below steps={cfg.steps} "
                          "(the global step a recipe's stage starts at)")
    if cfg.stage < 0:
        raise ConfigError(f"stage={cfg.stage} must be >= 0 (a recipe's stage index)")
    if not all(isinstance(st, dict) for st in cfg.stages):
        raise ConfigError("stages must be a list of mappings, each with its steps and the keys it changes")
    if cfg.data.max_tokens is not None and cfg.data.max_tokens <= 0:
        raise ConfigError(f"data.max_tokens={cfg.data.max_tokens} must be positive, or null for the whole corpus")
    for key in ("seq_len", "global_batch", "steps", "log_every", "checkpoint_every", "keep_checkpoints",
                "grad_accum", "eval_batches", "profile_steps"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be positive", key=key, value=getattr(cfg, key))
    if cfg.eval_every < 0:
        raise ConfigError(f"eval_every={cfg.eval_every} must be >= 0 (0 disables validation)")
    if not 0.0 < cfg.eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction={cfg.eval_fraction} must be in (0, 1), e.g. 0.01 (1% of the documents)")
    if not cfg.lost_process_timeout_s >= 1:
        raise ConfigError(f"lost_process_timeout_s={cfg.lost_process_timeout_s} must be >= 1 second (default 120; "
                          f"longer than any pause of a process, such as a slow checkpoint read)")
    validate_ruler(cfg)
    for key in ("rope_theta", "norm_eps", "init_std"):
        if not getattr(m, key) > 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be positive")
    validate_optim(cfg.optim)
    if cfg.attention.heads_per_stage < 0:
        raise ConfigError(f"attention.heads_per_stage={cfg.attention.heads_per_stage} must be >= 0 (0: U = "
                          f"mesh.context)", key="attention.heads_per_stage", value=cfg.attention.heads_per_stage)
    if cfg.mesh.num_devices <= 0:
        raise ConfigError(f"mesh.num_devices={cfg.mesh.num_devices} must be a positive device count")

    data, fsdp, ring, context = resolve_mesh_shape(cfg.mesh, n)
    if ring == 1 and cfg.seq_len % context:
        raise ConfigError(f"seq_len={cfg.seq_len} is not divisible by mesh.context={context}", key="seq_len",
                          value=cfg.seq_len, keys=("mesh.context",))
    if ring > 1:
        check_ring(cfg.seq_len, ring, context, cfg.attention.block_q, cfg.attention.block_k)
    if cfg.global_batch % (data * fsdp):
        raise ConfigError(
            f"global_batch={cfg.global_batch} is not divisible by mesh.data*mesh.fsdp={data * fsdp} "
            f"(the batch is sharded over both)", key="global_batch", value=cfg.global_batch,
            keys=("mesh.fsdp", "mesh.data"))
    if cfg.global_batch % (cfg.grad_accum * data * fsdp):
        raise ConfigError(
            f"grad_accum={cfg.grad_accum}: global_batch={cfg.global_batch} must be divisible by "
            f"grad_accum*mesh.data*mesh.fsdp={cfg.grad_accum * data * fsdp} (each micro-batch is sharded over "
            f"data x fsdp)", key="grad_accum", value=cfg.grad_accum, keys=("global_batch",))
    check_heads(m.heads, m.kv_heads, context)
    if cfg.prefill_chunk < 0:
        raise ConfigError(f"prefill_chunk={cfg.prefill_chunk}: give 0 (the whole prompt in one forward) or the "
                          f"tokens per chunk, a multiple of mesh.ring x mesh.context", key="prefill_chunk",
                          value=cfg.prefill_chunk)
    if cfg.prefill_chunk % (ring * context):
        raise ConfigError(f"prefill_chunk={cfg.prefill_chunk} must be a multiple of the sequence shards mesh.ring x "
                          f"mesh.context = {ring * context} (each holds an equal slice of every chunk)",
                          key="prefill_chunk", value=cfg.prefill_chunk)
    for key in ("block_q", "block_k"):
        check_attention_block(f"attention.{key}", getattr(cfg.attention, key), cfg.seq_len)
    sl, a = cfg.prefill_chunk // (ring * context), cfg.attention  # the tiles are positive here
    slice_ok = sl < a.block_k or sl % a.block_k == 0
    chunk_ok = cfg.prefill_chunk < a.block_q or cfg.prefill_chunk % a.block_q == 0
    if cfg.prefill_chunk and not (slice_ok and chunk_ok):
        raise ConfigError(f"prefill_chunk={cfg.prefill_chunk}: each sequence shard's slice of a chunk "
                          f"(prefill_chunk / (mesh.ring x mesh.context) = {sl} tokens) must be a multiple of "
                          f"attention.block_k={a.block_k} or shorter, and the chunk a multiple of "
                          f"attention.block_q={a.block_q} or shorter (the attention's tiles)",
                          key="prefill_chunk", value=cfg.prefill_chunk)
    s_local = cfg.seq_len // (ring * context)
    for key, value in (("tiling.loss_tile", cfg.tiling.loss_tile), ("tiling.mlp_tiles", cfg.tiling.mlp_tiles)):
        if value and s_local % value:
            raise ConfigError(f"{key}={value} must divide the local sequence length "
                              f"seq_len/(mesh.ring*mesh.context) = {s_local} (0: the default)", key=key, value=value,
                              keys=("seq_len",))
    u = cfg.attention.heads_per_stage or context
    if cfg.attention.impl == "upipe":
        check_upipe_schedule(m.heads, m.kv_heads, context, u)
        if cfg.remat.policy == "custom":
            check_upipe_remat_names(cfg.remat.save + cfg.remat.offload)
    kernel = kernel_that_runs(cfg.attention.backend, platform, compute_dtype=cfg.compute_dtype,
                              head_dim=m.head_dim, segment_ids=cfg.data.packing == "documents")
    check_kernel_size(kernel, backend=cfg.attention.backend, batch=cfg.global_batch // (cfg.grad_accum * data * fsdp),
                      seq=cfg.seq_len // ring, heads=(u if cfg.attention.impl == "upipe" else m.heads) // context,
                      head_dim=m.head_dim)


def validate_sources(cfg: Config) -> None:
    """`data.sources`: a mixture, each source's weight (finite, > 0) and length rules (`jaxlong.data.mixture`);
    whether each corpus exists and whether its rules keep any of its documents are checked when the pipeline
    opens it (`jaxlong.data.batch_iterator`), before anything compiles.

    Raises:
      ConfigError: naming `data.sources[i].KEY`, its value and what would work.
    """
    d = cfg.data
    if not d.sources:
        return
    if d.path is not None:
        raise ConfigError(f"data.path={d.path!r} and data.sources are both set: give the corpus as one of "
                          "data.sources (with its weight), or drop data.sources")
    if d.max_tokens is not None:
        raise ConfigError("data.max_tokens caps one corpus; with data.sources use each source's own rules "
                          "(min_doc_tokens, max_doc_tokens) or drop data.max_tokens")
    names = set()
    for i, src in enumerate(d.sources):
        at = f"data.sources[{i}]"
        if src.path is not None and not str(src.path).strip():
            raise ConfigError(f"{at}.path is empty; give a .txt/.jsonl/.parquet file or directory, or null for "
                              "the embedded corpus")
        if not 0 < src.weight < float("inf"):  # NaN fails too
            raise ConfigError(f"{at}.weight={src.weight} must be > 0 and finite (its share of the training tokens, "
                              "relative to the other sources' weights, e.g. 1); drop the source to leave it out")
        if src.min_doc_tokens < 0:
            raise ConfigError(f"{at}.min_doc_tokens={src.min_doc_tokens} must be >= 0")
        if src.max_doc_tokens is not None and src.max_doc_tokens <= src.min_doc_tokens:
            raise ConfigError(f"{at}.max_doc_tokens={src.max_doc_tokens} must be > min_doc_tokens="
                              f"{src.min_doc_tokens}, or null")
        if src.long_doc_tokens < 0:
            raise ConfigError(f"{at}.long_doc_tokens={src.long_doc_tokens} must be >= 0 (0: seq_len // 2)")
        if not src.upsample_long >= 1:
            raise ConfigError(f"{at}.upsample_long={src.upsample_long} must be >= 1 (1: long documents as often "
                              "as the corpus has them; drop long ones with max_doc_tokens)")
        if src.text_field is not None and not str(src.text_field).strip():
            raise ConfigError(f"{at}.text_field is empty; give the field that holds each document's text, or null")
        name = source_name(src, i)
        if name in names:
            raise ConfigError(f"{at}: another source has the name {name!r}; give each a distinct name")
        names.add(name)


def validate_chat(cfg: Config) -> None:
    """The chat keys (docs/post-training.md): `data.format` and each source's `format`, `data.chat_turns`,
    `data.too_long`, and what conversations need: whole-document packing (`data.packing=documents`: each
    conversation its own segment), no `data.max_tokens` (it would cut one). `data.chat_template`, the records and
    their lengths are checked when the run starts and opens the source (`jaxlong.data.open_source`), before
    anything compiles (a trained run keeps its copy of the template, so evaluation needs no file).

    Raises:
      ConfigError: naming the option, its value and what would work.
    """
    d = cfg.data
    if any(n <= 0 for n in d.doc_lengths):
        raise ConfigError(f"data.doc_lengths={d.doc_lengths}: document lengths are positive token counts")
    _check_choice("data.format", d.format, DataFormat)
    _check_choice("data.chat_turns", d.chat_turns, ChatTurns)
    _check_choice("data.too_long", d.too_long, TooLong)
    formats = [d.format] if not d.sources else [s.format or d.format for s in d.sources]
    for i, src in enumerate(d.sources):
        if src.format is not None:
            _check_choice(f"data.sources[{i}].format", src.format, DataFormat)
    if "chat" not in formats and "preference" not in formats:
        return
    records = ("chat", "preference")
    paths = [d.path] if not d.sources else [s.path for s in d.sources if (s.format or d.format) in records]
    fmt = next(f for f in formats if f in records)
    if any(p is None for p in paths):
        where = "data.path" if not d.sources else next(f"data.sources[{i}].path" for i, s in enumerate(d.sources)
                                                       if (s.format or d.format) in records and s.path is None)
        example = "configs/data/stdlib_chat.jsonl" if fmt == "chat" else "configs/data/stdlib_preference.jsonl"
        raise ConfigError(f"{where} is null (the embedded corpus, which is text) under data.format={fmt}: give a "
                          f".jsonl file or directory of {fmt} records ({example} is one)"
                          + (", or format: text for that source" if d.sources else ""))
    if d.packing != "documents":
        raise ConfigError(f"data.packing={d.packing!r} would let conversations attend to each other: {fmt} data "
                          f"packs each conversation as its own document (data.packing=documents)")
    if d.max_tokens is not None:
        raise ConfigError(f"data.max_tokens would cut a conversation; with data.format={fmt} drop it (too long "
                          f"ones: data.too_long)")


def validate_objective(cfg: Config) -> None:
    """`objective` and the `dpo` keys (docs/post-training.md): `objective: dpo` trains on `data.format:
    preference` pairs and only on them (no `data.sources` mixture), with a positive `dpo.beta`; preference data
    needs `objective: dpo`.

    Raises:
      ConfigError: naming the option, its value and what would work.
    """
    _check_choice("objective", cfg.objective, Objective)
    _check_choice("dpo.loss", cfg.dpo.loss, PreferenceLoss)
    d = cfg.data
    formats = [d.format] if not d.sources else [s.format or d.format for s in d.sources]
    if cfg.objective == "lm":
        if "preference" in formats:
            where = "data.format" if not d.sources else "a source's format"
            raise ConfigError(f"{where}=preference is preference pairs, for objective=dpo", key="objective",
                              value=cfg.objective)
        return
    if d.sources or d.format != "preference":
        raise ConfigError("objective=dpo trains on preference pairs: set data.format=preference with data.path a "
                          ".jsonl of prompt/chosen/rejected records" + (", without data.sources" if d.sources else
                                                                          f" (data.format is {d.format!r})"),
                          key="objective", value=cfg.objective)
    if not cfg.dpo.beta > 0:
        raise ConfigError(f"dpo.beta={cfg.dpo.beta} must be positive (TRL's default is 0.1)", key="dpo.beta",
                          value=cfg.dpo.beta)
    if not str(cfg.dpo.reference).strip():
        raise ConfigError("dpo.reference is empty; give policy (the weights the run starts from) or a Hugging Face "
                          "model directory")


def validate_ruler(cfg: Config) -> None:
    """The RULER validation keys: positive `ruler_lengths` and `ruler_cases`, no task listed twice, and
    `eval_every` > 0 when tasks are set. The task names and whether the mesh takes each length are checked when the
    trainer builds its `RulerValidator` (`jaxlong.evaluation.ruler.validation_suite`, `check_length`), before
    compiling.

    Raises:
      ConfigError: naming the key, its value and what would work.
    """
    if len(set(cfg.ruler_tasks)) != len(cfg.ruler_tasks):
        raise ConfigError(f"ruler_tasks={cfg.ruler_tasks}: a task is listed twice")
    if cfg.ruler_scoring not in ("generate", "forced"):
        raise ConfigError(f"ruler_scoring={cfg.ruler_scoring!r}: give generate (RULER's: greedy generation scored by "
                          f"string_match_all) or forced (teacher-forced exact match, the cheap proxy)",
                          key="ruler_scoring", value=cfg.ruler_scoring,
                          suggestions=({"ruler_scoring": "generate"}, {"ruler_scoring": "forced"}))
    bad = [n for n in cfg.ruler_lengths if n <= 0]
    if bad:
        raise ConfigError(f"ruler_lengths={cfg.ruler_lengths}: lengths must be positive token counts, e.g. "
                          f"[{cfg.seq_len}]")
    if cfg.ruler_cases <= 0:
        raise ConfigError(f"ruler_cases={cfg.ruler_cases} must be positive (cases per task and length)")
    if cfg.ruler_tasks and not cfg.eval_every:
        raise ConfigError(f"ruler_tasks={cfg.ruler_tasks} runs with validation, which eval_every=0 disables; set "
                          f"eval_every=N, or ruler_tasks=[]")


def schedule_length(steps: int, warmup_steps: int, decay_steps: int) -> int:
    """Steps of the warmup + cosine-decay learning-rate schedule (optax's `decay_steps`, warmup included):
    `optim.decay_steps`, or `steps` when it is 0, and at least `warmup_steps + 1` (the cosine needs a step after
    the warmup). Two configs with the same length, warmup and rates have the same schedule: a 4-step run with
    `optim.warmup_steps=5` has a 6-step schedule, as has the same run extended to `steps=6`."""
    return max(decay_steps or steps, warmup_steps + 1)


def validate_optim(o: OptimConfig) -> None:
    """AdamW, warmup and cosine-decay ranges.

    Raises:
      ConfigError: lr <= 0; clip_norm <= 0 (use null to disable clipping); warmup_steps < 0; decay_steps < 0
        or (when set) < warmup_steps; min_lr_ratio outside [0, 1]; weight_decay < 0; b1 or b2 outside [0, 1);
        eps <= 0.
    """
    if not o.lr > 0:
        raise ConfigError(f"optim.lr={o.lr} must be positive, e.g. 3e-4")
    if o.clip_norm is not None and not o.clip_norm > 0:
        raise ConfigError(
            f"optim.clip_norm={o.clip_norm} must be a positive global gradient norm (e.g. 1.0), or null to disable clipping"
        )
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0 (0: no warmup)")
    if o.decay_steps < 0 or (o.decay_steps and o.decay_steps < o.warmup_steps):
        raise ConfigError(
            f"optim.decay_steps={o.decay_steps} must be >= optim.warmup_steps={o.warmup_steps} "
            f"(it counts the warmup), or 0 for `steps`"
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1] (final lr / peak lr)")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} must be >= 0")
    for key in ("b1", "b2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optim.{key}={getattr(o, key)} must be in [0, 1), e.g. 0.9 / 0.95")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps} must be positive, e.g. 1e-8")


# ----------------------------------------------------------------------------------------------
# Advice: values that pass, asked of `refusal` itself (`jaxlong.core.suggest`).


def advise(cfg: Config, error: ConfigError, num_devices: int | None = None, platform: str | None = None,
           changed: typing.Sequence[str] = ()) -> ConfigError:
    """`error`, a `refusal` of `cfg`, with what would pass appended and in its `suggestions`: the nearest passing
    values (below and above, or the passing choices) of the first option of the broken rule that the user set
    (`changed`) and that has one; else of the option whose rule broke (`error.key`) or another option of the rule
    outside the model; else two or three options to change together (`jaxlong.core.suggest.fixes`). Never the
    device count, nor the shapes of a `model.from_hf` checkpoint. An error that names no option is returned as is.
    """
    if error.key is None:
        return error
    fixed = {"mesh.num_devices"} | ({f"model.{k}" for k in HF_SHAPE_KEYS} if cfg.model.from_hf else set())

    def order(e: ConfigError) -> list[str]:
        involved = (e.key, *e.keys)
        keys = [k for k in changed if k in involved] + [e.key] + [k for k in e.keys if not k.startswith("model.")]
        return [k for k in dict.fromkeys(keys) if k not in fixed]

    def candidates(key: str, base: dict):
        return () if key in fixed else _candidates(with_settings(cfg, base), key, num_devices)

    found = fixes(error, lambda s: refusal(with_settings(cfg, s), num_devices, platform), candidates, order)
    return ConfigError(f"{error}; {advice(found)}" if found else str(error), key=error.key, value=error.value,
                       keys=error.keys, suggestions=found)


def with_settings(cfg: Config, settings: dict) -> Config:
    """A copy of `cfg` with the dotted `settings` (`{"mesh.context": 2}`) applied, `cfg` itself untouched (no
    type check: see `apply_setting`)."""
    for key, value in settings.items():
        cfg = _replaced(cfg, key.split("."), value)
    return cfg


def _replaced(obj: Any, parts: list[str], value: Any) -> Any:
    out = object.__new__(type(obj))  # a shallow copy, the one field replaced (a search makes thousands)
    out.__dict__.update(obj.__dict__)
    setattr(out, parts[0], value if len(parts) == 1 else _replaced(getattr(obj, parts[0]), parts[1:], value))
    return out


def changed_keys(*levels) -> list[str]:
    """The dotted options that `levels` of settings set, for `validate(changed=...)`: each level a mapping or a
    list of `(key, value, ...)` settings (`parse_override`'s), the most specific first (the command line, a
    recipe's stage, a config file); a mapping's sections as dotted keys; each level's `seq_len` first."""
    out: list[str] = []
    for level in levels:
        items = level.items() if isinstance(level, dict) else [(s[0], s[1]) for s in level]
        keys = [k for key, value in items for k in _dotted(str(key), value)]
        out += sorted(keys, key=lambda k: k != "seq_len")
    return list(dict.fromkeys(out))


def _dotted(key: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for sub, v in value.items() for k in _dotted(f"{key}.{sub}", v)]
    return [key]


@functools.cache
def _field_types(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _candidates(cfg: Config, key: str, num_devices: int | None) -> list:
    """The values of option `key` a search tries, in sides nearest first (`jaxlong.core.suggest.sides`): the other
    choices of a closed set (one side each), the other boolean, or integers around the value (around the default
    when the value is out of range), within the option's range; () for other types."""
    section, _, name = key.rpartition(".")
    obj, default = cfg, Config()
    for part in section.split(".") if section else ():
        obj, default = getattr(obj, part), getattr(default, part)
    tp, value = _field_types(type(obj)).get(name), getattr(obj, name)
    if typing.get_origin(tp) is Literal:  # `reference` is the tests' dense attention, not a setting to suggest
        return [[c] for c in typing.get_args(tp) if c != value and c != "reference"]
    if tp is bool:
        return [[not value]]
    if tp is not int:
        return ()
    step, lo, hi = _int_range(cfg, key, cfg.mesh.num_devices if num_devices is None else num_devices)
    if lo <= value and (hi is None or value <= hi):
        return list(sides(value, step=step, lo=lo, hi=hi))
    # out of range: one value, the nearest in range above it, else the default, else the nearest to either
    start = hi if hi is not None and value > hi else getattr(default, name)
    if start < lo or (hi is not None and start > hi):
        start = lo
    return [itertools.chain([start], *sides(start, step=step, lo=lo, hi=hi))]


def _int_range(cfg: Config, key: str, n: int) -> tuple[int, int, int | None]:
    """(step, lo, hi) of the integers option `key` may take: `seq_len` in multiples of the mesh's sequence split,
    mesh axes from -1 (fill) to the device count, counts of tiles, stages and layers up to what they split."""
    if key == "seq_len":
        try:
            _, _, ring, context = resolve_mesh_shape(cfg.mesh, n)
        except ConfigError:
            ring, context = 1, 1
        unit = context * (2 * ring if ring > 1 else 1)
        return unit, unit, None
    if key.startswith("mesh."):
        return 1, -1, n
    hi = {"grad_accum": cfg.global_batch, "attention.block_q": cfg.seq_len, "attention.block_k": cfg.seq_len,
          "attention.heads_per_stage": cfg.model.heads, "tiling.loss_tile": cfg.seq_len,
          "tiling.mlp_tiles": cfg.seq_len, "remat.offload_every": cfg.model.layers,
          "remat.keep_attention": cfg.model.layers}.get(key)
    lo = 0 if key in ("attention.heads_per_stage", "tiling.loss_tile", "tiling.mlp_tiles",
                      "remat.keep_attention") else 1
    return 1, lo, hi
