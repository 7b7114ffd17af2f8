"""Long-context probes: loss by token position (log-spaced buckets) and teacher-forced passkey retrieval
(Mohtashami & Jaggi 2023, the LongLoRA passkey test, arXiv 2309.12307 §4)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


def position_buckets(seq_len: int) -> np.ndarray:
    """Log-spaced bucket edges over token positions `[0, seq_len)`: 0, 1, 2, 4, ..., seq_len (powers of two,
    the last edge `seq_len`). Bucket i is positions `[edges[i], edges[i + 1])`."""
    edges = [0] + [2**k for k in range(int(math.log2(max(seq_len, 1))) + 1) if 2**k < seq_len] + [seq_len]
    return np.array(sorted(set(edges)), np.int64)


class PositionLoss:
    """Accumulates per-token losses `[b, s]` (with mask) into log-spaced position buckets."""

    def __init__(self, seq_len: int):
        self.edges = position_buckets(seq_len)
        self.sums = np.zeros(self.edges.size - 1)
        self.counts = np.zeros(self.edges.size - 1)

    def add(self, loss: np.ndarray, mask: np.ndarray) -> None:
        loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
        for i, (a, b) in enumerate(zip(self.edges[:-1], self.edges[1:])):
            self.sums[i] += float(np.sum(loss[:, a:b] * mask[:, a:b]))
            self.counts[i] += float(np.sum(mask[:, a:b]))

    def rows(self) -> list[dict]:
        """One dict per bucket: `start`, `end` (exclusive), `tokens`, `loss` (mean nats/token, nan if empty)."""
        return [
            {"start": int(a), "end": int(b), "tokens": int(c), "loss": s / c if c else float("nan")}
            for a, b, s, c in zip(self.edges[:-1], self.edges[1:], self.sums, self.counts)
        ]


# ----------------------------------------------------------------------------------------------
# Passkey retrieval.

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is {key}"


@dataclass(frozen=True)
class PasskeyExample:
    """One passkey sequence: `tokens` int32 `[length + 1]` (inputs = tokens[:-1], targets = tokens[1:]), the
    `answer` token positions in the targets (the key's last `len(key)` targets), the `key` and the actual
    `depth` (needle start / filler length)."""

    tokens: np.ndarray
    answer: np.ndarray
    key: str
    depth: float


def passkey_min_length(encode: Callable[[str], np.ndarray], digits: int) -> int:
    """The shortest sequence (tokens) that holds the passkey needle and question with a `digits`-digit key under
    the tokenizer `encode` (`passkey_example` needs at least this length)."""
    key = "9" * digits
    return len(encode(NEEDLE.format(key=key))) + len(encode(QUESTION.format(key=key))) - 1


def passkey_example(encode: Callable[[str], np.ndarray], length: int, depth: float, key: str) -> PasskeyExample:
    """Filler text with a needle "The pass key is KEY. Remember it. KEY is the pass key." planted at `depth`
    (0 = start of the text, 1 = just before the question), ending with "What is the pass key? The pass key is
    KEY" so that the key's tokens are the last targets (Mohtashami & Jaggi 2023, the LongLoRA passkey test).

    Args:
      encode: tokenizer `str -> int [n]`.
      length: sequence length S (the example has S + 1 tokens).
      depth: needle depth in [0, 1].
      key: the passkey, e.g. "48213".

    Raises:
      ValueError: `length` cannot hold the needle and the question, or depth is outside [0, 1].
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth={depth} must be in [0, 1]")
    needle = np.asarray(encode(NEEDLE.format(key=key)), np.int32)
    question = np.asarray(encode(QUESTION.format(key=key)), np.int32)
    answer_len = len(np.asarray(encode(key)))
    n_filler = length + 1 - needle.size - question.size
    if n_filler < 0:
        raise ValueError(f"passkey length={length} is too short for the needle and question "
                         f"({needle.size + question.size - 1} tokens at least)")
    unit = np.asarray(encode(FILLER), np.int32)
    filler = np.tile(unit, n_filler // unit.size + 1)[:n_filler]
    at = int(round(depth * n_filler))
    tokens = np.concatenate([filler[:at], needle, filler[at:], question])
    answer = np.arange(length - answer_len, length)
    return PasskeyExample(tokens, answer, key, at / max(n_filler, 1))


def random_key(rng: np.random.Generator, digits: int) -> str:
    """A `digits`-digit decimal passkey with a nonzero first digit."""
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))


def passkey_batch(examples: list[PasskeyExample]) -> dict:
    """Host batch `{'inputs', 'targets', 'mask', 'positions', 'segment_ids'}` `[len(examples), S]` of same-length
    passkey examples (one document per row); the mask covers the answer positions only."""
    tokens = np.stack([e.tokens for e in examples])
    mask = np.zeros(tokens[:, 1:].shape, np.float32)
    for i, e in enumerate(examples):
        mask[i, e.answer] = 1.0
    b, s = mask.shape
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
            "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
            "segment_ids": np.ones((b, s), np.int32)}  # one document per row


def score_passkey(predict: Callable[[dict], np.ndarray], encode: Callable[[str], np.ndarray], *,
                  lengths: list[int], depths: list[float], per_cell: int, batch_size: int, digits: int = 5,
                  seed: int = 0, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Teacher-forced passkey retrieval accuracy on a `depth x length` grid.

    Args:
      predict: `batch -> argmax [b, S]` (host numpy; e.g. the argmax of `make_token_stats_step`), called with
        `passkey_batch` batches of `batch_size` same-length examples.
      encode: tokenizer `str -> int [n]`.
      lengths, depths: the grid; per_cell: examples per cell, exactly. The examples of one length, cell by cell,
        fill batches of `batch_size` across cells (the last batch of a length filled with repeats of its last
        example, not counted): `ceil(len(depths) * per_cell / batch_size)` forwards per length.
      digits: passkey length in digits; seed: fixes keys (and so the examples: drawn length by length, then depth
        by depth, `per_cell` each).
      progress: called with the number of examples counted after each forward.

    Returns:
      float `[len(depths), len(lengths)]`: the fraction of examples whose argmax equals the target at every
      answer position (all of the key's tokens right).
    """
    rng = np.random.default_rng([seed, 2])
    acc = np.zeros((len(depths), len(lengths)))
    for j, length in enumerate(lengths):
        cells = [(i, passkey_example(encode, length, depth, random_key(rng, digits)))
                 for i, depth in enumerate(depths) for _ in range(per_cell)]
        right = np.zeros(len(depths))
        for at in range(0, len(cells), batch_size):
            part = cells[at:at + batch_size]
            examples = [e for _, e in part] + [part[-1][1]] * (batch_size - len(part))
            batch = passkey_batch(examples)
            argmax = np.asarray(predict(batch))
            for k, (i, e) in enumerate(part):
                right[i] += bool(np.all(argmax[k, e.answer] == batch["targets"][k, e.answer]))
            if progress:
                progress(len(part))
        acc[:, j] = right / per_cell
    return acc
