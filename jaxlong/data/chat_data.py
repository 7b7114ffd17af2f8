"""Chat data for supervised fine-tuning (SFT): conversations rendered with the checkpoint's chat template, with the
loss on the assistant's tokens only (docs/post-training.md).

A chat source (`data.format=chat`, or `format: chat` on one of `data.sources`) is one `.jsonl` file, or a
directory of them, with one record per line, in one of the formats TRL reads:

* `{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}`: a conversation,
  rendered by the chat template; the loss is on its assistant turns (`data.chat_turns=all`) or on its last one
  (`last`).
* `{"prompt": [messages], "completion": [messages]}`: conversational prompt-completion, rendered as one
  conversation; the loss is on the completion's assistant turns.
* `{"prompt": "text", "completion": "text"}`: plain prompt-completion, no template: the prompt as
  `python -m jaxlong.generate` encodes a plain prompt (BOS where the tokenizer adds one), the completion, EOS; the
  loss on the completion and EOS.

The template places the special tokens, so a conversation bypasses the document wrapping `[BOS] ids [EOS]` of
text sources. Its rendered text is tokenized whole, as transformers' `apply_chat_template` tokenizes it, and a
token is trained when its characters overlap an assistant span (as transformers' `return_assistant_tokens_mask`
marks them). The spans are found in one of two ways:

* the template's `{% generation %}` tags, where it has them: each tag's body is a span;
* else turn by turn: the span of assistant turn i is what `messages[:i + 1]` renders beyond `messages[:i]` with
  the generation prompt, the end-of-turn text included. This holds only for a template that renders earlier turns
  the same way later; one that does not (Qwen3's drops the reasoning of past turns) is refused with
  `data.chat_turns=all` (the message says so) and works with `data.chat_turns=last`, which needs only the last
  turn's prefix to hold.

Every conversation is rendered and tokenized when the source is built, before anything compiles: a record that
is not one of the formats above, a template that refuses it, or one longer than `seq_len` tokens (next-token
pairs) is reported with its file and line. A conversation longer than `seq_len` is never cut:
`data.too_long=refuse` (default) stops with the first such one, `drop` leaves them out and reports how many.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from jaxlong.data.chat import ChatTemplate
from jaxlong.data.sources import corpus_files
from jaxlong.data.tokenizer import Tokenizer

__all__ = ["ChatTokens", "ChatRecords", "ChatSource", "encode_conversation", "template_directory",
           "check_messages", "ROLES", "DataFormat", "ChatTurns", "TooLong"]

DataFormat = Literal["text", "chat", "preference"]  # `data.format`, a source's `format` (preference: DPO pairs)
ChatTurns = Literal["all", "last"]  # `data.chat_turns`
TooLong = Literal["refuse", "drop"]  # `data.too_long`
_FORMATS = ('{"messages": [{"role": ..., "content": ...}, ...]}, {"prompt": [messages], "completion": [messages]} '
            'or {"prompt": "text", "completion": "text"}')


@dataclass(frozen=True)
class ChatTokens:
    """One encoded conversation: `tokens` int32 `[n]` as the template renders it, `trained` bool `[n]` (token k is
    a target the loss counts: an assistant token). `len()` is its token count."""

    tokens: np.ndarray
    trained: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.size)


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")  # the roles chat templates render


def check_messages(value, where: str) -> list[dict]:
    """`value` checked as a non-empty list of messages `{"role": str, "content": str}` with a role of `ROLES`.

    Raises:
      ValueError: `where` (file:line: field), the message's index and what is wrong."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of messages")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{k}] must be a message {{\"role\": str, \"content\": str}}, not {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}[{k}]: unknown role {m['role']!r}; the roles are {', '.join(ROLES)}")
    return value


