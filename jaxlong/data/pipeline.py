"""The input pipeline on Grain: documents -> shuffle -> tokenize -> pack -> batch, deterministic and resumable.

Stages (`grain.MapDataset` until packing, then `grain.IterDataset`):

1. `MapDataset.source(DocumentSource)` (`jaxlong.data.sources`), cut to `data.max_tokens` tokens if set.
   The documents are dealt to `n` streams (`[s::n]`; `n` is the largest divisor of `global_batch` not
   above the number of documents, so one stream per row for any real corpus), each packed on its own and
   giving `global_batch / n` consecutive rows of every batch. A process builds only the streams that hold the
   rows its devices need (`rows`, from `jaxlong.core.batch.process_rows`: its share when the batch axes span
   the processes, every row when only the sequence axes do) and reads only their documents; the global batch is
   the same whatever the number of processes and whichever mesh axes span them.
2. `shuffle(seed + s)` then `repeat()`: a new permutation every epoch (Grain reseeds per epoch), endless.
   Each stream reads ahead `data.read_buffer` documents on `data.read_threads` threads (Grain's `ReadOptions`);
   the batches do not depend on either.
3. `map`: tokenize one document to `[BOS] ids [EOS]` (`jaxlong.data.tokenizer`) and turn it into
   next-token pairs `inputs = x[:-1]`, `targets = x[1:]`, `positions = 0..n-1`. Targets are built inside
   a document, so no target ever crosses a document boundary, whatever the packing.
4. `data.packing=documents` (default): documents longer than `seq_len` are split into pieces of
   `seq_len` pairs whose positions restart at 0 (`data.split_positions=restart`) or continue from the
   previous piece (`continue`); then Grain's first-fit packing (`grain.experimental.FirstFitPackIterDataset`)
   puts whole pieces into rows of `seq_len`, padding the rest. Its `inputs_segment_ids` (1, 2, ... per row,
   0 = padding) become `segment_ids`.
   `data.packing=concat`: Grain's `ConcatThenSplitIterDataset` concatenates the pairs and cuts rows of
   exactly `seq_len` (no padding); `positions` are the index in the row, and the model treats the row as
   one causal stream (it ignores the segment ids).
5. Each stream batched to its rows, and the process's rows cut from its streams' batches (`ProcessBatches`).

A batch is `{'inputs', 'targets', 'positions', 'segment_ids': int32 [B, L], 'mask': float32 [B, L]}` with
`mask = segment_ids > 0` (no loss on padding). The iterator's `get_state()` is a small JSON-serializable
dict, Grain's state of each of its packing streams by stream index (`{'streams': {'0': ..., ...}}`: the source
index of the packing group in progress and the rows already emitted from it). The states of all processes merge
into one (`merge_states`), which the trainer saves in every checkpoint; `set_state` of any process, under any
process layout, takes its streams' part and continues with exactly the next batch, without reading the corpus
from the start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial, reduce
from itertools import zip_longest
from typing import Literal, get_args

import grain
import numpy as np
from grain.experimental import (
    ConcatThenSplitIterDataset,
    FirstFitPackIterDataset,
    FlatMapIterDataset,
    FlatMapTransform,
)

from jaxlong.data.mixture import (
    SOURCE_FEATURE,
    MixedSource,
    SourceLengths,
    TokenShareMix,
    check_lengths,
    measure_lengths,
    repetition_warnings,
    source_label,
    source_name,
)
from jaxlong.core import segments
from jaxlong.data.chat import run_template
from jaxlong.data.chat_data import ChatSource, ChatTokens, template_directory
from jaxlong.data.groups import group_row
from jaxlong.data.imported import run_tokenizer
from jaxlong.data.preference import PairTokens, PreferenceSource
from jaxlong.data.sources import DocumentSource
from jaxlong.data.tokenizer import Tokenizer

__all__ = ["document_tokens", "document_pairs", "SplitLongDocuments", "DocumentSubset", "token_limit", "make_dataset",
           "PipelineOptions", "ProcessBatches", "ProcessIterator", "merge_states", "batch_iterator",
           "packing_efficiency", "PACKING_BINS", "first_source", "mixture_sources", "source_shares", "open_source",
           "LOSS_FEATURE", "PART_FEATURE", "REFERENCE_FEATURE", "PAIR_FEATURE", "SHARED_FEATURE",
           "is_preference"]

Packing = Literal["documents", "concat"]  # `data.packing`
SplitPositions = Literal["restart", "continue"]  # `data.split_positions`
PACKINGS, SPLIT_POSITIONS = get_args(Packing), get_args(SplitPositions)
PACKING_BINS = 16  # rows first-fit packing fills at once (more bins: less padding)
STAGE_SEED = 1_000_003  # a recipe's stage k shuffles with seed + k * STAGE_SEED (another order for each stage)
_FEATURES = ("inputs", "targets", "positions")
LOSS_FEATURE = "loss"  # int32 per target: 1 where the loss counts it (a chat source's assistant tokens)
# Preference pairs (`jaxlong.data.preference`): which half of its pair a token is in (1 chosen, 2 rejected), the
# reference's summed response log-probs of the half (float32 nats, at the half's first position, 0 elsewhere) and
# the pair's index in its source + 1 (every position), and 1 where the pair holds its prompt once (`part` 0 there
# for the prompt; `data.shared_prompt`).
PART_FEATURE, REFERENCE_FEATURE, PAIR_FEATURE, SHARED_FEATURE = "part", "reference", "pair", "shared"
_PAIR_FEATURES = (PART_FEATURE, REFERENCE_FEATURE, PAIR_FEATURE, SHARED_FEATURE)


@dataclass(frozen=True)
class PipelineOptions:
    """How `make_dataset` turns documents into rows: the options every packing stream of a pipeline shares.
    `make_dataset` checks the values (see its errors); they are the run's `seed` and `data.*` options.

    Attributes:
      seed: the shuffle seed (`seed`; a recipe's stage k adds `k * STAGE_SEED`); packing stream s shuffles and
        packs with `seed + s`.
      packing: `data.packing`: "documents" (whole documents packed first-fit, with segment ids) or "concat" (the
        documents concatenated and cut into full rows).
      split_positions: `data.split_positions`: the positions of the pieces of a document longer than `seq_len`
        restart at 0 ("restart") or continue from the previous piece ("continue"); `packing="documents"` only.
      shuffle: `data.shuffle`: shuffle the documents, a new permutation every epoch (False: corpus order).
      max_tokens: `data.max_tokens`: keep the corpus's first documents up to this many tokens (BOS/EOS
        included), the last one cut (None: the whole corpus).
      repeat: True (training): endless epochs. False (validation): one pass over the documents as one packing
        stream (rows in document order); the last bins are flushed and the iteration ends before the first
        incomplete batch.
      read_threads, read_buffer: `data.read_threads` threads tokenizing ahead and `data.read_buffer` documents
        read ahead, per packing stream (Grain's `ReadOptions`); they change no batch.
    """

    seed: int
    packing: Packing = "documents"
    split_positions: SplitPositions = "restart"
    shuffle: bool = True
    max_tokens: int | None = None
    repeat: bool = True
    read_threads: int = 4
    read_buffer: int = 64

    @property
    def read_options(self) -> grain.ReadOptions:
        """Grain's `ReadOptions` of `read_threads` and `read_buffer`."""
        return grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=self.read_buffer)


