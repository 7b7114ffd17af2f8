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

import jax
import yaml

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.core.mesh import MeshConfig, build_mesh, check_mesh, check_process_layout, resolve_mesh_shape, run_devices
from jaxlong.core.suggest import advice, fixes, sides
from jaxlong.data.config import DataConfig, SourceConfig, check_data
from jaxlong.data.imported import config_source
from jaxlong.kernels.backend import check_backend, check_kernel_size, kernel_that_runs
from jaxlong.kernels.blockwise import check_attention_block
from jaxlong.layers.blocks import RopeScalingConfig
from jaxlong.layers.remat import RematConfig, check_remat
from jaxlong.layers.tiled import TilingConfig, check_tiling
from jaxlong.models.config import ModelConfig, check_model
from jaxlong.models.hf_config import model_settings_from_hf
from jaxlong.models.llama import Runtime
from jaxlong.objectives.base import Objective
from jaxlong.objectives.dpo import DPOConfig
from jaxlong.objectives.grpo import GRPOConfig
from jaxlong.objectives.registry import ObjectiveName, check_objective, objective_for
from jaxlong.optim.adamw import OptimConfig, schedule_length, validate_optim
from jaxlong.parallel.dispatch import AttentionConfig, check_attention
from jaxlong.parallel.ring import check_ring
from jaxlong.parallel.ulysses import check_heads
from jaxlong.parallel.upipe import check_upipe_remat_names, check_upipe_schedule

__all__ = ["Config", "ModelConfig", "RopeScalingConfig", "MeshConfig", "AttentionConfig", "RematConfig", "TilingConfig",
           "DataConfig", "SourceConfig", "OptimConfig", "DPOConfig", "GRPOConfig", "ConfigError", "load_config",
           "from_dict", "to_dict", "parse_override", "apply_setting", "read_yaml", "validate", "validate_optim",
           "schedule_length", "refusal", "advise", "with_settings", "changed_keys", "runtime", "run_mesh",
           "objective_of", "forward_at"]

Dtype = Literal["float32", "bfloat16", "float16"]


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
    # "lm" (next-token loss; SFT with chat data), "dpo" (preference pairs) or "grpo" (RL on rollouts)
    objective: ObjectiveName = "lm"
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
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
    # A recipe (docs/recipes.md, `jaxlong.recipes.recipe`): a list of stages, each a mapping of `name`, its own
    # `steps` and any config keys it changes; a run of one stage has `stage` set to its index.
    stages: list[dict] = field(default_factory=list)
    stage: int = 0
    # Written by the trainer: the sha256 of each file the run copied into RUN_DIR/imported/ from model.from_hf or
    # data.tokenizer's directory (`jaxlong.data.imported`), saved with every checkpoint so a changed copy is caught.
    imported: dict = field(default_factory=dict)


def runtime(cfg: Config, mesh, *, keep_attention: bool = False) -> Runtime:
    """The forward's `jaxlong.models.llama.Runtime` of a run on `mesh`: the sections it reads (model, attention,
    remat, tiling), the compute dtype and whether attention masks by segment ids (`data.packing=documents`)."""
    return Runtime(mesh, cfg.model, cfg.attention, cfg.remat, cfg.tiling, cfg.compute_dtype,
                   document_masking=cfg.data.packing == "documents", keep_attention=keep_attention)


def run_mesh(cfg: Config):
    """The mesh of a run on the devices present: `cfg` validated for them (their platform: the GPU kernels' limits
    where `attention.backend=auto`), the mesh built and its layout over the processes checked.

    Raises:
      ConfigError: the config does not fit these devices (in a multi-process launch, the launch named too), or
        the processes do not hold whole blocks of the mesh.
    """
    try:
        devices = run_devices(cfg.mesh)
        validate(cfg, num_devices=len(devices), platform=devices[0].platform)
    except ConfigError as e:
        if jax.process_count() == 1:
            raise
        raise ConfigError(f"{e} (this launch: {jax.process_count()} processes of {jax.local_device_count()} devices "
                          f"each)", key=e.key, value=e.value, keys=e.keys, suggestions=e.suggestions) from None
    mesh = build_mesh(cfg.mesh)
    check_process_layout(mesh)
    return mesh


def forward_at(cfg: Config, seq_len: int, **changes) -> Config:
    """The run's config for a forward of `seq_len` tokens that does not train (evaluation, generation, a probe),
    for `validate` to say whether the mesh takes that length: `objective` lm (a training objective's rules, such as
    GRPO's groups fitting `seq_len`, are the training run's), the loss tile chosen per length, and `changes`."""
    return dataclasses.replace(cfg, seq_len=int(seq_len), objective="lm",
                               tiling=dataclasses.replace(cfg.tiling, loss_tile=0), **changes)


def objective_of(cfg: Config) -> Objective:
    """The run's `jaxlong.objectives.base.Objective` (`objective` and its section)."""
    return objective_for(cfg)


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
            check_choice(key, value, tp)
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
    recipe, a config with `stages`, is validated stage by stage by `jaxlong.recipes.recipe.expand` instead).

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
        return cfg  # `jaxlong.recipes.recipe.expand`
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
    """Each section's own rules, in order, then the rules that span sections (`_check_run`, `_check_layout`)."""
    check_model(cfg.model)
    check_choice("param_dtype", cfg.param_dtype, Dtype)
    check_choice("compute_dtype", cfg.compute_dtype, Dtype)
    check_attention(cfg.attention)
    check_remat(cfg.remat, cfg.model.layers)
    check_tiling(cfg.tiling)
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    check_data(cfg.data)
    check_backend(cfg.attention.backend, head_dim=cfg.model.head_dim, compute_dtype=cfg.compute_dtype,
                  segment_ids=cfg.data.packing == "documents")
    _check_shared_prompt(cfg)
    check_objective(cfg)
    _check_run(cfg)
    validate_optim(cfg.optim)
    check_mesh(cfg.mesh)
    _check_layout(cfg, n, platform)


