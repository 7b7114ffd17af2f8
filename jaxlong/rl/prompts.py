"""GRPO's prompts (`grpo.dataset`): RULER cases that jaxlong generates, or a JSONL file in TRL's prompt-only format.

* `ruler`: `grpo.ruler_task` at each of `grpo.ruler_lengths` (RULER's length: the prompt plus the task's generation
  budget, `jaxlong.evaluation.ruler.prompts.generation_cases`), seeded by `seed + 1` so that they differ from the
  cases a run's RULER validation scores (seeded by `seed`). The column `refs` holds each case's answers, which
  `string_match_all` and `string_match_part` read.
* a `.jsonl` path: one record per line with `prompt`, either text or a list of messages `{"role", "content"}`
  (TRL's "prompt-only" standard and conversational formats). Messages are rendered with the run's chat template,
  the assistant's turn opened; text is rendered with it too under `grpo.chat`, else tokenized as it is. Every
  other field is a column passed by name to each reward (TRL's `GRPOTrainer` does the same).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxlong.core.errors import ConfigError
from jaxlong.evaluation.ruler import TASKS, corpus_tokens, generation_cases
from jaxlong.objectives.grpo import RULER_LENGTH

__all__ = ["PromptSet", "load_prompts", "ruler_prompts", "jsonl_prompts"]


@dataclass
class PromptSet:
    """Prompts and what the rewards read: `tokens` (int32 ids of each rendered prompt), `prompts` (each as the
    dataset gives it: text, or messages), `conversational` (whether the prompts are messages: completions are then
    passed to the rewards as `[{"role": "assistant", "content": text}]`, as TRL does) and `columns` (the other
    fields, one entry per prompt)."""

    tokens: list[np.ndarray]
    prompts: list
    conversational: bool = False
    columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)


def ruler_prompts(task: str, lengths: list[int], tokenizer, cases: int, seed: int, corpus=None,
                  chat=None) -> PromptSet:
    """`cases` RULER cases of `task` at each length (module docstring), with the `refs` column.

    Raises:
      ConfigError: an unknown task, or a length too short for it (naming the least that holds it)."""
    if task not in TASKS:
        raise ConfigError(f"grpo.ruler_task={task!r} is not a RULER task; choose from {', '.join(TASKS)}",
                          key="grpo.ruler_task", value=task)
    made = []
    for length in lengths:
        try:
            made += generation_cases(task, tokenizer, length, cases, seed=seed, corpus=corpus, chat=chat)
        except ValueError as e:
            raise ConfigError(f"grpo.ruler_lengths: {e}", key="grpo.ruler_lengths", value=lengths) from None
    return PromptSet([c.prompt for c in made], [c.text + c.answer_prefix for c in made], False,
                     {"refs": [list(c.refs) for c in made]})


def jsonl_prompts(path: str | Path, tokenizer, chat=None, use_chat: bool = False) -> PromptSet:
    """The prompts of a TRL prompt-only JSONL file (module docstring).

    Raises:
      ConfigError: the file missing or empty, a line that is not a JSON object with `prompt`, messages without a
        chat template, or records that mix text and messages (naming the line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"grpo.dataset={str(path)!r}: no such file; give a JSONL file of {{\"prompt\": ...}} "
                          f"records, or ruler", key="grpo.dataset", value=str(path))
    records = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"grpo.dataset {path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), (str, list)) or not rec["prompt"]:
            raise ConfigError(f"grpo.dataset {path}:{i}: a record needs \"prompt\", a non-empty text or list of "
                              f"messages (TRL's prompt-only format)")
        records.append(rec)
    if not records:
        raise ConfigError(f"grpo.dataset {path}: no records")
    kinds = {isinstance(r["prompt"], list) for r in records}
    if len(kinds) > 1:
        raise ConfigError(f"grpo.dataset {path}: some prompts are text and some messages; give one format")
    conversational = kinds == {True}
    if (conversational or use_chat) and chat is None:
        why = "its prompts are messages, which need" if conversational else "grpo.chat=true needs"
        raise ConfigError(f"grpo.dataset {path}: {why} a chat template, and the run's tokenizer has none; set "
                          f"data.chat_template=FILE.jinja (e.g. configs/chat_templates/chatml.jinja)")
    tokens = []
    for rec in records:
        p = rec["prompt"]
        if conversational or use_chat:
            messages = p if conversational else [{"role": "user", "content": p}]
            tokens.append(np.asarray(tokenizer.encode(chat.render(messages, add_generation_prompt=True)), np.int32))
        else:
            tokens.append(np.asarray(tokenizer.encode_prompt(p), np.int32))
    names = sorted({k for r in records for k in r if k != "prompt"})
    return PromptSet(tokens, [r["prompt"] for r in records], conversational,
                     {k: [r.get(k) for r in records] for k in names})


def load_prompts(cfg, tokenizer, *, cases: int, chat=None, source=None) -> PromptSet:
    """The run's prompts (`grpo.dataset`), every one checked to fit a row with its group.

    Args:
      cfg: the run's config. tokenizer: the run's. cases: RULER cases per length.
      chat: the run's `jaxlong.data.chat.ChatTemplate` or None. source: the run's documents (a corpus haystack).

    Raises:
      ConfigError: as `ruler_prompts` and `jsonl_prompts`; a prompt whose group would not fit `seq_len` (naming it
        and its length)."""
    g = cfg.grpo
    if g.dataset == "ruler":
        lengths = list(g.ruler_lengths or [RULER_LENGTH])
        corpus = None
        if g.ruler_task in TASKS and TASKS[g.ruler_task].haystack == "corpus" and source is not None:
            corpus = corpus_tokens((source[i] for i in range(len(source))), tokenizer, max_tokens=2 * max(lengths))
        out = ruler_prompts(g.ruler_task, lengths, tokenizer, cases, cfg.seed + 1, corpus,
                            chat if g.chat else None)
    else:
        out = jsonl_prompts(g.dataset, tokenizer, chat, g.chat)
    for i, t in enumerate(out.tokens):
        if g.group_tokens(t.size) > cfg.seq_len:
            raise ConfigError(f"grpo.dataset: prompt {i} has {t.size} tokens; with grpo.num_generations="
                              f"{g.num_generations} completions of up to grpo.max_completion_length="
                              f"{g.max_completion_length} its group takes {g.group_tokens(t.size)} positions, more "
                              f"than seq_len={cfg.seq_len}; shorten it, raise seq_len or lower those",
                              key="seq_len", value=cfg.seq_len)
    return out
