"""Gates: an evaluation at the end of a recipe's stage, with a threshold per metric and an action.

A context-extension stage is worth going on from only if the model still does what the stage was for: its
held-out loss at the new length, retrieval of a fact planted far back (passkey), RULER's tasks (Hsieh et al., arXiv
2404.06654). A stage's `gate:` (docs/recipes.md#gates) names thresholds and what to do when one is missed:

    gate:
      max: {loss: 3.2}                               # held-out loss, nats/token
      min: {passkey: 0.9, ruler/niah_single_1: 0.5}  # accuracies in [0, 1]
      action: stop                                   # or warn: print the failure and go on
      ruler_lengths: [4096]                          # default: the stage's seq_len
      ruler_scoring: generate                        # default; or forced (teacher-forced, the cheap proxy)

Metrics: `loss`, `perplexity`, `passkey` (mean over the grid), `passkey/<length>` (mean over depths), `ruler`
(mean over every task and length), `ruler/<task>` (mean over lengths), `ruler/<task>/<length>`; on a stage whose
objective has held-out metrics of its own, those (`Objective.gate_metrics`: a DPO stage's `dpo/loss` and
`dpo/rewards/{accuracies,margins,chosen,rejected}`, docs/post-training.md). The evaluation is
`python -m jaxlong.eval`'s on the stage's last checkpoint, its own mesh and length, run in the trainer's processes
(`evaluate_gate`, `jaxlong.evaluation.checkpoint.evaluate_checkpoint`):
its results go where that command puts them (`RUN/eval/<setup>/step_N/`: summary.json, CSV, PNG; TensorBoard).
Passkey runs when a `passkey*` metric or `passkey_lengths` is given, RULER when a `ruler*` metric or
`ruler_tasks` is; RULER scores by greedy generation (RULER's string_match_all) unless `ruler_scoring: forced`. The
metrics are recorded in `RUN/gates/stage<i>.json` with the RULER scoring that made them; a resumed recipe decides
again from the record under the recipe's current thresholds (a loosened threshold or `action: warn` lets it go on)
and evaluates again only when the record lacks a metric, belongs to another step (the stage was lengthened) or
to another RULER scoring.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from pathlib import Path
from typing import Callable

import jax

from jaxlong import data as data_lib
from jaxlong.config import Config, ConfigError, objective_of
from jaxlong.core.errors import GATE_FAILED
from jaxlong.evaluation import FILLER, passkey_min_length, ruler
from jaxlong.evaluation.checkpoint import EvalOptions, evaluate_checkpoint
from jaxlong.objectives.registry import OBJECTIVES

__all__ = ["Gate", "GateFailed", "check_prompt", "parse_gate", "gate_metrics", "decide", "run_gate", "evaluate_gate"]

ACTIONS = ("stop", "warn")
OPTIONS = ("min", "max", "action", "batches", "passkey_lengths", "depths", "per_cell", "ruler_tasks",
           "ruler_lengths", "ruler_cases", "ruler_scoring")
# The held-out metrics of the objectives that have their own (`Objective.gate_metrics`), each under its objective's
# key: a DPO stage's `dpo/loss`, `dpo/rewards/...`.
OBJECTIVE_METRICS = {f"{c.summary_key}/{m}": c for c in OBJECTIVES.values() for m in c.gate_metrics}
METRIC_FORMS = ("loss, perplexity, passkey, passkey/<length>, ruler, ruler/<task>, ruler/<task>/<length>" + "".join(
    f", and on a stage with objective: {c.name} its held-out {c.records}' "
    + ", ".join(f"{c.summary_key}/{m}" for m in c.gate_metrics) for c in OBJECTIVES.values() if c.gate_metrics))


class GateFailed(Exception):
    """A stage's gate with `action: stop` missed a threshold: the recipe stops (exit status `EXIT_CODE`) after the
    stage's checkpoint; the message is the one line naming the gate, the metric, the value and how to go on."""

    EXIT_CODE = GATE_FAILED


