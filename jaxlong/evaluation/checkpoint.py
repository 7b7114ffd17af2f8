"""The evaluation of a checkpoint: what `python -m jaxlong.eval` reports and a recipe's gate decides from
(docs/evaluation.md).

`resolve` reads a run directory's checkpoint and the config it was trained with (overrides applied) and checks the
evaluation's options (`EvalOptions`, the command's flags) before jax starts. `evaluate` then restores the
parameters alone on that mesh (no optimizer state is read), measures validation loss, loss by position, passkey
retrieval, the objective's own held-out metrics (DPO's) and with `ruler` RULER's tasks (`python -m jaxlong.eval`
lists them), and writes the results (`jaxlong.evaluation.report`) under `RUN_DIR/eval/<setup>/step_N/`, one
directory per evaluation setup (`evaluation_setup`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxlong import data as data_lib
from jaxlong.config import (Config, ConfigError, forward_at, from_dict, objective_of, refusal, run_mesh, runtime,
                            to_dict)
from jaxlong.core.distributed import say
from jaxlong.core.memstats import format_compiled
from jaxlong.core.units import fmt_bytes
from jaxlong.data.chat import run_template
from jaxlong.data.heldout import EVALUATION, corpus_label, eval_batch_size, held_out_documents, validation_split
from jaxlong.data.tokenizer import check_vocab, stop_ids
from jaxlong.evaluation import hostmem, report, ruler
from jaxlong.evaluation.probes import passkey_min_length
from jaxlong.evaluation.steps import PasskeyGrid, compile_eval_step, evaluate_loss, evaluate_params, make_eval_step
from jaxlong.evaluation.steps import sequences_to_evaluate, token_stats
from jaxlong.models import hf
from jaxlong.models import llama as model_lib
from jaxlong.objectives.base import Preparation
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.training.checkpoint import committed_steps, restore_weights, saved_config

__all__ = ["EvalOptions", "resolve", "check_flags", "evaluate", "evaluate_checkpoint", "evaluation_setup",
           "ruler_suite", "passkey_lengths", "check_passkey_length"]


@dataclasses.dataclass
class EvalOptions:
    """The options of an evaluation: `python -m jaxlong.eval`'s flags (docs/evaluation.md), the same names and
    defaults. `check_flags` adds the lists they resolve to (`lengths_list`, `depths_list`, `ruler_tasks_list`,
    `ruler_lengths_list`) and `resolve` the chat template (`chat_template`)."""

    step: int | None = None  # checkpoint step (None: the latest)
    batches: int | None = None  # held-out batches (None: the run's eval_batches; 0: none)
    lengths: str = ""  # passkey context lengths, comma-separated ("": S/8, S/4, S/2, S that the mesh takes)
    depths: str = "0,0.25,0.5,0.75,1"  # passkey needle depths in [0, 1]
    per_cell: int = 4  # passkey examples per depth x length cell
    digits: int = 5  # passkey digits
    passkey: bool = True
    ruler: bool = False
    ruler_tasks: str = ""  # comma-separated ("": all 11)
    ruler_lengths: str = ""  # comma-separated ("": S/8, S/4, S/2, S that the mesh takes)
    ruler_cases: int = 8  # cases per task and length
    ruler_scoring: str = "generate"  # generate (RULER's own) or forced (teacher-forced, a cheap proxy)
    chat: bool = False  # RULER by generation: each prompt as a user turn of the checkpoint's chat template
    overrides: list[str] = dataclasses.field(default_factory=list)  # config key=value overrides


def resolve(run_dir: str | Path, args: EvalOptions) -> tuple[Path, int, Config]:
    """(run dir, step, Config) of an evaluation, before jax creates a backend: the checkpoint (`args.step`, default
    the latest), the config it was trained with and `args.overrides`, and every option checked (`check_flags`).

    Raises:
      FileNotFoundError: no run directory, no checkpoint, or no checkpoint at `--step`.
      ConfigError: a bad override or option value.
    """
    run_dir = Path(run_dir)
    steps = committed_steps(run_dir / "checkpoints")
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no checkpoint found in {run_dir / 'checkpoints'} (train first: "
                                f"python -m jaxlong.train run_name=...)")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise FileNotFoundError(f"--step {step}: no checkpoint at that step in {run_dir / 'checkpoints'}; have {steps}")
    cfg = from_dict(saved_config(run_dir / "checkpoints", step), args.overrides)
    check_flags(cfg, args)
    args.chat_template = chat_template(cfg, run_dir, args)
    return run_dir, step, cfg


def chat_template(cfg: Config, run_dir: Path, args: EvalOptions):
    """The checkpoint's chat template for `--chat` (`jaxlong.data.chat.ChatTemplate` of the run's tokenizer
    files), or None without it.

    Raises:
      ConfigError: `--chat` without `--ruler` or with `--ruler-scoring forced`, or on a run without a template.
    """
    if not args.chat:
        return None
    if not args.ruler or args.ruler_scoring != "generate":
        raise ConfigError("--chat renders RULER's prompts for generation: add --ruler (and drop --ruler-scoring "
                          "forced), or drop --chat")
    try:
        template = run_template(cfg.data.chat_template, data_lib.tokenizer_source(cfg, run_dir), run_dir=run_dir)
    except ValueError as e:
        raise ConfigError(f"--chat: {e}") from None
    if template is None:
        raise ConfigError(f"--chat: {run_dir} has no chat template (its tokenizer's files have none and "
                          f"data.chat_template is not set); drop --chat")
    return template


def _positive(flag: str, value: int | None, default: int) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{flag}={value} must be positive; use {flag} {default} (the default)", key=flag, value=value,
                          suggestions=({flag: default},))


def _counts(flag: str, text: str, example: list[int]) -> list[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated token counts, e.g. {','.join(map(str, example))}",
                          key=flag, value=text, suggestions=({flag: ",".join(map(str, example))},)) from None


def check_flags(cfg, args: EvalOptions) -> None:
    """Check the evaluation flags against the run's config `cfg`, before jax starts, and set `args.lengths_list`,
    `args.depths_list` (`resolve`) and the RULER flags' lists (`resolve_ruler`). `--fit`-like compiles are not
    part of it: every check here is arithmetic on the config.

    Raises:
      ConfigError: naming the flag, its value and, where a value would pass, the nearest that do in its
        `suggestions` (`{flag: value}`; for a list of lengths, a length to put in place of the bad one).
    """
    if args.batches is not None and args.batches < 0:  # 0: no validation batches (RULER and passkey need none)
        raise ConfigError(f"--batches={args.batches} must be >= 0; use --batches {cfg.eval_batches} (the run's "
                          f"eval_batches), or --batches 0 for no validation loss", key="--batches", value=args.batches,
                          suggestions=({"--batches": cfg.eval_batches}, {"--batches": 0}))
    _positive("--per-cell", args.per_cell, 4)
    _positive("--digits", args.digits, 5)
    defaults = _lengths_taken(cfg, 64)
    lengths = _counts("--lengths", args.lengths, defaults)
    if args.passkey and not lengths:  # the default: S/8, S/4, S/2, S, those the mesh takes
        lengths = defaults
    for n in lengths if args.passkey else ():
        check_passkey_length(cfg, n)
    depths = [float(x) for x in args.depths.split(",")]
    if any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(f"--depths {args.depths}: depths must be in [0, 1]", key="--depths", value=args.depths)
    args.lengths_list, args.depths_list = sorted(set(lengths)), depths
    resolve_ruler(cfg, args)


def resolve_ruler(cfg, args) -> None:
    """Check the RULER flags (before jax starts): `args.ruler_tasks_list` (names in `ruler.TASKS`) and
    `args.ruler_lengths_list` (each a length the mesh takes: `ruler.check_length`).

    Raises:
      ConfigError: naming the flag, its value and what would work.
    """
    args.ruler_tasks_list = [t.strip() for t in args.ruler_tasks.split(",") if t.strip()] or list(ruler.TASKS)
    args.ruler_lengths_list = []
    if not args.ruler:
        if args.ruler_tasks or args.ruler_lengths or args.ruler_scoring != "generate":
            raise ConfigError("--ruler-tasks, --ruler-lengths and --ruler-scoring take effect with --ruler; add "
                              "--ruler")
        return
    unknown = [t for t in args.ruler_tasks_list if t not in ruler.TASKS]
    if unknown:
        raise ConfigError(f"--ruler-tasks {args.ruler_tasks}: unknown task(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(ruler.TASKS)}")
    _positive("--ruler-cases", args.ruler_cases, 8)
    defaults = _lengths_taken(cfg, 1)
    lengths = _counts("--ruler-lengths", args.ruler_lengths, defaults)
    option = "--ruler-lengths"
    if not lengths:
        lengths, option = defaults, "--ruler-lengths (default: seq_len and the fractions of it the mesh takes)"
    # every length checked, every problem named, before a case is generated
    ruler.check_lengths(cfg, lengths, option, cases=args.ruler_cases, tasks=len(args.ruler_tasks_list))
    args.ruler_lengths_list = sorted(set(lengths))


def _lengths_taken(cfg, least: int) -> list[int]:
    """S/8, S/4, S/2, S: those of at least `least` tokens that the mesh takes, or [S] when none is."""
    return [n for n in (cfg.seq_len // 8, cfg.seq_len // 4, cfg.seq_len // 2, cfg.seq_len)
            if n >= least and refusal(forward_at(cfg, n)) is None] or [cfg.seq_len]


def check_passkey_length(cfg, length: int) -> None:
    """A passkey length must be at least 64 tokens and a sequence length the run's mesh takes (the sequence
    rules of `jaxlong.config.validate`: divisible by mesh.context, by 2 * mesh.ring * mesh.context under ring
    attention, by `tiling.mlp_tiles` per device).

    Raises:
      ConfigError: naming `--lengths`, the length, the rule it breaks and the nearest lengths that pass
        (`suggestions`, `{"--lengths": n}`: a length to put in its place).
    """
    if length < 64:
        why = "a passkey length must be >= 64 tokens (the needle and question)"
    elif (rule := refusal(forward_at(cfg, length))) is not None:  # the loss tile is chosen per length
        why = f"not a sequence length this mesh takes ({rule})"
    else:
        return
    near = ruler.nearby_lengths(cfg, length, least=64)
    raise ConfigError(f"--lengths {length}: {why}" + (f"; nearby lengths it takes: {' or '.join(map(str, near))}"
                                                      if near else ""),
                      key="--lengths", value=length, suggestions=tuple({"--lengths": n} for n in near))


def _held_out(cfg: Config, source, tokenizer, args: EvalOptions) -> tuple[list[int], list[dict]]:
    """The trainer's held-out documents and `args.batches` validation batches of them (more batches than it used
    take more documents, the same ones first); with `--batches 0` the documents alone (RULER's haystacks), or every
    document of a corpus too small to split."""
    if args.batches != 0:
        return validation_split(cfg, source, tokenizer, args.batches, EVALUATION)
    if len(source) < 2:
        return list(range(len(source))), []
    return held_out_documents(source, tokenizer, cfg.eval_fraction, cfg.seed, 0, corpus_label(cfg), EVALUATION), []


def _check_host_memory(cfg: Config, mesh, args: EvalOptions, say) -> None:
    """The host memory RULER's forwards need, where the devices are this host's CPU (compiled, AOT): refused when
    it does not fit, said when it does."""
    generate = args.ruler_scoring == "generate"
    rows = (lambda n: ruler.rows_per_batch(cfg, n)) if generate else eval_batch_size(cfg)
    estimates = hostmem.check_lengths(cfg, mesh, args.ruler_lengths_list, rows=rows,
                                      max_new=max(ruler.TOKENS_TO_GENERATE.values()) if generate else None,
                                      cases=args.ruler_cases * len(args.ruler_tasks_list))
    for n, est in estimates.items():  # the long lengths, compiled for: what the guard passed, and why
        loop = f", {fmt_bytes(est.loop)} over {est.steps:,} kv steps per device and layer" if est.loop else ""
        say(f"host memory at {n} tokens: about {fmt_bytes(est.total)} estimated, this host has "
            f"{fmt_bytes(hostmem.host_limit())} ({est.devices} CPU device(s) x {fmt_bytes(est.per_device)} "
            f"compiled{loop}, {fmt_bytes(est.host)} of host arrays, {fmt_bytes(est.base)} in use)")


def evaluate(cfg: Config, run_dir: Path, step: int, args: EvalOptions) -> dict:
    """Evaluate checkpoint `step` of `run_dir` under `cfg` (`resolve`); writes the results (process 0) and returns
    the summary (`summary.json`'s), the same on every process.

    Raises:
      ConfigError: the checkpoint does not fit `cfg` (a changed model key: the message names it).
      ValueError: the held-out documents cannot fill the batches (the message names `--batches`).
    """
    mesh = run_mesh(cfg)
    main = jax.process_index() == 0  # process 0 prints and writes; every process computes
    tokenizer = data_lib.run_tokenizer(cfg, run_dir)  # the trainer's: the run's copy, then model.from_hf
    lengths = passkey_lengths(cfg, args, tokenizer) if args.passkey else []
    source = data_lib.first_source(cfg, tokenizer)  # data.path, or the first of data.sources
    objective = objective_of(cfg)
    if not cfg.eval_every:
        say(f"note: the run trained with eval_every=0, on every document: the {objective.records} evaluated here "
            f"were trained on, not held out")
    objective.prepare(Preparation(  # what the run computed when its stage started (DPO's reference log-probs)
        cfg, run_dir, source, tokenizer, model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh),
        None, lambda directory: hf.load_params(directory, cfg.model, mesh, cfg.param_dtype), say))
    held_out, batches = _held_out(cfg, source, tokenizer, args)
    if args.ruler:
        _check_host_memory(cfg, mesh, args, say)
    ruler_cases, skipped = ruler_suite(cfg, args, tokenizer, source, held_out) if args.ruler else ([], [])
    for note in skipped:
        say(note)
    params = restore_weights(cfg, mesh, run_dir / "checkpoints", step, hint=" (drop the override)")
    compiled = compile_eval_step(cfg, mesh, LanguageModeling()) if batches else None
    if compiled is not None:
        say(format_compiled(compiled, "eval step"))
    say(f"restored {run_dir / 'checkpoints' / str(step)}; mesh {dict(mesh.shape)}, seq_len {cfg.seq_len}")
    grid = PasskeyGrid(lengths, args.depths_list, args.per_cell, args.digits) if lengths else None
    stats = token_stats(cfg, mesh)  # one jitted program per batch shape, shared by the probes
    summary = _measure(cfg, mesh, params, batches, grid, tokenizer.encode, (compiled, stats), step, main)
    summary["setup"] = evaluation_setup(cfg, run_dir, step, dict(mesh.shape), args)
    if objective.summary_key and batches:  # the objective's own held-out metrics (DPO's loss and rewards)
        summary[objective.summary_key] = evaluate_loss(make_eval_step(cfg, mesh, objective), params, batches, mesh,
                                                       objective)
    cases = None
    if ruler_cases:
        cases = _ruler(cfg, mesh, params, tokenizer, run_dir, ruler_cases, args, summary, stats, main)
        summary["ruler"]["skipped"] = skipped
    if main:
        report.write(run_dir, step, summary, objective, ruler_cases, cases, tokenizer)
    return summary


def _measure(cfg: Config, mesh, params: dict, batches: list[dict], grid, encode, steps: tuple, step: int,
             main: bool) -> dict:
    """Validation loss, loss by position and passkey retrieval (`evaluate_params` with the compiled eval step and
    the shared per-token step, `steps`), with a progress bar; no validation with no batches (`--batches 0`)."""
    bar = tqdm(total=sequences_to_evaluate(cfg, batches, grid), desc="eval", unit="seq", dynamic_ncols=True,
               disable=not main)
    result = evaluate_params(cfg, mesh, params, batches, eval_step=steps[0], encode=encode, passkey=grid,
                             progress=bar.update, stats=steps[1])
    bar.close()
    summary = result.summary(step, grid)
    if not batches:
        summary.update(loss=None, perplexity=None, tokens=0, loss_by_position=[])
    return summary


def _ruler(cfg: Config, mesh, params: dict, tokenizer, run_dir: Path, ruler_cases: list, args: EvalOptions,
           summary: dict, stats, main: bool) -> list[dict]:
    """RULER's cases scored as `--ruler-scoring` says, into `summary["ruler"]` (teacher-forced by the shared
    per-token step `stats`); returns what the model answered to each case (`ruler_cases.csv`)."""
    bar = tqdm(total=len(ruler_cases), desc=f"ruler ({args.ruler_scoring})", unit="case", dynamic_ncols=True,
               disable=not main)
    if args.ruler_scoring == "generate":
        eos = stop_ids(tokenizer, data_lib.tokenizer_source(cfg, run_dir))
        outputs = ruler.outputs_on_mesh(cfg, mesh, params, tokenizer, ruler_cases, eos_ids=eos, progress=bar.update,
                                        prefill_bar=main)
        scores = ruler.score_outputs(ruler_cases, [g.text for g in outputs])
        case_rows = ruler.generation_case_rows(ruler_cases, outputs, scores)
    else:
        answers = ruler.answers_on_mesh(cfg, mesh, params, ruler_cases, stats=stats, progress=bar.update)
        scores = ruler.is_right(ruler_cases, answers)
        case_rows = ruler.case_rows(ruler_cases, answers, scores, tokenizer.decode)
    bar.close()
    rows = ruler.results(ruler_cases, scores)
    lengths = sorted({r["length"] for r in rows})
    by_length = {n: float(np.mean([r["score"] for r in rows if r["length"] == n])) for n in lengths}
    summary["ruler"] = {"scoring": args.ruler_scoring, "chat": bool(args.chat),
                        "tasks": list(dict.fromkeys(r["task"] for r in rows)), "lengths": lengths,
                        "cases": args.ruler_cases, "seed": cfg.seed, "rows": rows,
                        "mean": float(np.mean([r["score"] for r in rows])),
                        "by_length": {str(n): v for n, v in by_length.items()}}
    return case_rows


def evaluate_checkpoint(run_dir: str | Path, args: EvalOptions) -> tuple[dict, str]:
    """`resolve` and `evaluate` in this process (jax already started, e.g. by the trainer, on every process of a
    multi-process run): what a recipe's gate runs (`jaxlong.recipes.gates.run_gate`). Returns the summary (the same
    on every process) and the results directory `RUN_DIR/eval/<setup>/step_N`.

    Raises: what `resolve` and `evaluate` raise.
    """
    run_dir, step, cfg = resolve(run_dir, args)
    summary = evaluate(cfg, run_dir, step, args)
    return summary, str(run_dir / "eval" / summary["setup"]["name"] / f"step_{step}")


def ruler_suite(cfg, args: EvalOptions, tokenizer, source, held_out) -> tuple[list, list[str]]:
    """Every RULER case of `--ruler-tasks` x `--ruler-lengths` (`--ruler-cases` each, seeded by the run's `seed`),
    generated before anything compiles; corpus haystacks from the held-out documents `held_out` of `source`.
    Returns `(cases, notes)`: with default lengths, a (task, length) pair too short for the task is skipped
    with a note.

    Raises:
      ConfigError: a length given by `--ruler-lengths` is too short for a task, or the tokenizer is larger than
        `model.vocab_size`.
    """
    check_vocab(tokenizer, cfg.model.vocab_size)
    suite = ruler.RulerSuite(args.ruler_tasks_list, args.ruler_lengths_list, args.ruler_cases, cfg.seed,
                             args.ruler_scoring)
    corpus = ruler.suite_corpus(suite, (source[i] for i in held_out), tokenizer)
    cases, notes, short = [], [], []
    for n in suite.lengths:  # shortest first: a length too short for a task is found before longer cases are made
        for task in suite.tasks:
            try:
                if suite.scoring == "generate":
                    cases += ruler.generation_cases(task, tokenizer, n, suite.cases, seed=suite.seed, corpus=corpus,
                                                    chat=args.chat_template)
                else:
                    cases += ruler.make_cases(task, tokenizer, n, suite.cases, seed=suite.seed, corpus=corpus)
            except ValueError as e:
                (short if args.ruler_lengths else notes).append(
                    f"--ruler-lengths {n}: {e}" if args.ruler_lengths else
                    f"note: RULER {task} skipped at {n} tokens ({e})")
    if short:  # every (task, length) that is too short, at once
        raise ConfigError("; ".join(short))
    if not cases:
        raise ConfigError(f"--ruler: no task fits the lengths {suite.lengths}; give longer --ruler-lengths")
    return cases, notes


def passkey_lengths(cfg, args: EvalOptions, tokenizer) -> list[int]:
    """The passkey lengths to test: those of `--lengths`, or by default those of S/8, S/4, S/2, S that the mesh
    takes (`resolve`), less any too short for the passkey prompt under `tokenizer` (with a note when none is left).

    Raises:
      ConfigError: a length given by `--lengths` is too short for the prompt.
    """
    shortest = passkey_min_length(tokenizer.encode, args.digits)
    short = [n for n in args.lengths_list if n < shortest]
    if short and args.lengths:
        raise ConfigError(f"--lengths {','.join(map(str, short))}: a passkey length must hold the needle and the "
                          f"question, {shortest} tokens with this tokenizer and --digits {args.digits}")
    lengths = [n for n in args.lengths_list if n >= shortest]
    if not lengths:
        print(f"note: no passkey retrieval: seq_len {cfg.seq_len} cannot hold the passkey prompt ({shortest} "
              f"tokens); give --lengths of at least {shortest} that the mesh takes, or --no-passkey")
    return lengths


def evaluation_setup(cfg, run_dir: Path, step: int, mesh_shape: dict, args: EvalOptions) -> dict:
    """What sets an evaluation of checkpoint `step` apart from another of the same checkpoint, as recorded in its
    `summary.json`: `name` (its directory under `RUN_DIR/eval/`), `mesh` (the axes it ran on), `overrides` (the
    `key=value` given) and `flags` (those that differ from their defaults).

    `name` is `mesh_<data>x<fsdp>x<ring>x<context>`, followed by `-<8 hex digits>` (a hash of the config apart from
    the mesh, and of those flags) when the config differs from the checkpoint's in keys other than `mesh.*`,
    `model.from_hf` (where the tokenizer files are) and `imported`, or a flag is not at its default: the same setup
    has the same name, another setup another name.
    """
    saved = from_dict(saved_config(run_dir / "checkpoints", step))
    # model.from_hf only says where the tokenizer files are (the weights are the checkpoint's): not a setup
    same = dataclasses.replace(cfg, mesh=saved.mesh, model=dataclasses.replace(cfg.model, from_hf=saved.model.from_hf))
    mine, trained = to_dict(same), to_dict(saved)
    for d in (mine, trained):  # the digests of the run's tokenizer copy: checked, not a setup
        d.pop("imported")
    defaults = vars(EvalOptions())
    flags = {k: getattr(args, k) for k in ("batches", "lengths", "depths", "per_cell", "digits", "passkey", "ruler",
                                           "ruler_tasks", "ruler_lengths", "ruler_cases", "chat")
             if getattr(args, k) != defaults[k]}
    if args.ruler:  # the scoring is always part of a RULER setup: the two kinds of score never share a directory
        flags["ruler_scoring"] = args.ruler_scoring
    name = "mesh_" + "x".join(str(mesh_shape[a]) for a in ("data", "fsdp", "ring", "context"))
    if mine != trained or flags:
        name += "-" + hashlib.sha1(json.dumps([mine, flags], sort_keys=True).encode()).hexdigest()[:8]
    return {"name": name, "mesh": mesh_shape, "overrides": list(args.overrides), "flags": flags}
