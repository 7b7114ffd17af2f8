"""RULER's synthetic tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv 2404.06654, §3), generated offline with the run's tokenizer at an exact length in tokens.

Families (`Task.family`) and RULER's 11 synthetic configurations (`TASKS`, the names of RULER's
`synthetic.yaml`; the two QA tasks need SQuAD/HotpotQA and are left out):

* `niah` — needle in a haystack (§3.1). Needles "One of the special magic {kind} for KEY is: VALUE." in a
  haystack of repeated filler (`"filler"`, RULER's "repeat"), of the run's own corpus (`"corpus"`, RULER's Paul
  Graham essays) or of distractor needles with other keys (`"needles"`). Single (one needle), multi-key
  (`num_keys` needles, one asked), multi-value (`num_values` values for the asked key, all to be given, in order
  of appearance) and multi-query (`num_queries` keys asked, their values given in the order asked).
* `vt` — variable tracking (§3.2, multi-hop tracing): `chains` chains "VAR A = 12345." "VAR B = VAR A." ... of
  `hops` hops in filler; the answer is every variable of the asked chain, in order of assignment.
* `cwe` — common words extraction (§3.3): a numbered list in which `num_common` words appear `freq_common`
  times and the others `freq_rare` times; the answer is the common words in order of first appearance.
* `fwe` — frequent words extraction (§3.3): coded words drawn from a Zeta(`alpha`) distribution; the answer is
  the `top` most frequent, from the most frequent (their counts strictly decrease, and the next word's is lower).

Every case is one document `[BOS] pad head context question answer` of exactly `length + 1` tokens (inputs are
the first `length`, targets the last `length`), whose answer is the last targets: one canonical token sequence
(`jaxlong.evaluation.ruler.words.Pieces.join`: the items' slot encodings separated by ","). The haystack (or, for
`cwe`/`fwe`, a filler `pad` shorter than one more list entry) takes up the rest, so the length is exact on any
tokenizer. Cases are a pure function of (task, tokenizer, length, seed, case index); the asked needle of case i
of n sits at depth i / (n - 1) of the haystack (variable tracking: the asked chain spans half the haystack,
starting at depth i / (n - 1) / 2), the other needles at seeded random depths.

Where this differs from RULER (needle placement, haystacks, words, answers in a stated order): docs/evaluation.md
under "Where this differs from the paper".
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from jaxlong.evaluation.probes import FILLER
from jaxlong.evaluation.ruler.words import Lexicon, Pieces

NIAH_HEAD = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {kind} afterwards.\n")
NEEDLE = " One of the special magic {kind} for {key} is: {value}."
NIAH_QUESTION = "\nWhat are all the special magic {kind} for"
NIAH_ANSWER = " mentioned in the provided text? The special magic {kind} for"
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_FIRST = " VAR {var} = {value}."
VT_NEXT = " VAR {var} = VAR {prev}."
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value"
VT_ANSWER = (" in the text above. Answer: According to the chain(s) of variable assignment in the text above, "
             "these variables are assigned the value, in order of assignment:")
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
CWE_QUESTION = ("\nQuestion: What are the {n} most common words in the above list? Answer: The top {n} words that "
                "appear most often in the list, in order of first appearance, are:")
FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. Find the {n} most "
            "frequently appeared coded words.")
FWE_QUESTION = ("\nQuestion: What are the {n} most frequently appeared words in the above coded text? Answer: "
                "According to the coded text above, the {n} most frequently appeared words, from the most "
                "frequent, are:")
POOL = 256  # distractor needles of a "needles" haystack


@dataclass(frozen=True)
class Task:
    """One RULER task configuration (see the module docstring for the families and their fields)."""

    name: str
    family: str  # "niah" | "vt" | "cwe" | "fwe"
    haystack: str = "filler"  # niah: "filler" | "corpus" | "needles"
    keys: str = "words"  # niah key kind; "words" | "numbers" | "uuids"
    values: str = "numbers"  # niah and vt value kind
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    chains: int = 1
    hops: int = 4
    num_common: int = 10
    freq_common: int = 30
    freq_rare: int = 3
    alpha: float = 2.0
    top: int = 3


TASKS = {t.name: t for t in [
    Task("niah_single_1", "niah", "filler"),
    Task("niah_single_2", "niah", "corpus"),
    Task("niah_single_3", "niah", "corpus", values="uuids"),
    Task("niah_multikey_1", "niah", "corpus", num_keys=4),
    Task("niah_multikey_2", "niah", "needles"),
    Task("niah_multikey_3", "niah", "needles", keys="uuids", values="uuids"),
    Task("niah_multivalue", "niah", "corpus", num_values=4),
    Task("niah_multiquery", "niah", "corpus", num_queries=4),
    Task("vt", "vt", values="numbers"),
    Task("cwe", "cwe"),
    Task("fwe", "fwe"),
]}


@dataclass(frozen=True)
class RulerCase:
    """One generated case.

    Attributes:
      task, length, index: what made it (with the seed). tokens: int32 `[length + 1]`; inputs = tokens[:-1],
        targets = tokens[1:]. answer: int `[n]`, the answer's positions in the targets (the last n).
      items: the answer's items in answer order (values, variable names or words); answer_text: their text.
      item_starts: for each item, an input position where its slot tokens start (its needle, or its first
        occurrence in the list). depths: the answer-bearing needles' input positions / length (niah, vt).
      context: `(start, end)` input positions of the haystack with its needles (or the word list).
      distractors: the other needles' values (niah) or chains' variables (vt), none equal to an item.
      query: what the question names: the asked keys (niah), the chain's value (vt); empty for cwe and fwe.
    """

    task: str
    length: int
    index: int
    tokens: np.ndarray
    answer: np.ndarray
    items: tuple[str, ...]
    answer_text: str
    item_starts: tuple[int, ...]
    depths: tuple[float, ...]
    context: tuple[int, int]
    distractors: tuple[str, ...] = ()
    query: tuple[str, ...] = ()


def corpus_tokens(texts, tokenizer, max_tokens: int = 1 << 22) -> np.ndarray:
    """A corpus haystack: the documents' tokens joined by " " (no BOS/EOS), int32 `[<= max_tokens]`."""
    out, n = [], 0
    for text in texts:
        if not isinstance(text, str):  # a conversation of a chat source (`ChatTokens`): its rendered text
            text = tokenizer.decode(text.tokens)
        ids = np.asarray(tokenizer.encode(" " + text.strip()), np.int32)
        out.append(ids)
        n += ids.size
        if n >= max_tokens:
            break
    return np.concatenate(out)[:max_tokens] if out else np.zeros(0, np.int32)


