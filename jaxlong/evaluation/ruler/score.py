"""RULER scoring on the training mesh: teacher-forced exact match (Hsieh et al., arXiv 2404.06654, scored as
greedy decoding would be, without a decode loop).

A case counts when, given its input, the argmax at every answer position is the answer's token: the first answer
token predicted from the question, each later one from the question and the answer's earlier tokens (teacher
forcing), so the case is right exactly when greedy decoding would produce the whole answer. One forward per case,
through `jaxlong.evaluation.steps.token_stats` — the train step's forward on the run's mesh (FSDP, Ulysses, U-Pipe,
ring and the hybrids), tiled so that `[seq, vocab]` logits never exist — hence at any length the mesh trains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from jaxlong.config import Config, ConfigError, forward_at, refusal
from jaxlong.core.distributed import gpu_driver_present
from jaxlong.core.suggest import nearest
from jaxlong.core.units import fmt_bytes
from jaxlong.data.chat import ChatTemplate
from jaxlong.data.tokenizer import check_vocab
from jaxlong.data.heldout import eval_batch_size
from jaxlong.evaluation.probes import passkey_batch
from jaxlong.evaluation.ruler.generated import outputs_on_mesh, score_outputs
from jaxlong.evaluation.ruler.prompts import SCORINGS, generation_cases
from jaxlong.evaluation.ruler.tasks import TASKS, RulerCase, Task, corpus_tokens, make_cases
from jaxlong.evaluation.steps import token_stats


@dataclass(frozen=True)
class RulerSuite:
    """What to run: `tasks` (names in `TASKS`, or `Task`s), context `lengths` (tokens, each a sequence length
    the mesh takes), `cases` per task and length (needle depths evenly spaced over them), `seed`, and the
    `scoring`: "generate" (RULER's: greedy generation scored by string_match_all, `prompts`, `generated`) or
    "forced" (the cheap proxy: teacher-forced exact match, this module)."""

    tasks: Sequence[str | Task] = field(default_factory=lambda: list(TASKS))
    lengths: Sequence[int] = (4096,)
    cases: int = 8
    seed: int = 0
    scoring: str = "generate"


@dataclass(frozen=True)
class RulerGeneration:
    """How scoring by generation (`RulerSuite.scoring == "generate"`) prompts the model and stops it; the forced
    scoring ignores both.

    Attributes:
      chat: a `jaxlong.data.chat.ChatTemplate` (the prompt rendered as a user turn), or None (the bare prompt).
      eos_ids: the ids that end a generation (`jaxlong.data.tokenizer.stop_ids`); None: the tokenizer's EOS.
    """

    chat: ChatTemplate | None = None
    eos_ids: Sequence[int] | None = None


def check_length(cfg: Config, length: int, option: str = "ruler length") -> None:
    """Raise ConfigError (one line: the option, the length, the rule) unless `length` is a sequence length the
    run's mesh takes: `jaxlong.config.validate` with `seq_len=length` (divisible by mesh.context, by 2 *
    mesh.ring * mesh.context under ring attention, attention blocks and `tiling.mlp_tiles` dividing the local
    sequence). The loss tile is chosen per length by the stats step, so `tiling.loss_tile` is not checked."""
    rule = refusal(forward_at(cfg, length))
    if rule is not None:
        raise ConfigError(f"{option} {length}: not a sequence length this mesh takes ({rule})", key=option,
                          value=length)


def nearby_lengths(cfg: Config, length: int, least: int = 0) -> list[int]:
    """The nearest sequence lengths below and above `length` that the run's mesh takes (`check_length`) and that
    are at least `least` tokens: at most one each, searched over multiples of the mesh's sequence split
    (`mesh.context`, times `2 * mesh.ring` under ring attention), 256 of them each way
    (`jaxlong.core.suggest.nearest`)."""
    unit = max(cfg.mesh.context, 1) * (2 * cfg.mesh.ring if cfg.mesh.ring > 1 else 1)
    return nearest(lambda n: n >= least and refusal(forward_at(cfg, n)) is None, length, step=unit, lo=unit,
                   tries=256)


def generation_bytes(cfg: Config, length: int, cases: int, tasks: int, cpu: bool = True) -> int:
    """The host arrays (bytes) that generating and scoring `cases` cases of each of `tasks` tasks at `length` tokens
    need, a lower bound checked before jax starts (the forwards themselves are estimated, compiled, by
    `jaxlong.evaluation.hostmem.check_lengths` once the mesh exists): the cases' int32 tokens and targets (8 bytes
    a token), the corpus haystack (twice the length, `suite_corpus`, int32) and, with `cpu` (the run's devices are
    the CPU's, sharing host memory), one eval batch's hidden states at `compute_dtype` (`eval_batch_size` x length
    x model.hidden)."""
    need = 8 * length * cases * tasks + 4 * 2 * length
    if cpu:
        item = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.compute_dtype]
        need += eval_batch_size(cfg) * length * cfg.model.hidden * item
    return need


def check_lengths(cfg: Config, lengths: Sequence[int], option: str = "ruler length", *, cases: int = 1,
                  tasks: int = 1, host_bytes: int | None = None) -> None:
    """Check every RULER length before any case is generated, and name every problem at once in one line: a
    length that is not positive, one whose cases do not fit this host's memory (`generation_bytes` of `cases`
    cases of `tasks` tasks against `host_bytes`, default the host's physical memory), one the mesh cannot split
    (`check_length`, with the nearest lengths it takes, `nearby_lengths`).

    Raises:
      ConfigError: `<option> <length>: <its problem>` for each bad length, joined by "; ": with one, that length's
        error (`key` option, `value` the length, `suggestions` the nearby lengths, each `{option: length}` to put
        in its place); with several, their errors in `errors`.
    """
    host = host_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = os.environ.get("JAX_PLATFORMS") == "cpu" or not gpu_driver_present()  # without starting a backend
    errors = []
    for n in dict.fromkeys(int(x) for x in lengths):
        near = []
        if n <= 0:
            why = "a length must be a positive token count"
        elif generation_bytes(cfg, n, cases, tasks, cpu) > host:
            why = (f"{n} tokens need at least {fmt_bytes(generation_bytes(cfg, n, cases, tasks, cpu))} of host "
                   f"memory to generate and score {cases} case(s) of {tasks} task(s), and this host has "
                   f"{fmt_bytes(host)}")
        elif (rule := refusal(forward_at(cfg, n))) is not None:
            near = nearby_lengths(cfg, n)
            why = (f"not a sequence length this mesh takes ({rule})"
                   + (f"; nearby lengths it takes: {' or '.join(map(str, near))}" if near else ""))
        else:
            continue
        errors.append(ConfigError(f"{option} {n}: {why}", key=option, value=n,
                                  suggestions=tuple({option: m} for m in near)))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigError("; ".join(map(str, errors)), errors=tuple(errors))


def predict_answers(predict: Callable[[dict], np.ndarray], cases: Sequence[RulerCase], batch_size: int,
                    progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """What the model answers to each case, teacher-forced: the argmax at the case's answer positions.

    Args:
      predict: `batch -> argmax` int `[b, S]` (host numpy), called with `jaxlong.evaluation.probes.passkey_batch`
        batches (`inputs`, `targets`, `mask` on the answer, `positions`, `segment_ids`, `[batch_size, S]`) of
        same-length cases; a last short batch is filled with copies of its last case (their results dropped).
      cases: any order and lengths (batched by length). batch_size: rows per forward.
      progress: called with the number of real cases after each forward.

    Returns:
      per case, int32 `[len(case.answer)]`: the most likely token at each answer position, given the input and
      the answer's earlier tokens (the case's answer tokens are `case.tokens[1:][case.answer]`).
    """
    out: list[np.ndarray | None] = [None] * len(cases)
    by_length: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_length.setdefault(c.length, []).append(i)
    for idx in by_length.values():
        for s in range(0, len(idx), batch_size):
            chunk = idx[s:s + batch_size]
            rows = [cases[i] for i in chunk] + [cases[chunk[-1]]] * (batch_size - len(chunk))
            argmax = np.asarray(predict(passkey_batch(rows)))
            for k, i in enumerate(chunk):
                out[i] = argmax[k, cases[i].answer].astype(np.int32)
            if progress:
                progress(len(chunk))
    return out


def is_right(cases: Sequence[RulerCase], answers: Sequence[np.ndarray]) -> np.ndarray:
    """bool `[len(cases)]`: whether each predicted answer (`predict_answers`) is the case's answer, token for
    token (RULER's exact match)."""
    return np.array([np.array_equal(a, c.tokens[1:][c.answer]) for c, a in zip(cases, answers, strict=True)], bool)


def score_cases(predict: Callable[[dict], np.ndarray], cases: Sequence[RulerCase], batch_size: int,
                progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Teacher-forced exact match of each case: `is_right` of `predict_answers` (same arguments).

    Returns:
      bool `[len(cases)]`: whether the argmax equals the target at every answer position.
    """
    return is_right(cases, predict_answers(predict, cases, batch_size, progress))


def results(cases: Sequence, right: np.ndarray) -> list[dict]:
    """One row per (task, length), in first-seen order: `task`, `length`, `cases`, `correct` (the sum of the
    cases' scores: exact matches, or string_match_all's shares by generation), `score` (its mean over the
    cases)."""
    rows: dict[tuple[str, int], dict] = {}
    for c, r in zip(cases, right, strict=True):
        row = rows.setdefault((c.task, c.length), {"task": c.task, "length": c.length, "cases": 0, "correct": 0})
        row["cases"] += 1
        row["correct"] += r.item() if isinstance(r, np.generic) else r
    return [{**r, "score": r["correct"] / r["cases"]} for r in rows.values()]


def generate(suite: RulerSuite, tokenizer, corpus: np.ndarray | None = None, chat=None) -> list:
    """Every case of the suite (task-major, then length): `RulerCase`s to score teacher-forced, or with
    `suite.scoring == "generate"` `GenerationCase`s (`generation_cases`; `chat` a `ChatTemplate` or None).
    Raises ValueError as `make_cases` and `generation_cases`."""
    if suite.scoring == "generate":
        return [c for t in suite.tasks for n in suite.lengths
                for c in generation_cases(t, tokenizer, n, suite.cases, seed=suite.seed, corpus=corpus, chat=chat)]
    return [c for t in suite.tasks for n in suite.lengths
            for c in make_cases(t, tokenizer, n, suite.cases, seed=suite.seed, corpus=corpus)]


def answers_on_mesh(cfg: Config, mesh, params: dict, cases: Sequence[RulerCase], *, stats=None,
                    progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """`predict_answers` of `cases` by `params` on `mesh`: each case length checked first (`check_length`, before
    anything compiles), then one `token_stats` forward per `eval_batch_size(cfg)` cases of a length.

    Args:
      cfg, mesh: the run's config and mesh; params: FSDP-sharded as `jaxlong.training.step.abstract_params`.
      cases: `make_cases` cases, token ids below `model.vocab_size`.
      stats: a `jaxlong.evaluation.steps.token_stats(cfg, mesh)` to share (its jitted program is compiled once
        per length and kept), or None to make one.
      progress: called with the number of cases after each forward.

    Returns: per case, the argmax tokens at its answer positions, as `predict_answers`.

    Raises:
      ConfigError: a case length the mesh does not take.
    """
    for n in sorted({c.length for c in cases}):
        check_length(cfg, n)
    stats = stats or token_stats(cfg, mesh)
    return predict_answers(lambda b: stats(params, b)[1], cases, eval_batch_size(cfg), progress)


def score_on_mesh(cfg: Config, mesh, params: dict, cases: Sequence[RulerCase], *, stats=None,
                  progress: Callable[[int], None] | None = None) -> np.ndarray:
    """bool `[len(cases)]`, as `score_cases`: `is_right` of `answers_on_mesh` (same arguments and errors)."""
    return is_right(cases, answers_on_mesh(cfg, mesh, params, cases, stats=stats, progress=progress))


def validation_suite(cfg: Config) -> RulerSuite | None:
    """The suite the trainer scores with each validation: `ruler_tasks` at `ruler_lengths` (default `[seq_len]`),
    `ruler_cases` cases each, seeded by `seed`; None when `ruler_tasks` is empty.

    Raises:
      ConfigError: a name in `ruler_tasks` that is not in `TASKS`.
    """
    if not cfg.ruler_tasks:
        return None
    unknown = [t for t in cfg.ruler_tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"ruler_tasks={cfg.ruler_tasks}: unknown task(s) {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(TASKS)}")
    return RulerSuite(list(cfg.ruler_tasks), list(cfg.ruler_lengths or [cfg.seq_len]), cfg.ruler_cases, cfg.seed,
                      cfg.ruler_scoring)


def suite_corpus(suite: RulerSuite, texts, tokenizer) -> np.ndarray | None:
    """The corpus haystack of `suite` (`corpus_tokens` of `texts`, the run's held-out documents, as many tokens
    as twice its longest length), or None when none of its tasks uses one."""
    tasks = [TASKS[t] if isinstance(t, str) else t for t in suite.tasks]
    if not any(t.family == "niah" and t.haystack == "corpus" for t in tasks):
        return None
    return corpus_tokens(texts, tokenizer, max_tokens=2 * max(suite.lengths))


class RulerValidator:
    """RULER during training: the suite's cases generated once (lengths checked, nothing compiled), scored each
    time `run(params)` is called (e.g. by the trainer's validation hook, `jaxlong.training.hooks`): by greedy
    generation and string_match_all (`suite.scoring == "generate"`, `generated.outputs_on_mesh`), or teacher-forced
    with one shared `token_stats` program per length. Every process generates the same cases (a pure function of
    the seed) and feeds the same host batches.

    Args:
      chat: a `jaxlong.data.chat.ChatTemplate` (generation: the prompt as a user turn), or None.
      eos_ids: the ids that end a generation (`jaxlong.data.tokenizer.stop_ids`; default the tokenizer's EOS).

    Raises (at construction): ConfigError and ValueError as `evaluate_ruler`; a length error names `option`
    (the key or flag that gave the lengths).
    """

    def __init__(self, cfg: Config, mesh, tokenizer, suite: RulerSuite, corpus: np.ndarray | None = None,
                 option: str = "ruler length", *, chat=None, eos_ids: Sequence[int] | None = None):
        if suite.scoring not in SCORINGS:
            raise ConfigError(f"ruler scoring {suite.scoring!r}: give one of {', '.join(SCORINGS)}")
        check_lengths(cfg, suite.lengths, option, cases=suite.cases, tasks=len(suite.tasks))
        check_vocab(tokenizer, cfg.model.vocab_size)
        self.cfg, self.mesh, self.tokenizer, self.scoring = cfg, mesh, tokenizer, suite.scoring
        self.eos = [tokenizer.eos_id] if eos_ids is None else list(eos_ids)
        self.cases = generate(suite, tokenizer, corpus, chat)
        self.stats = None
        self.generators: dict = {}  # each length's Generator: compiled once, reused by every run
        self.outputs: list = []  # the last run's generations (scoring "generate")

    def run(self, params: dict, progress: Callable[[int], None] | None = None) -> list[dict]:
        """`results` rows (task, length, cases, correct, score) of `params`."""
        if self.scoring == "generate":
            self.outputs = outputs_on_mesh(self.cfg, self.mesh, params, self.tokenizer, self.cases,
                                           eos_ids=self.eos, progress=progress, generators=self.generators)
            return results(self.cases, score_outputs(self.cases, [g.text for g in self.outputs]))
        if self.stats is None:
            self.stats = token_stats(self.cfg, self.mesh)
        return results(self.cases, score_on_mesh(self.cfg, self.mesh, params, self.cases, stats=self.stats,
                                                 progress=progress))


def evaluate_ruler(cfg: Config, mesh, params: dict, tokenizer, suite: RulerSuite, *,
                   corpus: np.ndarray | None = None, stats=None,
                   progress: Callable[[int], None] | None = None, option: str = "ruler length",
                   generation: RulerGeneration = RulerGeneration()) -> list[dict]:
    """RULER scores of `params` on `mesh`: every length checked (`check_lengths`) and every case generated before
    anything compiles, then scored as `suite.scoring` says (`RulerValidator`).

    Args:
      cfg, mesh, params, stats, progress: as `score_on_mesh`.
      tokenizer: the run's (`jaxlong.data.run_tokenizer(cfg)`). suite: tasks, lengths, cases, scoring.
      corpus: int32 tokens of the run's text for the corpus haystacks (`corpus_tokens`).
      option: the key or flag that gave the lengths, named by a length error.
      generation: the chat template and the ids that end a generation (`RulerGeneration`; generation only).

    Returns:
      `results(...)` rows: task, length, cases, correct, score.

    Raises:
      ConfigError: a length the mesh does not take, or a tokenizer larger than `model.vocab_size`.
      ValueError: a task that cannot be generated at a length (see `make_cases`, `generation_cases`).
    """
    validator = RulerValidator(cfg, mesh, tokenizer, suite, corpus, option, chat=generation.chat,
                               eos_ids=generation.eos_ids)
    validator.stats = stats
    return validator.run(params, progress)
