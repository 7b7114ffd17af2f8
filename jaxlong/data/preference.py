"""Preference data for DPO (docs/post-training.md): pairs of a prompt with a chosen and a rejected response, each
response rendered after the prompt with the checkpoint's chat template as SFT data is (`jaxlong.data.chat_data`).

A preference source (`data.format=preference`) is one `.jsonl` file, or a directory of them, with one record per
line in one of TRL's preference formats:

* explicit prompt, conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`;
* explicit prompt, text: `{"prompt": "text", "chosen": "text", "rejected": "text"}` (no template: the prompt as
  `python -m jaxlong.generate` encodes a plain prompt, the response, EOS);
* implicit prompt, conversational: `{"chosen": [messages], "rejected": [messages]}`, where the prompt is every
  message before the last one, the same in both (a pair whose prompts differ is refused).

**Layout.** A pair is one element of the packed data: the chosen sequence (prompt + chosen) and the rejected one
(prompt + rejected), one after the other in one row, as two segments `2k - 1` and `2k` (the pair is the row's k-th
element), each with positions from 0 and document masking between them. So both halves always go to the same
step, the same row and the same data shard, and the pair's log-probabilities are sums over one row. `seq_len`
counts both halves' next-token pairs: a pair of a `p`-token prompt and responses of `c` and `r` tokens takes
`(p + c - 1) + (p + r - 1)` positions. A pair longer than `seq_len` is never cut (`data.too_long`).

With `data.shared_prompt` a pair holds its prompt once: the tokens both halves start with, up to the first
trained one, are a shared prefix, and the chosen and the rejected tail follow it as two branches that see the
prefix and themselves, never each other (segment ids with branches, `jaxlong.data.groups`,
`jaxlong.core.segments`; positions continue from the prompt). Halves of `c` and `r` tokens (each with the `p`
shared ones) then take `c + r - p + 1` positions instead of `(c - 1) + (r - 1)`. The loss, the metrics and the
reference equal the separate layout's.

The loss mask marks the response tokens of each half (the completion's assistant tokens, end-of-turn included),
the tokens whose log-probabilities DPO sums.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from jaxlong.data.chat import ChatTemplate
from jaxlong.data.chat_data import ChatRecords, ChatTokens, check_messages, encode_conversation
from jaxlong.data.tokenizer import Tokenizer

__all__ = ["PairTokens", "PreferenceRecords", "PreferenceSource", "parse_pair", "encode_pair"]

_FORMATS = ('{"prompt": [messages], "chosen": [messages], "rejected": [messages]}, {"prompt": "text", "chosen": '
            '"text", "rejected": "text"} or {"chosen": [messages], "rejected": [messages]}')


@dataclass(frozen=True)
class PairTokens:
    """One encoded preference pair: the `chosen` and `rejected` sequences (`ChatTokens`: prompt + response, the
    response's tokens `trained`), its `index` in the source, and the frozen reference's summed response
    log-probabilities `(chosen, rejected)` in nats when known (`PreferenceSource.reference`), and whether its row
    holds the prompt once (`shared`, `data.shared_prompt`). `len()` is its next-token pairs, the positions it takes
    in a row."""

    chosen: ChatTokens
    rejected: ChatTokens
    index: int = 0
    reference: tuple[float, float] | None = None
    shared: bool = False

    @property
    def prompt_length(self) -> int:
        """The tokens both halves start with, up to the first trained one of either (`data.shared_prompt`)."""
        c, r = self.chosen.tokens, self.rejected.tokens
        n = min(c.size, r.size)
        differ = np.flatnonzero(c[:n] != r[:n])
        first = min(int(np.flatnonzero(h.trained)[0]) for h in (self.chosen, self.rejected))
        return min(int(differ[0]) if differ.size else n, first)

    def __len__(self) -> int:
        if self.shared:  # the prompt once, then each half's tail after the prompt's last token
            return len(self.chosen) + len(self.rejected) - self.prompt_length + 1
        return len(self.chosen) - 1 + len(self.rejected) - 1


def _empty(response) -> bool:
    if isinstance(response, str):
        return not response.strip()
    return not any(m["content"].strip() for m in response if m["role"] == "assistant")


def parse_pair(obj, where: str) -> dict:
    """A preference record checked: `{'chosen': record, 'rejected': record}`, each a chat record of
    `jaxlong.data.chat_data.parse_record`'s forms (`{'messages', 'first'}` or text `{'prompt', 'completion'}`).

    Raises:
      ValueError: `where` (file:line) and the field: not a format above, an unknown role, no assistant message
        in a response, an empty response, or (implicit prompt) chosen and rejected with different prompts.
    """
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{where}: a preference record needs {_FORMATS}; it has {have}")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if "prompt" in obj:
        prompt = obj["prompt"]
        kinds = {isinstance(x, str) for x in (prompt, chosen, rejected)}
        if len(kinds) != 1:
            raise ValueError(f"{where}: prompt, chosen and rejected must all be text or all lists of messages")
        if isinstance(prompt, str):
            for field, text in (("chosen", chosen), ("rejected", rejected)):
                if _empty(text):
                    raise ValueError(f"{where}: {field} is an empty response")
            return {"chosen": {"prompt": prompt, "completion": chosen},
                    "rejected": {"prompt": prompt, "completion": rejected}}
        prompt = check_messages(prompt, f"{where}: prompt")
    else:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise ValueError(f"{where}: a text pair needs its prompt apart ({{\"prompt\": \"text\", \"chosen\": "
                             f"\"text\", \"rejected\": \"text\"}})")
        c, r = check_messages(chosen, f"{where}: chosen"), check_messages(rejected, f"{where}: rejected")
        if c[:-1] != r[:-1]:
            k = next((i for i, (a, b) in enumerate(zip(c[:-1], r[:-1])) if a != b), min(len(c), len(r)) - 1)
            raise ValueError(f"{where}: chosen and rejected have different prompts (message {k} differs); the "
                             f"implicit-prompt format shares every message before the last")
        prompt, chosen, rejected = c[:-1], c[-1:], r[-1:]
    out = {}
    for field, response in (("chosen", chosen), ("rejected", rejected)):
        response = check_messages(response, f"{where}: {field}")
        if not any(m["role"] == "assistant" for m in response):
            raise ValueError(f"{where}: {field} has no assistant message")
        if _empty(response):
            raise ValueError(f"{where}: {field} is an empty response")
        out[field] = {"messages": prompt + response, "first": len(prompt)}
    return out


def encode_pair(record: dict, tokenizer: Tokenizer, template: ChatTemplate | None, index: int = 0,
                shared: bool = False) -> PairTokens:
    """A parsed pair (`parse_pair`) as `PairTokens`: each half by `jaxlong.data.chat_data.encode_conversation`
    (its response's assistant turns trained).

    `shared`: the pair's row holds the prompt once (`data.shared_prompt`).

    Raises:
      ValueError: see `encode_conversation`, a half with no token to train on, or (`shared`) halves that do not
        start with the same token."""
    halves = []
    for field in ("chosen", "rejected"):
        tokens = encode_conversation(record[field], tokenizer, template, "all")
        if not tokens.trained[1:].any():
            raise ValueError(f"{field}: the response has no token to train on once rendered")
        halves.append(tokens)
    pair = PairTokens(*halves, index=index, shared=shared)
    if shared and pair.prompt_length < 1:
        raise ValueError("data.shared_prompt: chosen and rejected do not start with the same token, so they share "
                         "no prompt to compute once")
    return pair


class PreferenceRecords(ChatRecords):
    """`ChatRecords` of preference records (`parse_pair`)."""

    formats = _FORMATS
    _check = staticmethod(parse_pair)


class PreferenceSource:
    """A random-access source of encoded preference pairs (`PairTokens`) for the data pipeline, built from a
    `.jsonl` path: every pair encoded once here, so bad records and pairs longer than `seq_len` are found before
    anything compiles.

    Args:
      path: the `.jsonl` file or directory; option: its config key for messages.
      tokenizer: the run's tokenizer; template: the chat template (None: text pairs only).
      seq_len: the run's sequence length (a pair takes `len(PairTokens)` positions).
      too_long: `data.too_long` (`refuse` or `drop`).
      shared_prompt: `data.shared_prompt`: each pair's row holds its prompt once (module docstring).

    Attributes:
      dropped: pairs `drop` left out; lengths: positions of each kept pair; halves: `[pairs, 2]` the positions
        of its chosen and its rejected half (each its own document in a row); digest: sha256 of the kept pairs'
        tokens and loss masks; reference: None, or float64
        `[len(self), 2]`, the frozen reference's summed response log-probs of each kept pair (chosen, rejected),
        set by `jaxlong.objectives.reference` before training.

    Raises:
      ValueError: naming the option, the file, the line and the field (`parse_pair`, `encode_pair`), or a pair
        longer than `seq_len` with `too_long=refuse`.
    """

    is_chat = True
    is_preference = True

    def __init__(self, path, tokenizer: Tokenizer, template: ChatTemplate | None, seq_len: int,
                 too_long: str = "refuse", option: str = "data.path", shared_prompt: bool = False):
        self.records = PreferenceRecords(path, option)
        self.tokenizer, self.template, self.path = tokenizer, template, path
        self.shared_prompt = bool(shared_prompt)
        keep, lengths, halves, digest = [], [], [], hashlib.sha256()
        for i in range(len(self.records)):
            try:
                pair = encode_pair(self.records[i], tokenizer, template, shared=shared_prompt)
            except ValueError as e:
                raise ValueError(f"{option}: {self.records.where(i)}: {e}") from None
            n = len(pair)
            if n > seq_len and too_long == "refuse":
                raise ValueError(f"{option}: {self.records.where(i)}: the pair takes {n:,} positions (chosen and "
                                 f"rejected, {'after one prompt' if shared_prompt else 'each with its prompt'}), more "
                                 f"than seq_len={seq_len:,}; a pair is never cut: raise seq_len, or leave such ones "
                                 f"out with data.too_long=drop")
            if n <= seq_len:
                keep.append(i)
                lengths.append(n)
                halves.append((len(pair.chosen) - 1, len(pair.rejected) - 1))
                for half in (pair.chosen, pair.rejected):
                    digest.update(half.tokens.tobytes() + half.trained.tobytes())
        self.keep, self.lengths, self.digest = keep, np.asarray(lengths, np.int64), digest.hexdigest()
        self.halves = np.asarray(halves, np.int64).reshape(-1, 2)
        self.dropped = len(self.records) - len(keep)
        self.reference: np.ndarray | None = None
        if not keep:
            raise ValueError(f"{option}: all {len(self.records):,} pairs are longer than seq_len={seq_len:,}")

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int) -> PairTokens:
        index = int(index)
        pair = encode_pair(self.records[self.keep[index]], self.tokenizer, self.template, index, self.shared_prompt)
        if self.reference is None:
            return pair
        return PairTokens(pair.chosen, pair.rejected, index, tuple(map(float, self.reference[index])), pair.shared)

    def __repr__(self) -> str:
        return f"PreferenceSource(path={self.path!r}, pairs={len(self)}, dropped={self.dropped})"