def parse_record(obj, where: str) -> dict:
    """A chat record in one of the module's formats, checked: `{'messages': [...], 'first': k}` (the loss on the
    assistant turns from message `k` on) or `{'prompt': str, 'completion': str}`.

    Raises:
      ValueError: `where` (file:line) and the formats accepted.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a chat record must be a JSON object: {_FORMATS}")
    if "messages" in obj:
        messages = check_messages(obj["messages"], f"{where}: messages")
        first = 0
    elif "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"prompt": prompt, "completion": completion}
        if isinstance(prompt, str) or isinstance(completion, str):
            raise ValueError(f"{where}: prompt and completion must both be text or both lists of messages, not one "
                             f"of each")
        messages = check_messages(prompt, f"{where}: prompt") + check_messages(completion, f"{where}: completion")
        first = len(prompt)
    else:
        raise ValueError(f"{where}: a chat record needs {_FORMATS}; it has {sorted(obj)}")
    if not any(m["role"] == "assistant" for m in messages[first:]):
        raise ValueError(f"{where}: no assistant message to train on")
    return {"messages": messages, "first": first}


class ChatRecords:
    """The records of the `.jsonl` files of `path` (a file or a directory), one per non-blank line, each checked by
    `parse_record` when indexed; random access by index returns the parsed record. `where(i)` is `file:line`."""

    formats = _FORMATS

    def __init__(self, path: str | Path, option: str = "data.path"):
        files = corpus_files(path)
        bad = [f for f in files if f.suffix != ".jsonl"]
        if bad:
            raise ValueError(f"{option}={str(path)!r}: this source is .jsonl (one record per line: {self.formats}); "
                             f"{bad[0]} is not")
        self.refs: list[tuple[str, int, int]] = []
        for f in files:
            offset = 0
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        self._parse(line, f"{f}:{lineno}")
                        self.refs.append((str(f), offset, lineno))
                    offset += len(line)
        if not self.refs:
            raise ValueError(f"{option}={str(path)!r}: no records")

    @classmethod
    def _parse(cls, line: bytes, where: str) -> dict:
        try:
            obj = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e})") from None
        return cls._check(obj, where)

    _check = staticmethod(parse_record)

    def __len__(self) -> int:
        return len(self.refs)

    def where(self, index: int) -> str:
        return f"{self.refs[index][0]}:{self.refs[index][2]}"

    def __getitem__(self, index: int) -> dict:
        path, offset, _ = self.refs[index]
        with open(path, "rb") as f:
            f.seek(offset)
            return self._parse(f.readline(), self.where(index))


def template_directory(tokenizer: Tokenizer) -> Path | None:
    """The directory of a Hugging Face tokenizer's files (where its chat template is), None for the byte one."""
    name = getattr(tokenizer, "name", "byte")
    if name == "byte":
        return None
    p = Path(name)
    return p if p.is_dir() else p.parent