def document_tokens(text, tokenizer: Tokenizer) -> np.ndarray:
    """`[BOS] ids [EOS]` int32 (BOS only if the tokenizer has one); a conversation of a chat source
    (`jaxlong.data.chat_data.ChatTokens`) as its template placed its tokens."""
    if isinstance(text, ChatTokens):
        return text.tokens
    if isinstance(text, PairTokens):  # both halves (what a pair takes in a row, + 2)
        return np.concatenate([text.chosen.tokens, text.rejected.tokens])
    ids = tokenizer.encode(text)
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return np.concatenate([np.asarray(head, np.int32), ids.astype(np.int32), np.asarray([tokenizer.eos_id], np.int32)])


def document_pairs(tokens: np.ndarray, trained: np.ndarray | None = None) -> dict:
    """Next-token pairs of one document: `inputs`, `targets`, `positions` int32 `[n - 1]`; with `trained` (bool
    `[n]`: token k is trained on) also `loss` int32 `[n - 1]`, the loss mask of the targets."""
    n = max(tokens.size - 1, 0)
    out = {"inputs": tokens[:-1], "targets": tokens[1:], "positions": np.arange(n, dtype=np.int32)}
    if trained is not None:
        out[LOSS_FEATURE] = trained[1:].astype(np.int32)
    return out