@dataclasses.dataclass
class Gate:
    """A stage's gate: thresholds `min`/`max` (metric -> value), `action` (`stop` | `warn`) and the evaluation's
    options, as `python -m jaxlong.eval`'s flags: `batches` of held-out documents (None: the run's `eval_batches`),
    passkey `passkey_lengths` (tokens; [] with a passkey metric: the stage's seq_len), `depths`, `per_cell`;
    RULER `ruler_tasks` ([] with a ruler metric: the tasks the metrics name, else all), `ruler_lengths` (tokens;
    default the stage's seq_len), `ruler_cases` per task and length, `ruler_scoring` (`generate` | `forced`)."""

    min: dict[str, float] = dataclasses.field(default_factory=dict)
    max: dict[str, float] = dataclasses.field(default_factory=dict)
    action: str = "stop"
    batches: int | None = None
    passkey_lengths: list[int] = dataclasses.field(default_factory=list)
    depths: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    per_cell: int = 4
    ruler_tasks: list[str] = dataclasses.field(default_factory=list)
    ruler_lengths: list[int] = dataclasses.field(default_factory=list)
    ruler_cases: int = 8
    ruler_scoring: str = "generate"

    @property
    def metrics(self) -> list[str]:
        return [*self.min, *self.max]

    @property
    def passkey(self) -> bool:
        return bool(self.passkey_lengths) or any(m.split("/")[0] == "passkey" for m in self.metrics)

    @property
    def ruler(self) -> bool:
        return bool(self.ruler_tasks) or any(m.split("/")[0] == "ruler" for m in self.metrics)