def _spans_by_turn(template: ChatTemplate, messages: list[dict], turns: list[int], text: str,
                   last: bool) -> list[tuple]:
    spans = []
    for i in turns:
        before = template.render(messages[:i], add_generation_prompt=True) if i else ""
        through = template.render(messages[:i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            way = "give a template with {% generation %} tags (data.chat_template)" if last else \
                "train the last assistant turn only (data.chat_turns=last), or give a template with " \
                "{% generation %} tags (data.chat_template)"
            raise ValueError(f"the chat template renders assistant turn {i} differently once the turns after it or "
                             f"its generation prompt are there (as Qwen3's drops past turns' reasoning, or a "
                             f"generation prompt that opens a think block), so the turn cannot be told apart by "
                             f"rendering turn by turn: {way}")
        spans.append((len(before), len(through)))
    return spans


def encode_conversation(record: dict, tokenizer: Tokenizer, template: ChatTemplate | None,
                        turns: str = "all") -> ChatTokens:
    """One record (`parse_record`) as tokens and their loss mask.

    Args:
      record: a parsed chat record.
      tokenizer: the run's tokenizer (`encode_offsets`).
      template: the chat template (`ChatTemplate(..., mark_generation=True)` to use `{% generation %}` tags where
        the template has them); None only for plain prompt-completion records.
      turns: `data.chat_turns`: `all` assistant turns (from the record's first trained message) or the `last`.

    Returns:
      `ChatTokens`: `tokens` `[n]`, `trained` `[n]` (token k's characters overlap an assistant span).

    Raises:
      ValueError: no template for a conversation, the template refuses the messages, or (turn by turn, `all`) a
        template whose earlier turns render differently later.
    """
    if "prompt" in record:  # plain text: the prompt as generation encodes it, the completion, EOS
        p, c = tokenizer.encode_prompt(record["prompt"]), tokenizer.encode(record["completion"])
        tokens = np.concatenate([p, c, [tokenizer.eos_id]]).astype(np.int32)
        trained = np.zeros(tokens.size, bool)
        trained[p.size:] = True
        return ChatTokens(tokens, trained)
    if template is None:
        raise ValueError("a conversation needs a chat template: the tokenizer's directory has none and "
                         "data.chat_template is not set (configs/chat_templates/chatml.jinja is a ChatML one)")
    messages, first = record["messages"], record.get("first", 0)
    index = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assistant = [i for i in index if i >= first]
    chosen = assistant if turns == "all" else assistant[-1:]
    if template.marks_generation:
        text, spans = template.render_spans(messages)
        if len(spans) != len(index):
            raise ValueError(f"the chat template's {{% generation %}} tags mark {len(spans)} spans for "
                             f"{len(index)} assistant messages")
        spans = [s for i, s in zip(index, spans) if i in chosen]
    else:
        text = template.render(messages, add_generation_prompt=False)
        spans = _spans_by_turn(template, messages, chosen, text, turns == "last")
    ids, offsets = tokenizer.encode_offsets(text)
    trained = np.zeros(ids.size, bool)
    for a, b in spans:
        trained |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return ChatTokens(ids.astype(np.int32), trained)


class ChatSource:
    """A random-access source of encoded conversations (`ChatTokens`) for the data pipeline
    (`jaxlong.data.make_dataset`), built from a chat `.jsonl` path: every record encoded once here, so bad records
    and conversations longer than `seq_len` are found before anything compiles.

    Args:
      path: the `.jsonl` file or directory; option: its config key, for messages (`data.path`,
        `data.sources[i] (PATH)`).
      tokenizer: the run's tokenizer; template: the chat template (None: plain prompt-completion only).
      seq_len: the run's sequence length (a conversation of `n` tokens is `n - 1` next-token pairs).
      turns: `data.chat_turns`; too_long: `data.too_long` (`refuse` or `drop`).

    Attributes:
      dropped: how many conversations `drop` left out; lengths: next-token pairs of each kept one.

    Raises:
      ValueError: naming the option, the file and line: see `ChatRecords`, `encode_conversation`, and a
        conversation longer than `seq_len` with `too_long=refuse` (the message gives both ways out).
    """

    is_chat = True

    def __init__(self, path, tokenizer: Tokenizer, template: ChatTemplate | None, seq_len: int, turns: str = "all",
                 too_long: str = "refuse", option: str = "data.path"):
        self.records = ChatRecords(path, option)
        self.tokenizer, self.template, self.turns, self.path = tokenizer, template, turns, path
        keep, lengths = [], []
        for i in range(len(self.records)):
            try:
                n = len(self._encode(i)) - 1
            except ValueError as e:
                raise ValueError(f"{option}: {self.records.where(i)}: {e}") from None
            if n > seq_len and too_long == "refuse":
                raise ValueError(f"{option}: {self.records.where(i)} is {n + 1:,} tokens ({n:,} next-token pairs), "
                                 f"more than seq_len={seq_len:,} pairs; a conversation is never cut: raise seq_len, "
                                 f"or leave such ones out with data.too_long=drop")
            if n <= seq_len:
                keep.append(i)
                lengths.append(n)
        self.keep, self.lengths = keep, np.asarray(lengths, np.int64)
        self.dropped = len(self.records) - len(keep)
        if not keep:
            raise ValueError(f"{option}: all {len(self.records):,} conversations are longer than seq_len={seq_len:,}")

    def _encode(self, index: int) -> ChatTokens:
        return encode_conversation(self.records[index], self.tokenizer, self.template, self.turns)

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int) -> ChatTokens:
        return self._encode(self.keep[int(index)])

    def __repr__(self) -> str:
        return f"ChatSource(path={self.path!r}, conversations={len(self)}, dropped={self.dropped})"
