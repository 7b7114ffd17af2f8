"""RULER as RULER scores it (Hsieh et al., arXiv 2404.06654, §3 and its released scripts): prompts as text in
RULER's task templates, a length budget of prompt plus generated tokens, greedy generation, `string_match_all`.

A generation case is made from a `jaxlong.evaluation.ruler.tasks` case (its haystack, needles, chains or word
list, at the depth the case index gives) by decoding the case's context to text and putting it in RULER's template
for the family (`TEMPLATES`, RULER's `scripts/data/synthetic/constants.py`, word for word, with the singular forms
RULER uses for a single needle). The answer prefix ends the prompt: after the user's text without `chat`, at the
start of the assistant's turn with `chat` (the checkpoint's chat template, `jaxlong.data.chat`). Variable tracking
and common words get RULER's one in-context example before the question (a smaller case of the same task with
its answer). The text is tokenized as the model's tokenizer tokenizes text: a plain prompt with the tokenizer's
own special-token rules (`encode_prompt`: BOS only where the tokenizer adds one), a chat prompt as the template
writes it. The prompt has at most `length - tokens_to_generate` tokens (`TOKENS_TO_GENERATE`, RULER's per task),
as RULER fits its haystacks: the case is made again with a shorter haystack until the text fits.

Scoring (RULER's `scripts/eval/evaluate.py` and `synthetic/constants.py`): the generated text is stripped and its
control characters (`\\x00`-`\\x1f`) become newlines (`postprocess`); a case scores the share of its reference
items found in it, case-insensitive (`string_match_all`); a task's score is the mean over its cases, a length's
the mean over its tasks.

Where this differs from RULER (docs/evaluation.md#ruler): the haystacks are `tasks`' (the run's own corpus for
RULER's essays, needles placed at sentence boundaries), cwe's word list below 4096 tokens uses RULER's short
frequencies (6 and 1) but draws its words from `words.Lexicon`, fwe has no '....' noise word.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxlong.evaluation.ruler.tasks import RulerCase, Task, TooShort, as_task, make_cases

# RULER's scripts/data/synthetic/constants.py: (template, answer prefix) per family
TEMPLATES = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assigned the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
            "list?",
            " Answer: The top 10 words that appear most often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
}
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate
SCORINGS = ("generate", "forced")


@dataclass(frozen=True)
class GenerationCase:
    """One RULER case to generate for.

    Attributes:
      task, length, index: what made it (with the seed); `length` counts prompt plus generated tokens.
      prompt: int32 `[n]`, the token ids of the whole prompt (n <= length - tokens_to_generate).
      text: the prompt's text before the answer prefix (the user's turn under chat); answer_prefix: RULER's.
      refs: the reference items, any of which may appear in the output in any order.
      tokens_to_generate: RULER's for the task. depth: the asked needle's depth in [0, 1] (None for cwe, fwe).
    """

    task: str
    length: int
    index: int
    prompt: np.ndarray
    text: str
    answer_prefix: str
    refs: tuple[str, ...]
    tokens_to_generate: int
    depth: float | None


def postprocess(text: str) -> str:
    """RULER's `postprocess_pred`: stripped, control characters (\\x00-\\x1f) as newlines, stripped again."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(prediction: str, refs: Sequence[str]) -> float:
    """RULER's `string_match_all` for one case: the share of `refs` found, case-insensitive, in the
    (postprocessed) prediction, in [0, 1]."""
    pred = postprocess(prediction).lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


def _main_task(task: Task, length: int) -> Task:
    """cwe below 4096 tokens takes RULER's short frequencies (common words 6 times, the others once)."""
    if task.family == "cwe" and length < 4096:
        return dataclasses.replace(task, freq_common=6, freq_rare=1)
    return task


def _fill(task: Task, case: RulerCase, tokenizer) -> tuple[str, str]:
    """(the task's text, its answer prefix) for `case`, in RULER's template."""
    template, prefix = TEMPLATES[task.family]
    context = tokenizer.decode(case.tokens[case.context[0]:case.context[1]]).strip()
    if task.family == "niah":
        q = list(case.query)
        query = q[0] if len(q) == 1 else ", ".join(q[:-1]) + ", and " + q[-1]
        kind = task.values
        if task.num_queries * task.num_values == 1:  # RULER's singular wording for one answer
            template, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                .replace("answers", "answer") for t in (template, prefix))
            kind = kind[:-1]
        return (template.format(type_needle_v=kind, context=context, query=query),
                prefix.format(type_needle_v=kind, query=query))
    if task.family == "vt":
        return (template.format(context=context, query=case.query[0]),
                prefix.format(num_v=task.hops + 1, query=case.query[0]))
    return template.format(context=context), prefix