def pairs_of(doc, tokenizer: Tokenizer, loss: bool = False) -> dict:
    """`document_pairs` of one document of any source: a text as `[BOS] ids [EOS]`, a conversation
    (`ChatTokens`) as rendered, with its assistant tokens' loss mask; `loss`: give a text a `loss` of ones too
    (a stream that mixes conversations in)."""
    if isinstance(doc, ChatTokens):
        return document_pairs(doc.tokens, doc.trained)
    if isinstance(doc, PairTokens):
        return _pair_features(doc)
    pairs = document_pairs(document_tokens(doc, tokenizer))
    if loss:
        pairs[LOSS_FEATURE] = np.ones(pairs["inputs"].size, np.int32)
    return pairs


def _pair_features(doc: PairTokens) -> dict:
    """A preference pair as one packed element: chosen then rejected, each with positions from 0; or
    (`doc.shared`) the prompt once, then the two halves' tails as branches 1 and 2 (`jaxlong.data.groups`)."""
    halves = (doc.chosen, doc.rejected)
    if doc.shared:
        p = doc.prompt_length
        g = group_row(doc.chosen.tokens[:p], [h.tokens[p:] for h in halves], 1, [h.trained[p:] for h in halves])
        out = {k: g[k] for k in ("inputs", "targets", "positions")}
        out[LOSS_FEATURE], out[PART_FEATURE] = g["completion"].astype(np.int32), g["branch"]
        firsts = [int(np.argmax(g["branch"] == b)) for b in (1, 2)]
    else:
        parts = [document_pairs(h.tokens, h.trained) for h in halves]
        out = _concat(parts)
        n = [h["inputs"].size for h in parts]
        out[PART_FEATURE] = np.repeat(np.array([1, 2], np.int32), n)
        firsts = [0, n[0]]
    size = out["inputs"].size
    out[REFERENCE_FEATURE] = np.zeros(size, np.float32)
    if doc.reference is not None:
        out[REFERENCE_FEATURE][firsts] = doc.reference
    out[PAIR_FEATURE] = np.full(size, doc.index + 1, np.int32)
    out[SHARED_FEATURE] = np.full(size, int(doc.shared), np.int32)
    return out


def is_chat(source) -> bool:
    """Whether a random-access source yields conversations or pairs (`ChatSource`, `PreferenceSource`, or a subset
    of one): elements with their own loss mask."""
    return bool(getattr(source, "is_chat", False))


def is_preference(source) -> bool:
    """Whether a random-access source yields preference pairs (`PreferenceSource`, or a subset of one)."""
    return bool(getattr(source, "is_preference", False))


class SplitLongDocuments(FlatMapTransform):
    """A document longer than `seq_len` pairs becomes pieces of at most `seq_len`, positions restarting at 0
    (`continue_positions=False`) or continuing; shorter documents pass through unchanged."""

    def __init__(self, seq_len: int, continue_positions: bool):
        self.seq_len, self.continue_positions = seq_len, continue_positions
        self.max_fan_out = 1 << 30

    def flat_map(self, element):
        n, L = element["inputs"].size, self.seq_len
        if n <= L:
            return [element]
        return [{**{k: v[s:s + L] for k, v in element.items() if k != "positions"},
                 "positions": np.arange(s, min(s + L, n), dtype=np.int32) - (0 if self.continue_positions else s)}
                for s in range(0, n, L)]


def token_limit(source: DocumentSource, tokenizer: Tokenizer, max_tokens: int) -> tuple[int, int]:
    """How much of the corpus `data.max_tokens` keeps, in corpus order: `(documents, tokens of the last one)`.

    Tokenizes documents from the start until `max_tokens` tokens (BOS/EOS included) are reached."""
    total = 0
    for i in range(len(source)):
        n = document_tokens(source[i], tokenizer).size
        if total + n >= max_tokens:
            return i + 1, max_tokens - total
        total += n
    return len(source), n


def _finalize(row: dict) -> dict:
    seg = row["inputs_segment_ids"].astype(np.int32)
    mask = (seg > 0) & (row[LOSS_FEATURE] > 0) if LOSS_FEATURE in row else seg > 0
    if PART_FEATURE in row:  # the k-th pair of the row: chosen in segment 2k - 1, rejected in 2k; or one
        part = row[PART_FEATURE]  # document k whose prompt is shared by branches 1 (chosen) and 2 (rejected)
        seg = np.where(row[SHARED_FEATURE] > 0, segments.encode(seg, part), 2 * seg - (part == 1))
        seg = np.where(row["inputs_segment_ids"] > 0, seg, 0).astype(np.int32)
    out = {"inputs": row["inputs"].astype(np.int32), "targets": row["targets"].astype(np.int32),
           "positions": row["positions"].astype(np.int32), "segment_ids": seg, "mask": mask.astype(np.float32)}
    if SOURCE_FEATURE in row:  # a mixture: the source of every token (0 on padding)
        out[SOURCE_FEATURE] = np.where(seg > 0, row[SOURCE_FEATURE], 0).astype(np.int32)
    if PART_FEATURE in row:
        out[REFERENCE_FEATURE] = np.where(seg > 0, row[REFERENCE_FEATURE], 0).astype(np.float32)
        out[PAIR_FEATURE] = np.where(seg > 0, row[PAIR_FEATURE], 0).astype(np.int32)
    return out


