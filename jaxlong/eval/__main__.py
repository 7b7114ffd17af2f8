"""Evaluate a training run: `python -m jaxlong.eval RUN_DIR [--step N] [options] [key=value ...]`.

Restores the latest (or `--step N`) checkpoint of `RUN_DIR` (e.g. `runs/default`) on the mesh of the config it
was trained with (`key=value` overrides change it, e.g. `mesh.context=8`), then measures:

* validation loss and perplexity on the held-out documents (the split the trainer used: `eval_fraction`, `seed`),
  with the AOT-compiled eval step (its memory_analysis is printed);
* loss by position: mean per-token loss of the same held-out sequences in log-spaced position buckets
  (0, 1, 2-3, 4-7, ..., up to seq_len), as a table, a CSV and a PNG;
* passkey retrieval, teacher-forced, on a needle depth x context length grid (`--depths`, `--lengths`), drawn as a
  heatmap;
* with `--ruler`, RULER's synthetic tasks (`jaxlong.evaluation.ruler`; `--ruler-tasks`, `--ruler-lengths`,
  `--ruler-cases`), scored as RULER scores them (`--ruler-scoring generate`, the default: RULER's prompts, greedy
  generation of RULER's tokens_to_generate on the run's mesh, string_match_all; `--chat` renders each prompt as a
  user turn of the checkpoint's chat template) or teacher-forced by exact match (`--ruler-scoring forced`, a
  cheap proxy): a table, `ruler.csv`, `ruler_cases.csv` (what the model wrote), `ruler.png` (score by task and
  length) and `eval/ruler_<scoring>/...` scalars. Corpus haystacks are cut from the held-out documents.

Each evaluation setup has its own directory, `RUN_DIR/eval/<setup>/`, named by the mesh it ran on
(`mesh_<data>x<fsdp>x<ring>x<context>`) and, when other config keys or flags differ from the run's config and the
flags' defaults, a short hash of them (`mesh_1x2x1x4-3f9a0c1e`): results go to `<setup>/step_N/` (`summary.json`,
which records the setup, `loss_by_position.{csv,png}`, `passkey.{csv,png}`) and to TensorBoard events in
`<setup>/` (`eval/loss`, `eval/perplexity`, `eval/passkey_accuracy`, `eval/loss_by_position/<start>`,
`eval/ruler_<scoring>/<task>/<length>`; one
TensorBoard run per setup, beside the trainer's). Evaluations of other setups never overwrite each other; the
same evaluation run again replaces its own results and events. Launched as several processes, as the trainer is
(`srun`, or `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; `jaxlong.core.distributed`), it
evaluates on one mesh over all of them and process 0 prints and writes the results. Examples:

    python -m jaxlong.eval runs/default
    python -m jaxlong.eval runs/default --step 20 --lengths 512,1024,2048,4096 --depths 0,0.5,1 --per-cell 8
    python -m jaxlong.eval runs/default --ruler --ruler-tasks niah_single_1,vt --ruler-lengths 1024,4096
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxlong.config import ConfigError, from_dict
from jaxlong.core.errors import ArgumentParser, fail
from jaxlong.core.units import fmt_bytes


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m jaxlong.eval", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory holding checkpoints/ (e.g. runs/default)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--batches", type=int, default=None, help="held-out batches (default: the run's eval_batches)")
    p.add_argument("--lengths", default="", help="passkey context lengths, comma-separated (default: those of "
                                                 "S/8,S/4,S/2,S that hold the passkey prompt and the mesh takes)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey needle depths in [0, 1]")
    p.add_argument("--per-cell", type=int, default=4, help="passkey examples per depth x length cell")
    p.add_argument("--digits", type=int, default=5, help="passkey digits")
    p.add_argument("--no-passkey", dest="passkey", action="store_false")
    p.add_argument("--ruler", action="store_true", help="run RULER's synthetic tasks (docs/evaluation.md#ruler)")
    p.add_argument("--ruler-tasks", default="", help="RULER tasks, comma-separated (default: all 11: "
                                                     "niah_single_1,...,vt,cwe,fwe)")
    p.add_argument("--ruler-lengths", default="", help="RULER context lengths, comma-separated (default: those of "
                                                       "S/8,S/4,S/2,S the mesh takes; pairs too short for a task "
                                                       "are skipped)")
    p.add_argument("--ruler-cases", type=int, default=8, help="RULER cases per task and length")
    p.add_argument("--ruler-scoring", choices=("generate", "forced"), default="generate",
                   help="generate (default, RULER's own): greedy generation of each task's tokens_to_generate, "
                        "scored by string_match_all; forced: teacher-forced exact match, a cheap proxy")
    p.add_argument("--chat", action="store_true", help="RULER by generation: each prompt as a user turn of the "
                                                       "checkpoint's chat template, the answer prefix opening the "
                                                       "assistant's turn")
    p.add_argument("overrides", nargs="*", help="config key=value overrides (e.g. mesh.context=8)")
    return p.parse_intermixed_args(argv)


def _committed_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())


def resolve(args) -> tuple[Path, int, object]:
    """(run dir, step, Config) from the arguments, before jax creates a backend.

    Raises:
      FileNotFoundError: no run directory, no checkpoint, or no checkpoint at `--step`.
      ConfigError: a bad override or option value.
    """
    run_dir = Path(args.run_dir)
    steps = _committed_steps(run_dir / "checkpoints")
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no checkpoint found in {run_dir / 'checkpoints'} (train first: "
                                f"python -m jaxlong.train run_name=...)")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise FileNotFoundError(f"--step {step}: no checkpoint at that step in {run_dir / 'checkpoints'}; have {steps}")
    config_file = run_dir / "checkpoints" / str(step) / "config" / "metadata"
    cfg = from_dict(json.loads(config_file.read_text()), args.overrides)
    check_flags(cfg, args)
    args.chat_template = chat_template(cfg, run_dir, args)
    return run_dir, step, cfg


def chat_template(cfg, run_dir: Path, args):
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
    from jaxlong.data import tokenizer_source  # noqa: PLC0415
    from jaxlong.data.chat import run_template  # noqa: PLC0415

    try:
        template = run_template(cfg.data.chat_template, tokenizer_source(cfg, run_dir), run_dir=run_dir)
    except ValueError as e:
        raise ConfigError(f"--chat: {e}") from None
    if template is None:
        raise ConfigError(f"--chat: {run_dir} has no chat template (its tokenizer's files have none and "
                          f"data.chat_template is not set); drop --chat")
    return template


def _positive(flag: str, value: int | None, default: int, what: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{flag}={value} must be positive; use {flag} {default} ({what})", key=flag, value=value,
                          suggestions=({flag: default},))


def _counts(flag: str, text: str, example: list[int]) -> list[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated token counts, e.g. {','.join(map(str, example))}",
                          key=flag, value=text, suggestions=({flag: ",".join(map(str, example))},)) from None


def check_flags(cfg, args) -> None:
    """Check the evaluation flags against the run's config `cfg`, before jax starts, and set `args.lengths_list`,
    `args.depths_list` (`resolve`) and the RULER flags' lists (`resolve_ruler`). `--fit`-like compiles are not
    part of it: every check here is arithmetic on the config.

    Raises:
      ConfigError: naming the flag, its value and, where a value would pass, the nearest that do in its
        `suggestions` (`{flag: value}`; for a list of lengths, a length to put in place of the bad one).
    """
    _positive("--batches", args.batches, cfg.eval_batches, "the run's eval_batches")
    _positive("--per-cell", args.per_cell, 4, "the default")
    _positive("--digits", args.digits, 5, "the default")
    defaults = [n for n in (cfg.seq_len // 8, cfg.seq_len // 4, cfg.seq_len // 2, cfg.seq_len) if _takes(cfg, n)]
    lengths = _counts("--lengths", args.lengths, defaults or [cfg.seq_len])
    if args.passkey and not lengths:  # the default: S/8, S/4, S/2, S, those the mesh takes
        lengths = defaults or [cfg.seq_len]
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
    from jaxlong.evaluation import ruler  # noqa: PLC0415

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
    _positive("--ruler-cases", args.ruler_cases, 8, "the default")
    defaults = [n for n in (cfg.seq_len // 8, cfg.seq_len // 4, cfg.seq_len // 2, cfg.seq_len)
                if n > 0 and _ruler_takes(cfg, n)] or [cfg.seq_len]
    lengths = _counts("--ruler-lengths", args.ruler_lengths, defaults)
    option = "--ruler-lengths"
    if not lengths:
        lengths, option = defaults, "--ruler-lengths (default: seq_len and the fractions of it the mesh takes)"
    # every length checked, every problem named, before a case is generated
    ruler.check_lengths(cfg, lengths, option, cases=args.ruler_cases, tasks=len(args.ruler_tasks_list))
    args.ruler_lengths_list = sorted(set(lengths))


def _ruler_takes(cfg, length: int) -> bool:
    from jaxlong.evaluation import ruler  # noqa: PLC0415

    try:
        ruler.check_length(cfg, length)
    except ConfigError:
        return False
    return True


def check_passkey_length(cfg, length: int) -> None:
    """A passkey length must be at least 64 tokens and a sequence length the run's mesh takes (the sequence
    rules of `jaxlong.config.validate`: divisible by mesh.context, by 2 * mesh.ring * mesh.context under ring
    attention, by `tiling.mlp_tiles` per device).

    Raises:
      ConfigError: naming `--lengths`, the length, the rule it breaks and the nearest lengths that pass
        (`suggestions`, `{"--lengths": n}`: a length to put in its place).
    """
    from jaxlong.core.suggest import nearest  # noqa: PLC0415

    why = _passkey_refusal(cfg, length)
    if why is None:
        return
    unit = max(cfg.mesh.context, 1) * (2 * cfg.mesh.ring if cfg.mesh.ring > 1 else 1)
    near = nearest(lambda n: _takes(cfg, n), length, step=unit, lo=unit, tries=256)
    raise ConfigError(f"--lengths {length}: {why}" + (f"; nearby lengths it takes: {' or '.join(map(str, near))}"
                                                      if near else ""),
                      key="--lengths", value=length, suggestions=tuple({"--lengths": n} for n in near))


def _passkey_refusal(cfg, length: int) -> str | None:
    """Why `length` cannot be a passkey length of this run, or None."""
    from dataclasses import replace  # noqa: PLC0415

    from jaxlong.config import refusal  # noqa: PLC0415

    if length < 64:
        return "a passkey length must be >= 64 tokens (the needle and question)"
    # the loss tile is chosen per length by the stats step; every other sequence rule applies
    rule = refusal(replace(cfg, seq_len=length, tiling=replace(cfg.tiling, loss_tile=0)))
    return None if rule is None else f"not a sequence length this mesh takes ({rule})"


def _takes(cfg, length: int) -> bool:
    return _passkey_refusal(cfg, length) is None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run_dir, step, cfg = resolve(args)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        return fail(e)
    from jaxlong.core import distributed  # noqa: PLC0415

    from jaxlong.core import liveness  # noqa: PLC0415

    try:  # several processes (srun, or JAX_COORDINATOR_ADDRESS ...): one mesh over them
        distributed.start(cfg.mesh, cfg.lost_process_timeout_s)
        run(cfg, run_dir, step, args)
    except (FileNotFoundError, ValueError) as e:  # a bad override, a corpus that cannot be read
        return fail(e)
    except Exception:  # a collective that failed because another process died: its one line
        liveness.explain_failure()
        raise
    finally:
        liveness.stop_watchdog()
    return 0


def evaluate_checkpoint(argv: list[str]) -> tuple[dict, str]:
    """`python -m jaxlong.eval ARGV` in this process (jax already started, e.g. by the trainer, on every process of
    a multi-process run): what a recipe's gate runs (`jaxlong.training.gates.run_gate`). Returns the summary (the
    same on every process) and the results directory `RUN_DIR/eval/<setup>/step_N`.

    Raises: what `resolve` and `run` raise.
    """
    args = parse_args(argv)
    run_dir, step, cfg = resolve(args)
    summary = run(cfg, run_dir, step, args)
    return summary, str(run_dir / "eval" / summary["setup"]["name"] / f"step_{step}")


def run(cfg, run_dir: Path, step: int, args) -> dict:
    """Evaluate checkpoint `step` of `run_dir` under `cfg`; writes the results and returns the summary dict.

    Raises:
      ConfigError: the checkpoint does not fit `cfg` (a changed model key: the message names it).
      ValueError: the held-out documents cannot fill the batches.
    """
    import jax  # noqa: PLC0415 (after the device count is set)
    import numpy as np  # noqa: PLC0415
    from tensorboardX import SummaryWriter  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    from jaxlong import data as data_lib  # noqa: PLC0415
    from jaxlong import evaluation as ev  # noqa: PLC0415
    from jaxlong.config import validate  # noqa: PLC0415
    from jaxlong.core.memstats import format_compiled  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh, check_process_layout, run_devices  # noqa: PLC0415

    devices = run_devices(cfg.mesh)
    validate(cfg, num_devices=len(devices), platform=devices[0].platform)
    mesh = build_mesh(cfg.mesh)
    check_process_layout(mesh)
    main = jax.process_index() == 0  # process 0 prints and writes; every process computes
    say = print if main else (lambda *a, **k: None)
    tokenizer = data_lib.run_tokenizer(cfg, run_dir)  # the trainer's: the run's copy, then model.from_hf
    lengths = passkey_lengths(cfg, args, tokenizer) if args.passkey else []
    source = data_lib.first_source(cfg, tokenizer)  # data.path, or the first of data.sources
    if not cfg.eval_every:
        what = "pairs" if cfg.objective == "dpo" else "documents"
        say(f"note: the run trained with eval_every=0, on every document: the {what} evaluated here were trained on, "
            f"not held out")
    from jaxlong.training.reference import needs_reference, prepare_reference  # noqa: PLC0415

    if needs_reference(cfg):  # the reference log-probs the run computed when its stage started
        prepare_reference(cfg, mesh, run_dir, source, tokenizer, None, say=say)
    # The trainer's held-out split; more batches than it used take more documents (the same ones first).
    held_out, batches = ev.validation_split(cfg, source, tokenizer, args.batches)
    if args.ruler:  # the host memory the forwards need, where the devices are this host's CPU (compiled, AOT)
        from jaxlong.evaluation import hostmem, ruler  # noqa: PLC0415

        generate = args.ruler_scoring == "generate"
        estimates = hostmem.check_lengths(cfg, mesh, args.ruler_lengths_list,
                              rows=(lambda n: ruler.rows_per_batch(cfg, n)) if generate else ev.eval_batch_size(cfg),
                              max_new=max(ruler.TOKENS_TO_GENERATE.values()) if generate else None,
                              cases=args.ruler_cases * len(args.ruler_tasks_list))
        for n, est in estimates.items():  # the long lengths, compiled for: what the guard passed, and why
            loop = f", {fmt_bytes(est.loop)} over {est.steps:,} kv steps per device and layer" if est.loop else ""
            say(f"host memory at {n} tokens: about {fmt_bytes(est.total)} estimated, this host has "
                f"{fmt_bytes(hostmem.host_limit())} ({est.devices} CPU device(s) x {fmt_bytes(est.per_device)} "
                f"compiled{loop}, {fmt_bytes(est.host)} of host arrays, {fmt_bytes(est.base)} in use)")
    ruler_cases, skipped = ruler_suite(cfg, args, tokenizer, source, held_out) if args.ruler else ([], [])
    for note in skipped:
        say(note)
    params = restore_params(cfg, mesh, run_dir, step)
    compiled = ev.compile_eval_step(cfg, mesh)
    say(format_compiled(compiled, "eval step"))
    say(f"restored {run_dir / 'checkpoints' / str(step)}; mesh {dict(mesh.shape)}, seq_len {cfg.seq_len}")

    grid = ev.PasskeyGrid(lengths, args.depths_list, args.per_cell, args.digits) if lengths else None
    bar = tqdm(total=ev.sequences_to_evaluate(cfg, batches, grid), desc="eval", unit="seq", dynamic_ncols=True,
               disable=not main)
    stats = ev.token_stats(cfg, mesh)  # one jitted program per batch shape, shared by the probes
    result = ev.evaluate_params(cfg, mesh, params, batches, eval_step=compiled, encode=tokenizer.encode,
                                passkey=grid, progress=bar.update, stats=stats)
    bar.close()
    setup = evaluation_setup(cfg, run_dir, step, dict(mesh.shape), args)
    summary = {**result.summary(step, grid), "setup": setup}
    if cfg.objective == "dpo":  # the held-out pairs' DPO loss and TRL's reward metrics
        summary["dpo"] = ev.evaluate_preference(ev.make_preference_eval_step(cfg, mesh), params, batches, mesh)
    if ruler_cases:
        from jaxlong.evaluation import ruler  # noqa: PLC0415

        bar = tqdm(total=len(ruler_cases), desc=f"ruler ({args.ruler_scoring})", unit="case", dynamic_ncols=True,
                   disable=not main)
        if args.ruler_scoring == "generate":
            from jaxlong.generation.generate import stop_ids  # noqa: PLC0415

            eos = stop_ids(tokenizer, data_lib.tokenizer_source(cfg, run_dir))
            outputs = ruler.outputs_on_mesh(cfg, mesh, params, tokenizer, ruler_cases, eos_ids=eos,
                                            progress=bar.update, prefill_bar=main)
            scores = ruler.score_outputs(ruler_cases, [g.text for g in outputs])
            ruler_case_rows = ruler.generation_case_rows(ruler_cases, outputs, scores)
        else:
            answers = ruler.answers_on_mesh(cfg, mesh, params, ruler_cases, stats=stats, progress=bar.update)
            scores = ruler.is_right(ruler_cases, answers)
            ruler_case_rows = ruler.case_rows(ruler_cases, answers, scores, tokenizer.decode)
        bar.close()
        rows = ruler.results(ruler_cases, scores)
        lengths = sorted({r["length"] for r in rows})
        by_length = {n: float(np.mean([r["score"] for r in rows if r["length"] == n])) for n in lengths}
        summary["ruler"] = {"scoring": args.ruler_scoring, "chat": bool(args.chat),
                            "tasks": list(dict.fromkeys(r["task"] for r in rows)), "lengths": lengths,
                            "cases": args.ruler_cases, "seed": cfg.seed, "rows": rows,
                            "mean": float(np.mean([r["score"] for r in rows])),
                            "by_length": {str(n): v for n, v in by_length.items()}, "skipped": skipped}
    if not main:
        return summary
    setup_dir = run_dir / "eval" / setup["name"]
    out = setup_dir / f"step_{step}"
    write_results(out, summary)
    for old in setup_dir.glob(f"events.out.tfevents.*.step_{step}"):  # this evaluation's earlier run: replaced
        old.unlink()
    writer = SummaryWriter(str(setup_dir), filename_suffix=f".step_{step}")
    writer.add_scalar("eval/loss", result.loss, step)
    writer.add_scalar("eval/perplexity", result.perplexity, step)
    for row in summary["loss_by_position"]:
        if not row["tokens"]:  # no target counted at these positions (chat data: the prompt's)
            continue
        writer.add_scalar(f"eval/loss_by_position/{row['start']:08d}", row["loss"], step)
    if result.passkey is not None:
        writer.add_scalar("eval/passkey_accuracy", float(np.mean(result.passkey)), step)
    for k, v in summary.get("dpo", {}).items():
        if k != "pairs":
            writer.add_scalar(f"eval/dpo/{k}", v, step)
    if "ruler" in summary:
        from jaxlong.evaluation import ruler  # noqa: PLC0415

        rl = summary["ruler"]
        ruler.log_scalars(writer, rl["rows"], step, ruler.tag_prefix(rl["scoring"]))
        ruler.write_results(out, rl["rows"], f"RULER ({rl['scoring']}), step {step}", cases=ruler_case_rows)
    writer.close()
    print(format_summary(summary))
    print(f"results in {out}/ and TensorBoard (tensorboard --logdir {run_dir})")
    return summary


def ruler_suite(cfg, args, tokenizer, source, held_out) -> tuple[list, list[str]]:
    """Every RULER case of `--ruler-tasks` x `--ruler-lengths` (`--ruler-cases` each, seeded by the run's `seed`),
    generated before anything compiles; corpus haystacks from the held-out documents `held_out` of `source`.
    Returns `(cases, notes)`: with default lengths, a (task, length) pair too short for the task is skipped
    with a note.

    Raises:
      ConfigError: a length given by `--ruler-lengths` is too short for a task, or the tokenizer is larger than
        `model.vocab_size`.
    """
    from jaxlong.data.tokenizer import check_vocab  # noqa: PLC0415
    from jaxlong.evaluation import ruler  # noqa: PLC0415

    try:
        check_vocab(tokenizer, cfg.model.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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


def passkey_lengths(cfg, args, tokenizer) -> list[int]:
    """The passkey lengths to test: those of `--lengths`, or by default those of S/8, S/4, S/2, S that the mesh
    takes (`resolve`), less any too short for the passkey prompt under `tokenizer` (with a note when none is left).

    Raises:
      ConfigError: a length given by `--lengths` is too short for the prompt.
    """
    from jaxlong import evaluation as ev  # noqa: PLC0415

    shortest = ev.passkey_min_length(tokenizer.encode, args.digits)
    short = [n for n in args.lengths_list if n < shortest]
    if short and args.lengths:
        raise ConfigError(f"--lengths {','.join(map(str, short))}: a passkey length must hold the needle and the "
                          f"question, {shortest} tokens with this tokenizer and --digits {args.digits}")
    lengths = [n for n in args.lengths_list if n >= shortest]
    if not lengths:
        print(f"note: no passkey retrieval: seq_len {cfg.seq_len} cannot hold the passkey prompt ({shortest} "
              f"tokens); give --lengths of at least {shortest} that the mesh takes, or --no-passkey")
    return lengths


def evaluation_setup(cfg, run_dir: Path, step: int, mesh_shape: dict, args) -> dict:
    """What sets an evaluation of checkpoint `step` apart from another of the same checkpoint, as recorded in its
    `summary.json`: `name` (its directory under `RUN_DIR/eval/`), `mesh` (the axes it ran on), `overrides` (the
    `key=value` given) and `flags` (those that differ from their defaults).

    `name` is `mesh_<data>x<fsdp>x<ring>x<context>`, followed by `-<8 hex digits>` (a hash of the config apart from
    the mesh, and of those flags) when the config differs from the checkpoint's in keys other than `mesh.*`,
    `model.from_hf` (where the tokenizer files are) and `imported`, or a flag is not at its default: the same setup has the same
    name, another setup another name.
    """
    import dataclasses  # noqa: PLC0415
    import hashlib  # noqa: PLC0415

    from jaxlong.config import to_dict  # noqa: PLC0415
    from jaxlong.training.checkpoint import saved_config  # noqa: PLC0415

    saved = from_dict(saved_config(run_dir / "checkpoints", step))
    # model.from_hf only says where the tokenizer files are (the weights are the checkpoint's): not a setup
    same = dataclasses.replace(cfg, mesh=saved.mesh, model=dataclasses.replace(cfg.model, from_hf=saved.model.from_hf))
    mine, trained = to_dict(same), to_dict(saved)
    for d in (mine, trained):  # the digests of the run's tokenizer copy: checked, not a setup
        d.pop("imported")
    defaults = vars(parse_args([str(run_dir)]))
    flags = {k: getattr(args, k) for k in ("batches", "lengths", "depths", "per_cell", "digits", "passkey", "ruler",
                                           "ruler_tasks", "ruler_lengths", "ruler_cases", "chat")
             if getattr(args, k) != defaults[k]}
    if args.ruler:  # the scoring is always part of a RULER setup: the two kinds of score never share a directory
        flags["ruler_scoring"] = args.ruler_scoring
    name = "mesh_" + "x".join(str(mesh_shape[a]) for a in ("data", "fsdp", "ring", "context"))
    if mine != trained or flags:
        name += "-" + hashlib.sha1(json.dumps([mine, flags], sort_keys=True).encode()).hexdigest()[:8]
    return {"name": name, "mesh": mesh_shape, "overrides": list(args.overrides), "flags": flags}


def restore_params(cfg, mesh, run_dir: Path, step: int) -> dict:
    """The parameters of checkpoint `step` of `run_dir`, FSDP-sharded on `mesh` (the optimizer state is read and
    dropped). The parameter shapes are checked on the checkpoint's metadata first.

    Raises:
      ConfigError: the shapes differ (the message names the changed `model.*` keys), or orbax cannot read it.
    """
    from jaxlong.config import Config, to_dict  # noqa: PLC0415
    from jaxlong.training import step as step_lib  # noqa: PLC0415
    from jaxlong.training.checkpoint import Checkpointer, StateMismatch, mismatch_message, saved_config  # noqa: PLC0415

    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=10**9)
    try:
        _, state = ckpt.restore(step_lib.abstract_state(cfg, mesh), step)
    except StateMismatch as e:
        raise ConfigError(mismatch_message(e, saved_config(run_dir / "checkpoints", step), to_dict(cfg),
                                           to_dict(Config())) + " (drop the override)") from None
    except Exception as e:  # noqa: BLE001 (orbax's errors are long; one line names the checkpoint)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"checkpoint {run_dir / 'checkpoints' / str(step)} could not be restored "
                          f"({type(e).__name__}: {first})") from None
    finally:
        ckpt.close()
    return state["params"]


def format_summary(summary: dict) -> str:
    lines = [f"step {summary['step']}: validation loss {summary['loss']:.4f} nats/token, perplexity "
             f"{summary['perplexity']:.3f} ({summary['tokens']:.0f} tokens)", "", "loss by position:",
             f"{'positions':>18}  {'tokens':>9}  {'loss':>7}"]
    for r in summary["loss_by_position"]:
        lines.append(f"{r['start']:>8}-{r['end'] - 1:<9}  {r['tokens']:>9}  {r['loss']:7.4f}")
    if "dpo" in summary:
        d = summary["dpo"]
        lines += ["", f"held-out pairs ({d['pairs']:.0f}): DPO loss {d['loss']:.4f}, rewards/accuracies "
                      f"{d['rewards/accuracies']:.3f}, rewards/margins {d['rewards/margins']:.4f} (chosen "
                      f"{d['rewards/chosen']:.4f}, rejected {d['rewards/rejected']:.4f})"]
    if "passkey" in summary:
        pk = summary["passkey"]
        lines += ["", f"passkey retrieval ({pk['digits']} digits, {pk['per_cell']} per cell; rows: depth, columns: "
                      f"length), mean {pk['mean']:.3f}:",
                  f"{'depth':>6}  " + "  ".join(f"{n:>7}" for n in pk["lengths"])]
        for d, row in zip(pk["depths"], pk["accuracy"]):
            lines.append(f"{d:>6.2f}  " + "  ".join(f"{a:>7.2f}" for a in row))
        if pk["mean"] < 0.05:
            lines.append(f"passkey retrieval is at chance level (guessing all {pk['digits']} digits: "
                         f"{10.0 ** -pk['digits']:.0e}): the model has not learned to copy a fact from far back in "
                         f"its context, as small models trained briefly on text do not; a pretrained model "
                         f"(model.from_hf) or training on retrieval data (experiments/passkey.py) would")
    if "ruler" in summary:
        from jaxlong.evaluation import ruler  # noqa: PLC0415

        rl = summary["ruler"]
        how = ("by greedy generation, RULER's string_match_all" + (" (chat)" if rl.get("chat") else "")
               if rl["scoring"] == "generate" else "teacher-forced exact match")
        lines += ["", f"RULER {how}, % ({rl['cases']} cases per task and length), mean "
                      f"{100 * rl['mean']:.1f}:", ruler.format_table(rl["rows"])]
    return "\n".join(lines)


def write_results(out: Path, summary: dict) -> None:
    """`summary.json`, `loss_by_position.csv/.png` and (with passkey results) `passkey.csv/.png` under `out`."""
    import csv  # noqa: PLC0415

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    rows = summary["loss_by_position"]
    with open(out / "loss_by_position.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["start", "end", "tokens", "loss"])
        w.writeheader()
        w.writerows(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([max(r["start"], 0.5) for r in rows], [r["loss"] for r in rows], "o-")
    ax.set(xscale="log", xlabel="token position (bucket start)", ylabel="mean loss (nats/token)",
           title=f"loss by position, step {summary['step']}")
    fig.tight_layout()
    fig.savefig(out / "loss_by_position.png", dpi=110)
    plt.close(fig)
    if "passkey" not in summary:
        return
    pk = summary["passkey"]
    with open(out / "passkey.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["depth", *pk["lengths"]])
        for d, row in zip(pk["depths"], pk["accuracy"]):
            w.writerow([d, *row])
    fig, ax = plt.subplots(figsize=(1.2 * len(pk["lengths"]) + 2, 0.5 * len(pk["depths"]) + 2))
    im = ax.imshow(pk["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(pk["lengths"])), [str(n) for n in pk["lengths"]])
    ax.set_yticks(range(len(pk["depths"])), [f"{d:.2f}" for d in pk["depths"]])
    for i, row in enumerate(pk["accuracy"]):
        for j, a in enumerate(row):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
    ax.set(xlabel="context length (tokens)", ylabel="needle depth", title=f"passkey retrieval, step {summary['step']}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "passkey.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