def _example(task: Task, tokenizer, length: int, seed: int, corpus) -> str:
    """RULER's in-context example for vt and cwe (empty for the others): a small case of the task, its template
    and answer prefix, then its answer, and a newline. cwe's has 10 common words 10 times (3 below 4096 tokens)."""
    if task.family == "vt":
        small = task
    elif task.family == "cwe":
        small = dataclasses.replace(task, freq_common=3 if length < 4096 else 10, freq_rare=1 if length < 4096 else 3)
    else:
        return ""
    example_seed, size = zlib.crc32(f"example/{seed}".encode()), 64
    for _ in range(16):  # a case a little longer than the least that holds the task's fixed parts
        try:
            case = make_cases(small, tokenizer, size, 1, seed=example_seed, corpus=corpus)[0]
            break
        except TooShort as e:
            size = max(e.least, size + 1) + 32
    else:
        raise TooShort(f"ruler task {task.name}: no in-context example up to {size} tokens", size)
    text, prefix = _fill(small, case, tokenizer)
    answer = " ".join(case.items) if task.family == "vt" else " ".join(f"{i + 1}. {w}" for i, w in
                                                                        enumerate(case.items))
    return text + prefix + " " + answer + "\n"


def render_prompt(text: str, prefix: str, tokenizer, chat=None) -> np.ndarray:
    """int32 `[n]`: the prompt's token ids. Without `chat`, `text + prefix` as a plain prompt (`encode_prompt`: the
    tokenizer's own special-token rules); with `chat` (a `ChatTemplate`), `text` as a user turn, the assistant's
    turn opened, then `prefix`, tokenized as the template writes it (no post-processor), as transformers'
    `apply_chat_template` followed by the prefix."""
    if chat is None:
        return np.asarray(tokenizer.encode_prompt(text + prefix), np.int32)
    rendered = chat.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return np.asarray(tokenizer.encode(rendered + prefix), np.int32)  # the template places the special tokens


def generation_cases(task: Task | str, tokenizer, length: int, n: int, *, seed: int = 0,
                     corpus: np.ndarray | None = None, chat=None) -> list[GenerationCase]:
    """`n` RULER cases of `task` whose prompts hold at most `length - TOKENS_TO_GENERATE[family]` tokens.

    Args:
      task: a `Task` or a name in `TASKS`. tokenizer: the run's. length: prompt plus generated tokens.
      n: cases (case i's asked needle at depth i / (n - 1), as `make_cases`). seed: fixes every case.
      corpus: the run's text as tokens (`corpus_tokens`), for corpus haystacks.
      chat: a `jaxlong.data.chat.ChatTemplate` to render the prompt as a user turn, the answer prefix opening the
        assistant's turn; None for a plain prompt.

    Raises:
      ValueError: as `make_cases`; a length too short for the task's fixed parts, its template and the generated
        tokens (`TooShort`, naming the least length that holds them).
    """
    task = as_task(task)
    made = _try(task, tokenizer, length, n, seed, corpus, chat)
    if made is not None:
        return made
    ttg = TOKENS_TO_GENERATE[task.family]
    least = next((m for m in range(length + 8, length + 8 * 4096, 8)
                  if _try(task, tokenizer, m, 1, seed, corpus, chat) is not None), None)
    raise TooShort(f"ruler task {task.name}: length {length} cannot hold its template, its fixed parts and the "
                   f"{ttg} tokens RULER generates with this tokenizer"
                   + (f"; use at least {least} tokens" if least else ""), least or 0)


def _try(task: Task, tokenizer, length: int, n: int, seed: int, corpus, chat) -> list[GenerationCase] | None:
    """`generation_cases`, or None when the length is too short: the case is made at an inner length moved by what
    the prompt's text misses the budget by (a few tries), keeping the fullest prompts that fit."""
    ttg = TOKENS_TO_GENERATE[task.family]
    budget = length - ttg
    main = _main_task(task, length)
    best = None
    try:
        example = _example(task, tokenizer, length, seed, corpus)
        inner, tried = budget - (len(tokenizer.encode(example)) if example else 0), set()
        for _ in range(8):
            if inner < 1 or inner in tried:
                break
            tried.add(inner)
            built = []
            for c in make_cases(main, tokenizer, inner, n, seed=seed, corpus=corpus):
                text, prefix = _fill(task, c, tokenizer)
                built.append((c, example + text, prefix, render_prompt(example + text, prefix, tokenizer, chat)))
            size = max(b[3].size for b in built)
            if size <= budget and (best is None or size > best[0]):
                best = (size, built)
            if best is not None and budget - best[0] <= budget // 256:
                break
            inner += budget - size
    except TooShort:
        pass
    if best is None:
        return None
    return [GenerationCase(task.name, length, c.index, ids, text, prefix, c.items, ttg,
                           c.depths[0] if c.depths else None) for c, text, prefix, ids in best[1]]