def parse_gate(raw, cfg: Config) -> Gate:
    """The `Gate` of a stage's `gate:` mapping, checked against the stage's config `cfg` (its mesh and seq_len)
    before anything compiles, with the defaults filled in.

    Raises:
      ConfigError: one line: an unknown key or action, a metric not of the forms above, a RULER task that does not
        exist, a threshold that is not a number (an accuracy outside [0, 1]), a length the stage's mesh cannot
        take, a metric's length the evaluation does not run.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"gate: {raw!r}; give a mapping, e.g. {{max: {{loss: 3.0}}, action: stop}}")
    unknown = [k for k in raw if k not in OPTIONS]
    if unknown:
        raise ConfigError(f"gate: unknown key(s) {', '.join(map(str, unknown))}; the keys are {', '.join(OPTIONS)}")
    gate = Gate(**raw)  # every key is a field (OPTIONS)
    if gate.ruler_scoring not in ruler.SCORINGS:
        raise ConfigError(f"gate.ruler_scoring={gate.ruler_scoring!r}; choose generate (RULER's: greedy generation, "
                          f"string_match_all) or forced (teacher-forced exact match, a cheap proxy)")
    if gate.action not in ACTIONS:
        raise ConfigError(f"gate.action={gate.action!r}; choose stop (end the recipe) or warn (print and go on)")
    for bound in ("min", "max"):
        table = getattr(gate, bound)
        if not isinstance(table, dict):
            raise ConfigError(f"gate.{bound}: {table!r}; give a mapping of metric to threshold, e.g. {{loss: 3.0}}")
        for metric, value in table.items():
            _check_metric(f"gate.{bound}.{metric}", str(metric), value, ruler.TASKS)
    for key in ("passkey_lengths", "ruler_lengths", "ruler_tasks", "depths"):
        if not isinstance(getattr(gate, key), list):
            raise ConfigError(f"gate.{key}: {getattr(gate, key)!r}; give a list")
    bad_tasks = [t for t in gate.ruler_tasks if t not in ruler.TASKS]
    if bad_tasks:
        raise ConfigError(f"gate.ruler_tasks: unknown task(s) {', '.join(map(str, bad_tasks))}; choose from "
                          f"{', '.join(ruler.TASKS)}")
    for key in ("per_cell", "ruler_cases") + (("batches",) if gate.batches is not None else ()):
        value = getattr(gate, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"gate.{key}={value!r}; give a positive integer")
    if any(not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in gate.depths):
        raise ConfigError(f"gate.depths={gate.depths}: needle depths must be numbers in [0, 1]")
    objective = objective_of(cfg)
    other = [m for m in gate.metrics if m in OBJECTIVE_METRICS and OBJECTIVE_METRICS[m] is not type(objective)]
    if other:
        c = OBJECTIVE_METRICS[other[0]]
        raise ConfigError(f"gate: a threshold on {other[0]}, but the stage trains with objective={cfg.objective}; "
                          f"{c.title}'s metrics are for a stage with objective: {c.name}")
    held_out = [m for m in gate.metrics if m in ("loss", "perplexity", *OBJECTIVE_METRICS)]
    if held_out and not cfg.eval_every:
        raise ConfigError(f"gate: a threshold on {held_out[0]} needs documents held out from training, and the stage "
                          f"has eval_every=0 (it trains on every document); set the stage's eval_every, e.g. to its "
                          f"steps (one validation at its end)")
    if gate.passkey and not gate.passkey_lengths:
        gate.passkey_lengths = [cfg.seq_len]
    if gate.ruler:
        gate.ruler_lengths = gate.ruler_lengths or [cfg.seq_len]
        named = [m.split("/")[1] for m in gate.metrics if m.startswith("ruler/")]
        gate.ruler_tasks = gate.ruler_tasks or list(dict.fromkeys(named)) or list(ruler.TASKS)
        missing = [t for t in named if t not in gate.ruler_tasks]
        if missing:
            raise ConfigError(f"gate: a threshold on ruler/{missing[0]} but gate.ruler_tasks {gate.ruler_tasks} "
                              f"leaves it out; add it to ruler_tasks")
    _check_lengths(gate, cfg)
    return gate


def _check_metric(where: str, metric: str, value, tasks) -> None:
    parts = metric.split("/")
    ok = (metric in ("loss", "perplexity", "passkey", "ruler", *OBJECTIVE_METRICS)
          or (parts[0] == "passkey" and len(parts) == 2 and parts[1].isdigit())
          or (parts[0] == "ruler" and len(parts) in (2, 3) and (len(parts) == 2 or parts[2].isdigit())))
    if not ok:
        raise ConfigError(f"{where}: unknown metric {metric!r}; the metrics are {METRIC_FORMS}")
    if parts[0] == "ruler" and len(parts) > 1 and parts[1] not in tasks:
        raise ConfigError(f"{where}: RULER has no task {parts[1]!r}; choose from {', '.join(tasks)}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{where}={value!r}; give a number")
    if parts[0] in ("passkey", "ruler") and not 0 <= value <= 1:
        raise ConfigError(f"{where}={value}: {parts[0]} scores are accuracies in [0, 1]")


def _check_lengths(gate: Gate, cfg: Config) -> None:
    for key in ("passkey_lengths", "ruler_lengths"):
        for n in getattr(gate, key):
            if not isinstance(n, int) or isinstance(n, bool) or n < 64:
                raise ConfigError(f"gate.{key} {n!r}: give token counts >= 64")
    # sequence lengths the stage's mesh takes, every problem named with nearby lengths; the host memory the cases
    # need is checked by the evaluation itself, on the machine that trains (a recipe is planned on another)
    anywhere = 1 << 62
    if gate.passkey_lengths:
        ruler.check_lengths(cfg, gate.passkey_lengths, "gate.passkey_lengths", host_bytes=anywhere)
    if gate.ruler:
        ruler.check_lengths(cfg, gate.ruler_lengths, "gate.ruler_lengths", host_bytes=anywhere)
    for metric in gate.metrics:
        parts = metric.split("/")
        length = int(parts[-1]) if parts[-1].isdigit() else None
        runs = gate.passkey_lengths if parts[0] == "passkey" else gate.ruler_lengths
        if length is not None and length not in runs:
            raise ConfigError(f"gate: a threshold on {metric} but the gate evaluates {parts[0]} at {runs}; add "
                              f"{length} to {parts[0]}_lengths")


def check_prompt(gate: Gate, cfg: Config) -> None:
    """Refuse, before the recipe trains, a gate length too short for its prompts under the stage's tokenizer: a
    passkey length that cannot hold the needle and question, a RULER length too short for a task's fixed parts
    (one case of each task is generated at the gate's shortest RULER length when that is at most 64K tokens;
    longer ones hold any task's fixed parts). The other rules are `parse_gate`'s.

    Raises:
      ConfigError: naming `gate.passkey_lengths` or `gate.ruler_lengths`, the length and the least that works.
    """
    if not (gate.passkey or gate.ruler):
        return
    tokenizer = data_lib.run_tokenizer(cfg)
    if gate.passkey:
        shortest = passkey_min_length(tokenizer.encode, 5)
        short = [n for n in gate.passkey_lengths if n < shortest]
        if short:
            raise ConfigError(f"gate.passkey_lengths {','.join(map(str, short))}: a passkey length must hold the "
                              f"needle and the question, {shortest} tokens with this tokenizer")
    n = min(gate.ruler_lengths or [1 << 30])
    if gate.ruler and n <= 1 << 16:
        corpus = ruler.corpus_tokens([FILLER * (2 * n // len(FILLER) + 1)], tokenizer, 2 * n)
        problems, cases = [], ruler.generation_cases if gate.ruler_scoring == "generate" else ruler.make_cases
        for task in gate.ruler_tasks:
            try:
                cases(task, tokenizer, n, 1, seed=cfg.seed, corpus=corpus)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ConfigError(f"gate.ruler_lengths {n}: {'; '.join(problems)}")


def evaluate_gate(gate: Gate, run_dir: Path, step: int) -> tuple[dict, str]:
    """The evaluation of `gate` on checkpoint `step` of `run_dir`, in this process (every process of the run):
    `python -m jaxlong.eval`'s (`jaxlong.evaluation.checkpoint.evaluate_checkpoint`, with the options `eval_argv`
    gives as flags). Returns its summary and results directory."""
    options = EvalOptions(step=step, batches=gate.batches, passkey=gate.passkey, ruler=gate.ruler)
    if gate.passkey:
        options.lengths = ",".join(map(str, gate.passkey_lengths))
        options.depths, options.per_cell = ",".join(map(str, gate.depths)), gate.per_cell
    if gate.ruler:
        options.ruler_tasks, options.ruler_lengths = ",".join(gate.ruler_tasks), ",".join(map(str, gate.ruler_lengths))
        options.ruler_cases, options.ruler_scoring = gate.ruler_cases, gate.ruler_scoring
    return evaluate_checkpoint(run_dir, options)


def eval_argv(gate: Gate, run_dir: Path, step: int) -> list[str]:
    """The `python -m jaxlong.eval` command line (after the program name) that evaluates `gate` on checkpoint
    `step` of `run_dir`: what a user types to run the same evaluation by hand."""
    argv = [str(run_dir), "--step", str(step)]
    if gate.batches is not None:
        argv += ["--batches", str(gate.batches)]
    if gate.passkey:
        argv += ["--lengths", ",".join(map(str, gate.passkey_lengths)),
                 "--depths", ",".join(map(str, gate.depths)), "--per-cell", str(gate.per_cell)]
    else:
        argv.append("--no-passkey")
    if gate.ruler:
        argv += ["--ruler", "--ruler-tasks", ",".join(gate.ruler_tasks),
                 "--ruler-lengths", ",".join(map(str, gate.ruler_lengths)), "--ruler-cases", str(gate.ruler_cases),
                 "--ruler-scoring", gate.ruler_scoring]
    return argv


def gate_metrics(summary: dict) -> dict[str, float]:
    """Every gate metric of a `python -m jaxlong.eval` summary (`jaxlong.evaluation.checkpoint.evaluate`'s)."""
    out = {"loss": float(summary["loss"]), "perplexity": float(summary["perplexity"])}
    for metric in OBJECTIVE_METRICS:  # an objective's own held-out metrics (a DPO stage's pairs)
        key, _, name = metric.partition("/")
        if name in summary.get(key, {}):
            out[metric] = float(summary[key][name])
    if "passkey" in summary:
        pk = summary["passkey"]
        out["passkey"] = float(pk["mean"])
        for j, n in enumerate(pk["lengths"]):
            out[f"passkey/{n}"] = float(sum(row[j] for row in pk["accuracy"]) / len(pk["accuracy"]))
    if "ruler" in summary:
        rows = summary["ruler"]["rows"]
        out["ruler"] = float(summary["ruler"]["mean"])
        for task in dict.fromkeys(r["task"] for r in rows):
            mine = [r for r in rows if r["task"] == task]
            out[f"ruler/{task}"] = float(sum(r["score"] for r in mine) / len(mine))
            for r in mine:
                out[f"ruler/{task}/{r['length']}"] = float(r["score"])
    return out


def decide(gate: Gate, metrics: dict[str, float]) -> list[str]:
    """The thresholds `metrics` miss, each as `metric = value (needs >= min)` or `(needs <= max)`; [] when the
    gate passes. A metric the evaluation could not produce (e.g. a RULER task too long for the length) misses."""
    missed = []
    for table, sign, meets in ((gate.min, ">=", operator.ge), (gate.max, "<=", operator.le)):
        for metric, bound in table.items():
            value = metrics.get(metric)
            if value is None or not meets(value, bound):
                missed.append(f"{metric} = {_fmt(value)} (needs {sign} {bound:g})")
    return missed


def _fmt(value) -> str:
    return "not measured" if value is None else f"{value:.4g}"


Evaluate = Callable[[Gate, Path, int], tuple[dict, str]]  # (gate, run dir, step) -> (summary, results directory)


def run_gate(gate: Gate, stage: int, name: str, step: int, run_dir: Path, *, next_name: str | None,
             evaluate: Evaluate, say=print) -> dict:
    """Evaluate `gate` on checkpoint `step` (the last of stage `stage`, `name`) of `run_dir` unless
    `RUN/gates/stage<i>.json` already holds every metric for that step, record the metrics, and decide.

    Args:
      evaluate: runs the gate's evaluation (`python -m jaxlong.eval` with `eval_argv`'s arguments) in this process,
        on every process of the run, and returns its summary and results directory (`evaluate_gate`).

    Returns: the record (`stage`, `name`, `step`, `ruler_scoring`, `metrics`, `results`: the evaluation's directory,
      `missed`).

    Raises:
      GateFailed: a threshold is missed and `gate.action` is `stop` (one line: the gate, each missed metric with
        its value, where the results are, how to go on). With `warn` the same line is printed and the recipe
        goes on.
    """
    path = run_dir / "gates" / f"stage{stage}.json"
    record = json.loads(path.read_text()) if path.exists() else None
    scoring = gate.ruler_scoring if gate.ruler else None
    if (record is None or record.get("step") != step or any(m not in record["metrics"] for m in gate.metrics)
            or record.get("ruler_scoring") != scoring):
        argv = eval_argv(gate, run_dir, step)
        say(f"gate of stage {stage} ({name}): python -m jaxlong.eval {' '.join(argv)}")
        summary, results = evaluate(gate, run_dir, step)
        record = {"stage": stage, "name": name, "step": step, "ruler_scoring": scoring,
                  "metrics": gate_metrics(summary), "results": results}
        record["missed"] = decide(gate, record["metrics"])  # as first decided; a resume decides again
        if jax.process_index() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(path)  # a kill leaves the old record or the new one, never half of one
    else:
        say(f"gate of stage {stage} ({name}): decided from {path} (step {step})")
    record["missed"] = decide(gate, record["metrics"])
    shown = ", ".join(f"{m} {_fmt(record['metrics'].get(m))}" for m in gate.metrics) or "no thresholds"
    if not record["missed"]:
        say(f"gate of stage {stage} ({name}) passed at step {step}: {shown}")
        return record
    line = (f"gate of stage {stage} ({name}) failed at step {step}: {'; '.join(record['missed'])}; results in "
            f"{record['results']}")
    if gate.action == "warn":
        say(f"warning: {line}; going on (gate.action: warn)")
        return record
    after = f"go on to stage {stage + 1} ({next_name})" if next_name else "end the recipe"
    raise GateFailed(f"{line}; to train the stage longer raise its steps, or to {after} as it is set its gate's "
                     f"action to warn (or loosen the threshold), then rerun with --resume")