def make_dataset(source: DocumentSource, tokenizer: Tokenizer, *, seq_len: int, global_batch: int,
                 options: PipelineOptions, rows=None, exclude=(), mixture=None, steps: int | None = None,
                 warn=None) -> ProcessBatches:
    """The Grain pipeline of the module docstring; iterating it yields the rows `rows` of every global batch.

    Args:
      source: the documents (`DocumentSource`).
      tokenizer: `jaxlong.data.tokenizer` tokenizer.
      seq_len, global_batch: row length in tokens and rows per step over all processes.
      options: seed, packing, shuffling, `max_tokens`, one pass or endless epochs, read-ahead
        (`PipelineOptions`).
      rows: the global row indices this process builds (`jaxlong.core.batch.process_rows`), or None for every
        row. Only the packing streams that hold them are built.
      exclude: indices of documents to leave out (the held-out validation documents).
      mixture: None, or `(random-access source, MixedSource)` per source of `data.sources`
        (`jaxlong.data.mixture`): `source` is then the first of them (`exclude` applies to it), and the batches
        carry `source` int32 `[B, L]` (source index + 1 per token, 0 on padding). Each source's documents are
        measured first (`jaxlong.data.mixture.measure_lengths`: all, or a bounded sample) and its length rules
        checked (`check_lengths`) before this returns.
      steps, warn: with a mixture, the steps the run trains on it and a function that is given each warning line
        of `jaxlong.data.mixture.repetition_warnings` (a source repeated more than once per step or more than
        `REPEAT_EPOCHS` epochs); None: no warnings.

    Returns:
      `ProcessBatches`: iterating it gives batch dicts with `[len(rows), seq_len]` arrays (`[global_batch,
      seq_len]` without `rows`), rows in the order of `rows`.

    Raises:
      ValueError: a bad option value (`options.packing`, `options.split_positions`, `options.read_threads < 0`,
        `options.read_buffer < 1`, `options.max_tokens < 1`), or `rows` outside `[0, global_batch)`; a mixture
        with `options.repeat=False` or `options.max_tokens`; with a mixture, a source without documents, one
        that cannot be read, or whose length rules keep none of its (measured) documents
        (`jaxlong.data.mixture.check_lengths`), each naming `data.sources[i]` and its path.
    """
    if options.packing not in PACKINGS:
        raise ValueError(f"data.packing={options.packing!r} is not allowed; choose documents or concat")
    if options.split_positions not in SPLIT_POSITIONS:
        raise ValueError(f"data.split_positions={options.split_positions!r} is not allowed; "
                         "choose restart or continue")
    if options.read_threads < 0 or options.read_buffer < 1:
        raise ValueError(f"data.read_threads={options.read_threads} must be >= 0 and "
                         f"data.read_buffer={options.read_buffer} >= 1")
    rows = np.arange(global_batch) if rows is None else np.asarray(rows, np.int64)
    if rows.size == 0 or rows.min() < 0 or rows.max() >= global_batch:
        raise ValueError(f"rows {rows.tolist()} must be row indices of the global batch of {global_batch}")
    corpus = _corpus_key(source)
    if exclude:
        skip = {int(i) for i in exclude}
        source = DocumentSubset(source, [i for i in range(len(source)) if i not in skip])
    if mixture is not None:
        if not options.repeat or options.max_tokens is not None:
            raise ValueError("a data mixture is for training: endless (repeat=True), without data.max_tokens")
        # another source reading the first one's corpus (e.g. its long documents) leaves the held-out ones out too
        docs = [source, *(source if exclude and corpus is not None and _corpus_key(src) == corpus else src
                          for src, _ in mixture[1:])]
        held = [len(skip) if exclude and d is source else 0 for d in docs]
        return _mixed_batches(docs, [m for _, m in mixture], tokenizer, seq_len, global_batch, options, rows,
                              held, steps, warn)
    ds = grain.MapDataset.source(source)
    cut = None
    if options.max_tokens is not None:
        if options.max_tokens < 1:
            raise ValueError(f"data.max_tokens={options.max_tokens} must be >= 1 or null")
        n_docs, cut = token_limit(source, tokenizer, options.max_tokens)
        ds = ds[:n_docs]
    n = 1 if not options.repeat else \
        max(d for d in range(1, global_batch + 1) if global_batch % d == 0 and d <= max(len(ds), 1))
    last = len(ds) - 1

    def tokenize(index, text):
        if cut is None or index != last:
            return pairs_of(text, tokenizer)
        return document_pairs(document_tokens(text, tokenizer)[:cut])

    ds = ds.map_with_index(tokenize).filter(lambda d: d["inputs"].size > 0)
    per = global_batch // n

    def stream(s: int) -> grain.IterDataset:  # stream s's documents shuffled, repeated and packed (stages 2-4)
        docs = ds[s::n].shuffle(seed=options.seed + s) if options.shuffle else ds[s::n]
        it = (docs.repeat() if options.repeat else docs).to_iter_dataset(read_options=options.read_options)
        return _pack(it, s, seq_len, options, _bins(n), is_chat(source), is_preference(source))

    streams = {s: stream(s).batch(per, drop_remainder=True) for s in sorted({int(r) // per for r in rows})}
    return ProcessBatches(streams, rows, per)


def _corpus_key(source) -> tuple | None:
    """`(path, text_field)` of a `DocumentSource` (the embedded corpus: path None), `(path, 'chat')` of a
    `ChatSource`, None for other sources: two sources with one key read one corpus (its held-out documents are
    left out of both)."""
    if isinstance(source, (ChatSource, PreferenceSource)):
        return (str(source.path), "preference" if is_preference(source) else "chat")
    return (source.path, source.text_field) if isinstance(source, DocumentSource) else None


class ProcessBatches:
    """The rows `rows` of every global batch, cut from the packing streams that hold them (`streams`: stream index
    -> Grain dataset of that stream's batches of `per_stream` consecutive rows; stream s holds rows
    `[s * per_stream, (s + 1) * per_stream)`). Iterating it gives a `ProcessIterator`."""

    def __init__(self, streams: dict, rows: np.ndarray, per_stream: int):
        self.streams, self.rows, self.per_stream = streams, np.asarray(rows, np.int64), per_stream

    def __iter__(self) -> ProcessIterator:
        return ProcessIterator(self)


def _add_counts(a, b) -> list[int]:
    """Two lists of per-source counts added, the shorter padded with zeros."""
    return [int(x) + int(y) for x, y in zip_longest(a, b, fillvalue=0)]


class ProcessIterator:
    """Iterator over a `ProcessBatches`: batch dicts of the rows `rows` (attribute, sorted global row indices).
    `get_state()` is `{'streams': {str(index): Grain state}}` of its streams, with a mixture also
    `'source_tokens': {str(index): [tokens of source 0, 1, ...]}` fed by each stream so far; `set_state` takes
    the part of a state (its own, or one merged over processes by `merge_states`) that names its streams."""

    def __init__(self, batches: ProcessBatches):
        self.rows = batches.rows
        self._iters = {s: iter(ds) for s, ds in batches.streams.items()}
        self._tokens: dict = {}  # stream -> tokens of each source it fed (a mixture)
        order = list(self._iters)
        per = batches.per_stream
        self._take = np.array([order.index(int(r) // per) * per + int(r) % per for r in self.rows])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        parts = [next(it) for it in self._iters.values()]
        for s, part in zip(self._iters, parts):
            if SOURCE_FEATURE in part:  # source index + 1 per token, 0 on padding
                counts = np.bincount(np.asarray(part[SOURCE_FEATURE]).ravel())[1:]
                self._tokens[s] = _add_counts(self._tokens.get(s, []), counts)
        batch = parts[0] if len(parts) == 1 else _concat(parts)
        if self._take.size == len(batch["inputs"]) and np.array_equal(self._take, np.arange(self._take.size)):
            return batch
        return {k: v[self._take] for k, v in batch.items()}

    def get_state(self) -> dict:
        state = {"streams": {str(s): it.get_state() for s, it in self._iters.items()}}
        if self._tokens:
            state["source_tokens"] = {str(s): list(n) for s, n in self._tokens.items()}
        return state

    def source_tokens(self) -> list[int]:
        """Tokens of each source (by index) that this process's packing streams have fed since the stage began
        (carried over a resume by the data state); [] without a mixture."""
        return reduce(_add_counts, self._tokens.values(), [])

    def set_state(self, state: dict) -> None:
        """Continue from `state` (`get_state()` of this or another process's iterator, or `merge_states` of
        several). States saved before streams were named (one process: the Grain state of its single stream, or
        `{'parents': [...]}` of its streams in order) are read as streams 0, 1, ...

        Raises:
          ValueError: the state lacks a stream of this iterator (nothing is changed then).
        """
        streams = state.get("streams")
        if streams is None:
            parents = state.get("parents", [state])
            streams = {str(i): p for i, p in enumerate(parents)}
        missing = [s for s in self._iters if str(s) not in streams]
        if missing:
            raise ValueError(f"the data state holds packing streams {sorted(int(k) for k in streams)}, not "
                             f"{missing} of this process")
        for s, it in self._iters.items():
            it.set_state(streams[str(s)])
        tokens = state.get("source_tokens", {})  # absent in checkpoints of older versions: counted from here
        self._tokens = {s: list(tokens[str(s)]) for s in self._iters if str(s) in tokens}


def merge_states(states: list[dict]) -> dict:
    """One data state from the `get_state()` of every process (`ProcessIterator`): every packing stream's state,
    by stream index (processes building the same stream hold the same state for it), and with a mixture the
    tokens of each source each stream fed."""
    merged = {"streams": {k: v for state in states for k, v in state["streams"].items()}}
    tokens = {k: v for state in states for k, v in state.get("source_tokens", {}).items()}
    if tokens:
        merged["source_tokens"] = tokens
    return merged


def _bins(streams: int) -> int:
    """First-fit packing bins per stream: fewer when many streams pack at once (bounded host memory)."""
    return PACKING_BINS if streams <= 16 else max(2, 256 // streams)


def _pack(it: grain.IterDataset, stream: int, seq_len: int, options: PipelineOptions, bins: int,
          loss: bool = False, pairs: bool = False) -> grain.IterDataset:
    """Packing stream `stream`'s documents (`document_pairs` dicts, with `source` in a mixture and `loss` with
    conversations; a preference pair's features too with `pairs`) packed into rows of `seq_len` as
    `options.packing` and `options.split_positions` say, first-fit in `bins` bins seeded by `options.seed +
    stream` (stage 4). Conversations and pairs are never split: their sources keep only those that fit."""
    packing, seed = options.packing, options.seed + stream
    mixed = isinstance(it, TokenShareMix)
    features = (*_FEATURES, SOURCE_FEATURE) if mixed else _FEATURES
    features = (*features, LOSS_FEATURE) if loss else features
    meta = ("positions", *_PAIR_FEATURES) if pairs else ("positions",)
    lengths = {k: seq_len for k in (*features, *meta)}
    if packing == "documents":
        it = FlatMapIterDataset(it, SplitLongDocuments(seq_len, options.split_positions == "continue"))
        return FirstFitPackIterDataset(it, length_struct=lengths, num_packing_bins=bins, seed=seed,
                                       shuffle_bins=False, meta_features=meta).map(_finalize)
    kept = ("inputs", "targets", SOURCE_FEATURE) if mixed else ("inputs", "targets")
    it = ConcatThenSplitIterDataset(it.map(lambda d: {k: d[k] for k in kept}),
                                    length_struct={k: seq_len for k in kept})
    return it.map(lambda r: _finalize({**r, "positions": np.arange(seq_len, dtype=np.int32)}))


def _mixed_batches(docs: list, mixed: list[MixedSource], tokenizer: Tokenizer, seq_len: int, global_batch: int,
                   options: PipelineOptions, rows: np.ndarray, held: list[int], steps: int | None,
                   warn) -> ProcessBatches:
    """`make_dataset` of a mixture: each source's documents measured and its length rules checked (repetition
    warnings given to `warn`), then each packing stream s mixes document `[s::n]` of every source
    (`TokenShareMix`) and packs as one corpus does (stages 4-5)."""
    for src, m, h in zip(docs, mixed, held):
        if len(src) == 0:
            raise ValueError(f"{m.label}: no documents to train on" + (f" ({h} held out for validation)" if h else ""))
    n = max(d for d in range(1, global_batch + 1) if global_batch % d == 0 and d <= min(len(x) for x in docs))
    per = global_batch // n
    lengths = _measure(docs, mixed, tokenizer, held)
    check_lengths(lengths, mixed, n)
    if warn is not None and steps:
        for line in repetition_warnings(lengths, mixed, global_batch * seq_len, steps):
            warn(line)

    loss = any(map(is_chat, docs))
    tokenize = partial(pairs_of, tokenizer=tokenizer, loss=loss)

    def documents(i: int, s: int, salt: int) -> grain.IterDataset:
        ds = grain.MapDataset.source(docs[i])[s::n]
        if options.shuffle:
            ds = ds.shuffle(seed=options.seed + s + 7919 * (i + 1) + 104729 * salt)
        return ds.repeat().to_iter_dataset(read_options=options.read_options).map(tokenize)

    streams = {}
    for s in sorted({int(r) // per for r in rows}):
        main = [documents(i, s, 0) for i in range(len(docs))]
        extra = [documents(i, s, 1) if m.upsample > 1 else None for i, m in enumerate(mixed)]
        sizes = [len(range(s, len(x), n)) for x in docs]
        split = SplitLongDocuments(seq_len, options.split_positions == "continue").flat_map  # mixed piece by piece
        mixed_docs = TokenShareMix(main, extra, mixed, sizes, split, (s, n), [len(x) for x in docs])
        streams[s] = _pack(mixed_docs, s, seq_len, options, _bins(n), loss).batch(per, drop_remainder=True)
    return ProcessBatches(streams, rows, per)


def _measure(docs: list, mixed: list[MixedSource], tokenizer: Tokenizer, held: list[int]) -> list:
    """`measure_lengths` of every source's documents (once per corpus that several sources read), in tokens
    of `[BOS] text [EOS]` as the pipeline counts them (next-token pairs); a read error names the source."""
    seen: dict = {}
    out = []
    for d, m, h in zip(docs, mixed, held):
        key = (_corpus_key(d) or id(d), h)
        if key not in seen and isinstance(d, ChatSource):  # every conversation measured when it opened
            seen[key] = SourceLengths(len(d), np.arange(len(d), dtype=np.int64), d.lengths, h)
        if key not in seen:
            try:
                seen[key] = measure_lengths(d, lambda text: document_tokens(text, tokenizer).size - 1, h)
            except ValueError as e:
                raise ValueError(f"{m.label}: {_reword(e)}") from None
        out.append(seen[key])
    return out


def _reword(e: Exception) -> str:
    """A `DocumentSource` error without its leading `data.path=...` (the message names the source instead)."""
    return re.sub(r"^data\.path(=('[^']*'|\"[^\"]*\"|None))?:? ?", "", str(e))


def _concat(parts: tuple) -> dict:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class DocumentSubset:
    """The documents of a random-access source at `indices` (in that order), as a random-access source: the
    training documents without the held-out ones, or the held-out documents alone (validation)."""

    def __init__(self, source, indices):
        self.source, self.keep = source, [int(i) for i in indices]
        self.is_chat, self.is_preference = is_chat(source), is_preference(source)

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int):
        return self.source[self.keep[index]]


def batch_iterator(cfg, tokenizer: Tokenizer, state: dict | None = None, source: DocumentSource | None = None,
                   exclude=(), rows=None, warn=None) -> ProcessIterator:
    """The batch iterator of a run's `Config` (`ProcessIterator`) for the rows `rows` of every global batch (this
    process's, `jaxlong.core.batch.process_rows`; None: every row), at `state` if given (from `get_state()` of
    an earlier iterator, or `merge_states`: the next batch is the one that iterator would have yielded). A
    recipe's stage `stage` shuffles with `seed + stage * STAGE_SEED`.
    `source`: the corpus (default: `DocumentSource` of `data.path`; with `data.sources`, of the first source,
    the one validation holds documents out of); `exclude`: document indices of `source` left out (validation).
    With `data.sources`, every source is opened and its length rules checked before this returns (before the
    trainer compiles), and `warn` (e.g. `print`; None: silent) is given a line for each source the run's steps
    (`steps - optim.schedule_start`) would repeat more than once per step or more than 10 epochs, and for each
    chat source that left conversations longer than `seq_len` out (`data.too_long=drop`).

    Raises:
      ValueError: see `DocumentSource`, `make_dataset` and `ProcessIterator.set_state`.
    """

    d = cfg.data
    mixture = mixture_sources(cfg, source, tokenizer) if d.sources else None
    if source is None:
        source = mixture[0][0] if mixture else first_source(cfg, tokenizer)
    for docs, where in ([(s, m.label) for s, m in mixture] if mixture else [(source, "data.path")]):
        if getattr(docs, "dropped", 0) and warn is not None:
            what = "pairs" if is_preference(docs) else "conversations"
            warn(f"{where}: {docs.dropped:,} {what} longer than seq_len={cfg.seq_len:,} left out "
                 f"(data.too_long=drop); {len(docs):,} kept")
    options = PipelineOptions(seed=cfg.seed + STAGE_SEED * cfg.stage, packing=d.packing,
                              split_positions=d.split_positions, shuffle=d.shuffle, max_tokens=d.max_tokens,
                              read_threads=d.read_threads, read_buffer=d.read_buffer)
    ds = make_dataset(source, tokenizer, seq_len=cfg.seq_len, global_batch=cfg.global_batch, options=options,
                      rows=rows, exclude=exclude, mixture=mixture, steps=cfg.steps - cfg.optim.schedule_start,
                      warn=warn)
    it = iter(ds)
    if state is not None:
        it.set_state(state)
    return it


def open_source(cfg, path, text_field: str, fmt: str, tokenizer: Tokenizer | None = None):
    """One corpus of a run: a `DocumentSource` of texts (`format` text), or a `ChatSource` of conversations
    (`format` chat: `jaxlong.data.chat_data`, rendered with the chat template of the run's tokenizer, or
    `data.chat_template`, under `data.chat_turns` and `data.too_long`; every conversation encoded now).

    Args:
      tokenizer: the run's tokenizer (a chat source needs it; None: `jaxlong.data.run_tokenizer(cfg)`).

    Raises:
      ValueError: see `DocumentSource` and `ChatSource`.
    """
    if fmt == "text":
        return DocumentSource(path, text_field)
    if tokenizer is None:
        tokenizer = run_tokenizer(cfg)
    d = cfg.data
    template = run_template(d.chat_template, template_directory(tokenizer), mark_generation=True)
    if fmt == "preference":
        return PreferenceSource(path, tokenizer, template, cfg.seq_len, d.too_long, shared_prompt=d.shared_prompt)
    return ChatSource(path, tokenizer, template, cfg.seq_len, d.chat_turns, d.too_long)


def first_source(cfg, tokenizer: Tokenizer | None = None):
    """The corpus validation holds documents out of: `data.path`, or with `data.sources` the first source
    (`open_source`: conversations under `format: chat`).

    Raises:
      ValueError: see `open_source` (with `data.sources[0]` and its path named).
    """
    if not cfg.data.sources:
        return open_source(cfg, cfg.data.path, cfg.data.text_field, cfg.data.format, tokenizer)
    return _open_listed(cfg, 0, tokenizer)


def _open_listed(cfg, i: int, tokenizer: Tokenizer | None):
    """`open_source` of `data.sources[i]`, its errors naming the source and its path."""
    src = cfg.data.sources[i]
    try:
        return open_source(cfg, src.path, src.text_field or cfg.data.text_field, src.format or cfg.data.format,
                           tokenizer)
    except ValueError as e:
        raise ValueError(f"{source_label(src, i)}: {_reword(e)}") from None


def mixture_sources(cfg, first=None, tokenizer: Tokenizer | None = None) -> list[tuple]:
    """`(source, MixedSource)` per source of `data.sources` (`jaxlong.data.mixture`; the source a
    `DocumentSource` or, under `format: chat`, a `ChatSource`: `open_source`), the first one `first` when given
    (the same corpus, already open).

    Raises:
      ValueError: a source's corpus is missing, empty or unreadable (see `open_source`; the message names
        `data.sources[i]` and its path: `data.sources[1] (b.jsonl): ...`).
    """
    return [(first if i == 0 and first is not None else _open_listed(cfg, i, tokenizer),
             MixedSource(source_name(src, i), src.weight, src.min_doc_tokens, src.max_doc_tokens,
                         src.long_doc_tokens or max(cfg.seq_len // 2, 1), src.upsample_long, source_label(src, i)))
            for i, src in enumerate(cfg.data.sources)]


def source_shares(source: np.ndarray, names: list[str]) -> dict[str, int]:
    """Tokens of each source (by name) in a mixture's batch, from its `source` int32 `[B, L]` (source index + 1
    per token, 0 on padding)."""
    counts = np.bincount(np.asarray(source).ravel(), minlength=len(names) + 1)
    return {name: int(counts[i + 1]) for i, name in enumerate(names)}


def packing_efficiency(batch: dict) -> float:
    """Fraction of the batch's tokens that belong to a document (not padding)."""
    return float(np.mean(np.asarray(batch["segment_ids"]) > 0))