def case_depths(n: int) -> list[float]:
    """Depths of the asked needle over `n` cases: evenly spaced over [0, 1] (0.5 for one case)."""
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def as_task(task: Task | str) -> Task:
    """`task`, or the `Task` of that name in `TASKS` (ValueError for a name not in it)."""
    if isinstance(task, str):
        if task not in TASKS:
            raise ValueError(f"ruler task {task!r} is unknown; give one of {sorted(TASKS)}")
        return TASKS[task]
    return task


def make_cases(task: Task | str, tokenizer, length: int, n: int, *, seed: int = 0,
               corpus: np.ndarray | None = None) -> list[RulerCase]:
    """`n` cases of `task` at exactly `length` tokens (see the module docstring).

    Args:
      task: a `Task` or a name in `TASKS`. tokenizer: the run's (`jaxlong.data.run_tokenizer`). length: tokens
        per input (the case holds length + 1). n: cases; case i's asked needle at depth `case_depths(n)[i]`.
      seed: fixes every case. corpus: int32 tokens of the run's text (`corpus_tokens`), for "corpus" haystacks.

    Raises:
      ValueError: an unknown task or field value, a length too short for the task's fixed parts (the message
        gives the least length), a value kind the tokenizer cannot spell, a corpus haystack without `corpus`.
    """
    task = as_task(task)
    if task.family not in ("niah", "vt", "cwe", "fwe"):
        raise ValueError(f"ruler task {task.name}: family={task.family!r}; give 'niah', 'vt', 'cwe' or 'fwe'")
    if task.family == "niah" and task.haystack not in ("filler", "corpus", "needles"):
        raise ValueError(f"ruler task {task.name}: haystack={task.haystack!r}; give 'filler', 'corpus' or 'needles'")
    if task.family == "cwe" and not task.freq_common > task.freq_rare >= 1:
        raise ValueError(f"ruler task {task.name}: freq_common={task.freq_common} must exceed freq_rare="
                         f"{task.freq_rare} >= 1 (the common words must be the most common)")
    if n < 1 or length < 1:
        raise ValueError(f"ruler task {task.name}: give at least one case (n={n}) of a positive length ({length})")
    pieces = Pieces(tokenizer)
    lex = Lexicon(pieces)
    if task.family in ("niah", "vt"):
        lex.check(task.values, f"{task.name}: values")
    if task.family == "niah":
        lex.check(task.keys, f"{task.name}: keys")
        if task.haystack == "corpus" and (corpus is None or len(corpus) == 0):
            raise ValueError(f"ruler task {task.name} needs the run's corpus text for its haystack (corpus tokens)")
    make = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}[task.family]
    out = []
    for i, depth in enumerate(case_depths(n)):
        rng = np.random.default_rng([seed, length, i, zlib.crc32(task.name.encode())])
        out.append(make(task, pieces, lex, rng, length, depth, i, corpus))
    return out