def _check_shared_prompt(cfg: Config) -> None:
    """Rows that hold a prompt once (`data.shared_prompt`, preference pairs, so packed with segment ids) take no
    sliding window: a window counts positions, and a branch's row index is not its position
    (`jaxlong.core.segments`)."""
    if cfg.data.shared_prompt and cfg.model.sliding_window:
        raise ConfigError(f"data.shared_prompt=true: model.sliding_window={cfg.model.sliding_window} counts "
                          f"positions, and a shared prompt's second branch does not follow it in the row; set "
                          f"data.shared_prompt=false for a model with sliding-window layers",
                          key="data.shared_prompt", value=True, keys=("model.sliding_window",))


def _check_run(cfg: Config) -> None:
    """The run's own keys: steps and a recipe's stage, the positive counts, validation, RULER, the process timeout."""
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps} must be >= 1")
    if not 0 <= cfg.optim.schedule_start < cfg.steps:
        raise ConfigError(f"optim.schedule_start={cfg.optim.schedule_start} must be >= 0 and below steps={cfg.steps} "
                          "(the global step a recipe's stage starts at)")
    if cfg.stage < 0:
        raise ConfigError(f"stage={cfg.stage} must be >= 0 (a recipe's stage index)")
    if not all(isinstance(st, dict) for st in cfg.stages):
        raise ConfigError("stages must be a list of mappings, each with its steps and the keys it changes")
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


def _check_layout(cfg: Config, n: int, platform: str | None) -> None:
    """How the run lies on `n` devices: the mesh's shape, the sequence over its shards, the batch over data x fsdp,
    the heads over context (each method's validator), the tiles and the kernels' size limits."""
    m = cfg.model
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
    if any(n <= 0 for n in cfg.ruler_lengths):
        raise ConfigError(f"ruler_lengths={cfg.ruler_lengths}: lengths must be positive token counts, e.g. "
                          f"[{cfg.seq_len}]")
    if cfg.ruler_cases <= 0:
        raise ConfigError(f"ruler_cases={cfg.ruler_cases} must be positive (cases per task and length)")
    if cfg.ruler_tasks and not cfg.eval_every:
        raise ConfigError(f"ruler_tasks={cfg.ruler_tasks} runs with validation, which eval_every=0 disables; set "
                          f"eval_every=N, or ruler_tasks=[]")


# ----------------------------------------------------------------------------------------------
# Advice: values that pass, asked of `refusal` itself (`jaxlong.core.suggest`).


def advise(cfg: Config, error: ConfigError, num_devices: int | None = None, platform: str | None = None,
           changed: typing.Sequence[str] = (), depth: int = 0) -> ConfigError:
    """`error`, a `refusal` of `cfg`, with what would pass appended and in its `suggestions`: the nearest passing
    values (below and above, or the passing choices) of the first option of the broken rule that the user set
    (`changed`) and that has one; else of the option whose rule broke (`error.key`) or another option of the rule
    outside the model; else two or three options to change together (`jaxlong.core.suggest.fixes`). Never the
    device count, the objective, nor the shapes of a `model.from_hf` checkpoint. Where nothing passes and the
    config has another problem past this rule, that one follows with its own advice (`also, ...`; `depth` bounds
    the chain). An error that names no option is returned as is.
    """
    if error.key is None:
        return error
    # never suggested: the hardware's device count, a checkpoint's shapes, and the objective (the user's goal: a
    # DPO run refused for its data is told how to fix its data, not to train another objective)
    fixed = {"mesh.num_devices", "objective"} | ({f"model.{k}" for k in HF_SHAPE_KEYS} if cfg.model.from_hf else set())

    def order(e: ConfigError) -> list[str]:
        involved = (e.key, *e.keys)
        keys = [k for k in changed if k in involved] + [e.key] + [k for k in e.keys if not k.startswith("model.")]
        return [k for k in dict.fromkeys(keys) if k not in fixed]

    def candidates(key: str, base: dict):
        return () if key in fixed else _candidates(with_settings(cfg, base), key, num_devices)

    found = fixes(error, lambda s: refusal(with_settings(cfg, s), num_devices, platform), candidates, order)
    if found:
        return ConfigError(f"{error}; {advice(found)}", key=error.key, value=error.value, keys=error.keys,
                           suggestions=found)
    also = _next_problem(cfg, error, num_devices, platform)  # the config's other problem, with its own advice
    if also is not None and depth < 2:
        settings, later = also
        later = advise(with_settings(cfg, settings), later, num_devices, platform, changed, depth + 1)
        return ConfigError(f"{error}; also, {later}", key=error.key, value=error.value, keys=error.keys)
    return error


def _next_problem(cfg: Config, error: ConfigError, num_devices: int | None,
                  platform: str | None) -> tuple[dict, ConfigError] | None:
    """Where no setting fixes `error` (its options are not to be suggested, or another rule breaks too): a value of
    one of its options (never the device count) that gets past its rule, and the next rule the config breaks then,
    which is a problem of its own; None when there is none."""
    for key in (error.key, *error.keys):
        if key == "mesh.num_devices":
            continue
        for side in _candidates(cfg, key, num_devices):
            for v in itertools.islice(side, 64):
                nxt = refusal(with_settings(cfg, {key: v}), num_devices, platform)
                if nxt is None:
                    return None
                if (nxt.key, nxt.keys) != (error.key, error.keys):
                    return {key: v}, nxt
    return None


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