# ----------------------------------------------------------------------------------------------
# Assembly.


def _bos(pieces: Pieces) -> np.ndarray:
    bos = pieces.tokenizer.bos_id
    return np.zeros(0, np.int32) if bos is None else np.array([bos], np.int32)


class TooShort(ValueError):
    """A length too short for a task's fixed parts; `least` is the least length (tokens) that holds them."""

    def __init__(self, message: str, least: int):
        super().__init__(message)
        self.least = least


def _too_short(task: Task, length: int, need: int) -> TooShort:
    return TooShort(f"ruler task {task.name}: length {length} is too short for its fixed parts with this "
                    f"tokenizer; use at least {need} tokens", need)


def _filler(pieces: Pieces, n: int) -> np.ndarray:
    """`n` tokens of the repeated filler, encoded a sentence at a time (" The grass is green." ...)."""
    unit = np.concatenate([pieces(" " + x.strip() + ".") for x in FILLER.split(".") if x.strip()])
    return np.tile(unit, n // unit.size + 1)[:n]


def _occurs(seq: np.ndarray, sub: np.ndarray) -> bool:
    """Whether `sub` is a contiguous run of `seq`."""
    if sub.size == 0 or sub.size > seq.size:
        return False
    cand = np.flatnonzero(seq[: seq.size - sub.size + 1] == sub[0])
    for k in range(1, sub.size):
        cand = cand[seq[cand + k] == sub[k]]
    return cand.size > 0


@dataclass(frozen=True)
class _Sections:
    """A case's tokens in order, each int32 `[n]`: `head` (BOS, any filler pad, the instructions), `context` (the
    haystack with its needles, or the list), `tail` (the question) and `answer`."""

    head: np.ndarray
    context: np.ndarray
    tail: np.ndarray
    answer: np.ndarray


def _case(task, length, index, sections: _Sections, items, item_starts, needle_starts, distractors=(), query=()):
    """Concatenate `head context tail answer` of `sections`; `item_starts` and `needle_starts`, positions in the
    context, are shifted to the input."""
    head, context, answer = sections.head, sections.context, sections.answer
    tokens = np.concatenate([head, context, sections.tail, answer]).astype(np.int32)
    assert tokens.size == length + 1, (tokens.size, length)
    off = head.size
    return RulerCase(task.name, length, index, tokens, np.arange(length - answer.size, length), tuple(items),
                     "".join(f"{',' if i else ''} {x}" for i, x in enumerate(items)),
                     tuple(off + s for s in item_starts), tuple((off + s) / length for s in needle_starts),
                     (off, off + context.size), tuple(distractors), tuple(query))


def _insert(hay: np.ndarray, needles: list[tuple[float, np.ndarray]], pieces: Pieces) -> tuple[np.ndarray, list[int]]:
    """Needles (depth in [0, 1], tokens) put into `hay` at the sentence boundary (after a token that ends in
    ".") nearest token index round(depth * len(hay)), or at that index when the haystack has no boundary;
    returns the context and each needle's start in it (needles at one index keep their order)."""
    ends = [i for i in np.unique(hay) if pieces.ends_sentence(int(i))]
    bounds = np.concatenate([[0], np.flatnonzero(np.isin(hay, ends)) + 1])
    at = []
    for d, _ in needles:
        a = int(round(d * hay.size))
        k = int(np.searchsorted(bounds, a))
        near = [b for b in bounds[max(k - 1, 0):k + 1]]
        at.append(a if len(bounds) == 1 else int(min(near, key=lambda b: (abs(b - a), b))))
    order = sorted(range(len(needles)), key=lambda k: (at[k], k))
    parts, starts, prev, shift = [], [0] * len(needles), 0, 0
    for k in order:
        parts.append(hay[prev:at[k]])
        starts[k] = at[k] + shift
        parts.append(needles[k][1])
        shift += needles[k][1].size
        prev = at[k]
    parts.append(hay[prev:])
    return np.concatenate(parts), starts


def _haystack(task, pieces, rng, n, corpus, distractor_needles):
    if task.haystack == "filler" or n == 0:
        return _filler(pieces, n)
    if task.haystack == "corpus":
        start = int(rng.integers(corpus.size))
        return np.resize(np.roll(corpus, -start), n)
    pool = distractor_needles
    out, size = [], 0
    while size < n:
        out.append(pool[int(rng.integers(len(pool)))])
        size += out[-1].size
    return np.concatenate(out)[:n]


# ----------------------------------------------------------------------------------------------
# The families.


def _niah(task, pieces, lex, rng, length, depth, index, corpus):
    kind = task.values  # "numbers", "words" or "uuids", as in RULER's needle text
    n_keys = max(task.num_keys, task.num_queries)
    for _ in range(100):  # redraw in the rare case an item also occurs in the haystack
        keys = lex.draw(rng, task.keys, n_keys)
        asked = keys[: task.num_queries]
        values = lex.draw(rng, task.values, task.num_values * task.num_queries + (n_keys - task.num_queries))
        answer_needles = [(key, v) for q, key in enumerate(asked)  # (key, value) of the asked keys
                          for v in values[q * task.num_values:(q + 1) * task.num_values]]
        others = list(zip(keys[task.num_queries:], values[len(answer_needles):]))
        pool = []
        if task.haystack == "needles":
            pool_keys = lex.draw(rng, task.keys, POOL, exclude=keys)
            pool_values = lex.draw(rng, task.values, POOL, exclude=values)
            pool = [pieces.fill(NEEDLE, kind=kind, key=k, value=v) for k, v in zip(pool_keys, pool_values)]
        needles = [pieces.fill(NEEDLE, kind=kind, key=k, value=v) for k, v in answer_needles + others]
        head = np.concatenate([_bos(pieces), pieces(NIAH_HEAD.format(kind=kind))])
        tail = np.concatenate([pieces(NIAH_QUESTION.format(kind=kind)), pieces.join(asked),
                               pieces(NIAH_ANSWER.format(kind=kind)), pieces.join(asked), pieces(" are:")])
        n_hay = length + 1 - head.size - sum(x.size for x in needles) - tail.size
        # the answer's size depends on the order of appearance only through its items, not their order
        n_hay -= pieces.join([v for _, v in answer_needles]).size
        if n_hay < 0:
            raise _too_short(task, length, length - n_hay)
        hay = _haystack(task, pieces, rng, n_hay, corpus, pool)
        if any(_occurs(hay, pieces.slot(s)) for s in keys + values):
            continue
        depths = [depth] + [float(d) for d in rng.random(len(needles) - 1)]
        context, starts = _insert(hay, list(zip(depths, needles)), pieces)
        value_at = [s + pieces.fill(NEEDLE.split(" {value}")[0], kind=kind, key=k).size
                    for s, (k, _) in zip(starts, answer_needles)]
        n_ans = len(answer_needles)  # several values: in order of appearance; else in the order asked
        order = sorted(range(n_ans), key=lambda j: starts[j]) if task.num_values > 1 else list(range(n_ans))
        items = [answer_needles[j][1] for j in order]
        return _case(task, length, index, _Sections(head, context, tail, pieces.join(items)), items,
                     [value_at[j] for j in order], starts[:n_ans], [v for _, v in others], asked)
    raise ValueError(f"ruler task {task.name}: could not draw needles absent from the haystack")


def _vt(task, pieces, lex, rng, length, depth, index, corpus):
    names = lex.variables(rng, task.chains * (task.hops + 1))
    values = lex.draw(rng, task.values, task.chains, digits=5)
    chains = [names[c * (task.hops + 1):(c + 1) * (task.hops + 1)] for c in range(task.chains)]
    statements, depths = [], []
    for c, chain in enumerate(chains):
        span = [depth / 2 + 0.5 * j / max(task.hops, 1) for j in range(task.hops + 1)] if c == 0 else \
            sorted(float(d) for d in rng.random(task.hops + 1))
        for j, var in enumerate(chain):
            statements.append(pieces.fill(VT_FIRST, var=var, value=values[c]) if j == 0 else
                              pieces.fill(VT_NEXT, var=var, prev=chain[j - 1]))
            depths.append(span[j])
    head = np.concatenate([_bos(pieces), pieces(VT_HEAD)])
    tail = np.concatenate([pieces(VT_QUESTION), pieces.slot(values[0]), pieces(VT_ANSWER)])
    answer = pieces.join(chains[0])
    n_hay = length + 1 - head.size - sum(s.size for s in statements) - tail.size - answer.size
    if n_hay < 0:
        raise _too_short(task, length, length - n_hay)
    context, starts = _insert(_filler(pieces, n_hay), list(zip(depths, statements)), pieces)
    var_at = [s + pieces(" VAR").size for s in starts[: task.hops + 1]]
    return _case(task, length, index, _Sections(head, context, tail, answer), chains[0], var_at,
                 starts[: task.hops + 1], [v for chain in chains[1:] for v in chain], [values[0]])


def _list_case(task, pieces, length, index, head_text, tail, items, entries, listed):
    """cwe/fwe: `[BOS] pad head list tail answer`, the pad being filler that makes the length exact."""
    bos, head = _bos(pieces), pieces(head_text)
    answer = pieces.join(items)
    body = np.concatenate(entries)
    pad = length + 1 - bos.size - head.size - body.size - tail.size - answer.size
    assert pad >= 0, pad
    first = [listed.index(w) for w in items]
    starts = np.concatenate([[0], np.cumsum([e.size for e in entries])])
    item_starts = [int(starts[k] + entries[k].size - pieces.slot(w).size) for k, w in zip(first, items)]
    return _case(task, length, index, _Sections(np.concatenate([bos, _filler(pieces, pad), head]), body, tail, answer),
                 items, item_starts, [])


def _numbering(pieces: Pieces, n: int) -> np.ndarray:
    """Token counts of the list numbers " 1.", " 2.", ..., " n." (int `[n]`)."""
    if pieces.tokenizer.name == "byte":
        return np.array([len(str(k)) + 2 for k in range(1, n + 1)], np.int64)
    return np.array([pieces(f" {k}.").size for k in range(1, n + 1)], np.int64)


def _cwe(task, pieces, lex, rng, length, depth, index, corpus):
    english = list(lex.nouns + lex.adjectives)
    rng.shuffle(english)
    common = english[: task.num_common]
    tail = pieces(CWE_QUESTION.format(n=task.num_common))
    budget = length + 1 - _bos(pieces).size - pieces(CWE_HEAD).size - tail.size - pieces.join(common).size
    n_common = task.num_common * task.freq_common
    n_max = max(budget // 2, n_common)  # every entry takes two tokens at least
    numbers = np.cumsum(_numbering(pieces, n_max))
    common_size = task.freq_common * sum(pieces.slot(w).size for w in common)
    if n_common > n_max or numbers[n_common - 1] + common_size > budget:
        raise _too_short(task, length, length + int(numbers[min(n_common, n_max) - 1]) + common_size - budget)
    rare = english[task.num_common:]
    n_rare_max = (n_max - n_common) // task.freq_rare
    if n_rare_max > len(rare):
        rare += lex.coded_words(rng, n_rare_max - len(rare), exclude=english)
    rare_size = np.concatenate([[0], np.cumsum([pieces.slot(w).size for w in rare[:n_rare_max]])])
    fits = [n for n in range(n_rare_max + 1)
            if (n_common + n * task.freq_rare == 0 or
                numbers[n_common + n * task.freq_rare - 1] + common_size + task.freq_rare * rare_size[n] <= budget)]
    n_rare = fits[-1]
    words = common * task.freq_common + rare[:n_rare] * task.freq_rare
    listed = [words[k] for k in rng.permutation(len(words))]
    entries = [np.concatenate([pieces(f" {k + 1}."), pieces.slot(w)]) for k, w in enumerate(listed)]
    items = sorted(common, key=listed.index)
    return _list_case(task, pieces, length, index, CWE_HEAD, tail, items, entries, listed)


def _fwe(task, pieces, lex, rng, length, depth, index, corpus):
    head_text = FWE_HEAD.format(n=task.top)
    tail = pieces(FWE_QUESTION.format(n=task.top))
    vocab = lex.coded_words(rng, 1024)
    slots = [pieces.slot(w) for w in vocab]
    sizes = np.array([s.size for s in slots])
    p = 1.0 / np.arange(1, len(vocab) + 1) ** task.alpha
    p /= p.sum()
    # room for the longest possible answer; the filler pad takes what the actual answer leaves
    longest = int(np.sort(sizes)[-task.top:].sum()) + (task.top - 1) * pieces(",").size
    budget = length + 1 - _bos(pieces).size - pieces(head_text).size - tail.size - longest
    if budget < 4 * task.top:
        raise _too_short(task, length, length - budget + 4 * task.top)
    for _ in range(200):
        draw = rng.choice(len(vocab), size=budget, p=p)
        n = int(np.searchsorted(np.cumsum(sizes[draw]), budget, side="right"))
        counts = np.bincount(draw[:n], minlength=len(vocab))
        ranked = np.argsort(-counts, kind="stable")[: task.top + 1]
        if np.all(np.diff(counts[ranked]) < 0):  # a strict top, and the next word below it
            listed = [vocab[k] for k in draw[:n]]
            items = [vocab[k] for k in ranked[: task.top]]
            return _list_case(task, pieces, length, index, head_text, tail, items, [slots[k] for k in draw[:n]],
                              listed)
    raise ValueError(f"ruler task {task.name}: length {length} gives no strict top {task.top} words in 200 draws; "
                     f"use a longer length")
