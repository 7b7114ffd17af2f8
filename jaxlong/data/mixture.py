"""Data mixtures: several corpora mixed by their share of the training tokens, with per-source length rules.

Long-context training mixes long documents (books, code repositories) with short high-quality data, which keeps
the model's short-context skills (ProLong, Gao et al., arXiv 2410.02660, sections 3-4), and raises the share of
long documents within a source without changing the source's share ("per-source length upsampling", Fu et al.,
arXiv 2402.10171, section 3). `data.sources` (`jaxlong.config.SourceConfig`) gives each corpus a weight,
`min_doc_tokens` / `max_doc_tokens` to drop documents by length, and `upsample_long` to draw its long documents
(`long_doc_tokens`, default `seq_len // 2`) that many times as often.

Within each packing stream of `jaxlong.data.pipeline`, every source is an endless stream of tokenized documents
(its own seeded shuffle each epoch, as a single corpus is), cut into pieces of at most `seq_len` tokens, and
`TokenShareMix` takes the next piece from the source furthest below its share of the tokens taken so far
(`weight / sum of weights`): the realised shares differ from the weights by at most one piece's tokens at any
point, however long the documents, and the order depends only on the data and the seed. Length rules and
"long" apply to whole documents. Upsampling draws from a second stream of the same source, shuffled with another
seed, that keeps its long documents only: after the main stream has given `n` long-document tokens, the second
has given about `(upsample_long - 1) * n`. The mixer's state (token counts, each stream's Grain state before the
document it is cutting, and the pieces taken from it) is part of the pipeline's, saved in every checkpoint: a
resumed run continues with the next piece of the same mixture.

Before training, `measure_lengths` tokenizes each source's documents (all of them, or a sample of
`SAMPLE_DOCUMENTS` documents and `SAMPLE_CHARACTERS` characters at most, in runs of consecutive documents),
`check_lengths` refuses a source whose length rules keep none of them, and `repetition_warnings` says which
sources the run would repeat more than once per step or more than `REPEAT_EPOCHS` epochs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import numpy as np

__all__ = ["MixedSource", "TokenShareMix", "SOURCE_FEATURE", "source_name", "source_label", "SourceLengths",
           "measure_lengths", "check_lengths", "repetition_warnings", "SAMPLE_DOCUMENTS", "SAMPLE_CHARACTERS",
           "REPEAT_EPOCHS"]

SOURCE_FEATURE = "source"  # per-token source index of a packed batch (int32 [B, L]; padding 0, source i -> i + 1)
SAMPLE_DOCUMENTS = 2048  # documents of a source tokenized before training, at most (a larger source: a sample)
SAMPLE_CHARACTERS = 1 << 24  # characters of a source read before training, at most (16 Mi)
SAMPLE_RUNS = 32  # a sample is this many runs of consecutive documents (one Parquet row group each, mostly)
REPEAT_EPOCHS = 10  # a source read more epochs than this over a run is warned about


def source_name(src, index: int) -> str:
    """The name of `data.sources[index]` (a `jaxlong.config.SourceConfig`) in logs: its `name`, else its path's
    file or directory name without suffix, `stdlib` for the embedded corpus."""
    if src.name:
        return src.name
    return "stdlib" if src.path is None else (Path(str(src.path).rstrip("/")).stem or f"source{index}")


def source_label(src, index: int) -> str:
    """`data.sources[i] (PATH)`: how messages name `data.sources[index]` (a `jaxlong.config.SourceConfig`)."""
    return f"data.sources[{index}] ({'null: the Python stdlib sources' if src.path is None else src.path})"


@dataclasses.dataclass
class MixedSource:
    """One source of a mixture as the pipeline mixes it: `weight` (relative), documents shorter than
    `min_tokens` or longer than `max_tokens` dropped (None: no upper bound), long documents (`long_tokens` or
    more, after the length rules) drawn `upsample` times as often; `name` for logs, `label` for messages
    (`source_label`; default `name`). Token counts are next-token pairs of `[BOS] text [EOS]`."""

    name: str
    weight: float
    min_tokens: int = 0
    max_tokens: int | None = None
    long_tokens: int = 1
    upsample: float = 1.0
    label: str = ""

    def __post_init__(self):
        self.label = self.label or repr(self.name)

    def keeps(self, n):
        """Whether a document of `n` tokens (an int, or an array of them) passes the length rules."""
        return (n >= self.min_tokens) & (n <= (np.inf if self.max_tokens is None else self.max_tokens))

    def rules(self) -> str:
        """Its length rules as options: `min_doc_tokens=A, max_doc_tokens=B` (those set)."""
        return ", ".join([*([f"min_doc_tokens={self.min_tokens}"] if self.min_tokens else []),
                          *([] if self.max_tokens is None else [f"max_doc_tokens={self.max_tokens}"])]) \
            or "no length rules"


@dataclasses.dataclass
class SourceLengths:
    """The lengths of a source's documents, measured before training: `lengths[k]` tokens (next-token pairs, as
    `MixedSource.keeps` counts) of document `indices[k]` (ascending), of all its `documents` or of a sample;
    `held` more documents of its corpus are held out for validation (not among `documents`)."""

    documents: int
    indices: np.ndarray
    lengths: np.ndarray
    held: int = 0

    @property
    def complete(self) -> bool:
        return self.indices.size == self.documents

    def counted(self) -> str:
        """`its 60 documents`, `2,048 documents sampled from its 10,000`, with the held-out ones if any."""
        held = f" ({self.held:,} more held out for validation)" if self.held else ""
        if self.complete:
            return f"its {self.documents:,} documents{held}"
        return f"{self.indices.size:,} documents sampled from its {self.documents:,}{held}"


def measure_lengths(docs, count, held: int = 0, seed: int = 0) -> SourceLengths:
    """Token counts of a source's documents (`docs`: random-access texts; `count`: text -> tokens): all of them
    when there are at most `SAMPLE_DOCUMENTS` of at most `SAMPLE_CHARACTERS` characters in all, else a sample of
    `SAMPLE_RUNS` runs of consecutive documents at seeded places (read in a seeded order until either bound is
    reached), so the cost is bounded whatever the corpus and a Parquet file decodes few row groups.

    Raises:
      ValueError: a document cannot be read (see `jaxlong.data.sources.DocumentSource`).
    """
    n = len(docs)
    runs = min(SAMPLE_RUNS, n)
    bounds = np.linspace(0, n, runs + 1).astype(np.int64)
    per = max(SAMPLE_DOCUMENTS // max(runs, 1), 1)
    rng = np.random.default_rng([seed, 2])
    taken: dict[int, int] = {}
    chars = 0
    for r in rng.permutation(runs):
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        if n > SAMPLE_DOCUMENTS and hi - lo > per:
            lo += int(rng.integers(0, hi - lo - per + 1))
            hi = lo + per
        for i in range(lo, hi):
            text = docs[i]
            taken[i] = int(count(text))
            chars += len(text)
            if chars >= SAMPLE_CHARACTERS or len(taken) >= SAMPLE_DOCUMENTS:
                break
        if chars >= SAMPLE_CHARACTERS or len(taken) >= SAMPLE_DOCUMENTS:
            break
    indices = np.array(sorted(taken), np.int64)
    return SourceLengths(n, indices, np.array([taken[int(i)] for i in indices], np.int64), held)


def check_lengths(lengths: list[SourceLengths], sources: list[MixedSource], streams: int = 1) -> None:
    """Refuse, before training, a source whose length rules keep none of its measured documents (`lengths`,
    `measure_lengths`), one that upsamples long documents (`upsample` > 1) but has none within its rules, and,
    when all of a source's documents were measured, one whose kept (or long) documents miss one of the `streams`
    packing streams (stream `s` mixes documents `s, s + streams, ...`; each needs one).

    Raises:
      ValueError: one line naming the source (`label`), the rule, the lengths seen and what would work.
    """
    for ls, src in zip(lengths, sources):
        keep, under_max = src.keeps(ls.lengths), ls.lengths <= (np.inf if src.max_tokens is None else src.max_tokens)
        # the largest min_doc_tokens that leaves every packing stream a document (known when all were measured)
        per_stream = [ls.lengths[s::streams][under_max[s::streams]] for s in range(streams)] if ls.complete else []
        best_min = int(min(x.max() for x in per_stream)) if per_stream and all(x.size for x in per_stream) else None
        if ls.lengths.size and not keep.any():
            lo, hi = int(ls.lengths.min()), int(ls.lengths.max())
            if hi < src.min_tokens:
                fix = f"the longest is {hi:,} tokens; use min_doc_tokens <= {hi if best_min is None else best_min}"
                if best_min is not None and best_min < hi:
                    fix += f" (each of the {streams} packing streams needs a document)"
            elif src.max_tokens is not None and lo > src.max_tokens:
                fix = f"the shortest is {lo:,} tokens; use max_doc_tokens >= {lo}"
            else:
                fix = f"they have {lo:,} to {hi:,} tokens, none in {src.min_tokens}..{src.max_tokens}; widen the range"
            keeps = "keep" if src.min_tokens and src.max_tokens is not None else "keeps"
            raise ValueError(f"{src.label}: {src.rules()} {keeps} none of {ls.counted()}: {fix}, or drop the source")
        long = keep & (ls.lengths >= src.long_tokens)
        if src.upsample > 1 and ls.lengths.size and not long.any():
            hi = int(ls.lengths[keep].max())
            raise ValueError(f"{src.label}: upsample_long={src.upsample:g} has no long document to draw: none of "
                             f"{ls.counted()} within its length rules has long_doc_tokens={src.long_tokens} tokens "
                             f"or more (the longest has {hi:,}); use long_doc_tokens <= {hi} or upsample_long: 1")
        if not ls.complete or streams <= 1:
            continue
        for what, mask in ((f"within its length rules ({src.rules()})", keep),
                           *([(f"long (long_doc_tokens={src.long_tokens} or more, to upsample)", long)]
                             if src.upsample > 1 else [])):
            empty = [s for s in range(streams) if not mask[s::streams].any()]
            if empty:
                k = int(mask.sum())
                raise ValueError(f"{src.label}: {k} of {ls.counted()} {'is' if k == 1 else 'are'} {what}, and each "
                                 f"of the {streams} packing streams needs one among the documents dealt to it "
                                 f"(stream s: documents s, s + {streams}, ...; stream {empty[0]} has none); "
                                 + (f"use min_doc_tokens <= {best_min}" if mask is keep and best_min is not None
                                    and best_min < src.min_tokens else "loosen the rules") +
                                 ", or lower global_batch (fewer streams)")


def _about(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def repetition_warnings(lengths: list[SourceLengths], sources: list[MixedSource], tokens_per_step: int,
                        steps: int) -> list[str]:
    """`warning: ...` lines for the sources a run repeats: more than once per step, or more than `REPEAT_EPOCHS`
    epochs over its `steps` steps of `tokens_per_step` tokens (`global_batch * seq_len`; each source gets its
    share), counted against the source's tokens within its length rules (`lengths`: measured, extrapolated from
    a sample with '~'). Padding and upsampling are not counted: the figures are estimates."""
    total = sum(s.weight for s in sources)
    out = []
    for ls, src in zip(lengths, sources):
        keep = src.keeps(ls.lengths)
        if not ls.lengths.size or not keep.any():
            continue
        scale = ls.documents / ls.indices.size  # 1 when every document was measured
        docs, tokens = keep.sum() * scale, ls.lengths[keep].sum() * scale
        per_step = tokens_per_step * src.weight / total / tokens
        epochs = per_step * steps
        if per_step <= 1 and epochs <= REPEAT_EPOCHS:
            continue
        est = "" if ls.complete else "~"
        has = (f"{est}{docs:,.0f} documents, {est}{tokens:,.0f} tokens" if not (src.min_tokens or src.max_tokens)
               else f"{est}{docs:,.0f} documents within its length rules ({src.rules()}), {est}{tokens:,.0f} tokens")
        how = (f"are repeated ~{_about(per_step)} times per step (~{_about(epochs)} epochs over the {steps:,} steps)"
               if per_step > 1 else f"are repeated over ~{_about(epochs)} epochs in the {steps:,} steps")
        out.append(f"warning: {src.label}: {has}, at weight {src.weight:g} ({src.weight / total:.0%} of the tokens) "
                   f"{how}; lower its weight or give it more documents")
    return out


class TokenShareMix(grain.IterDataset):
    """Pieces of documents from several endless streams, each source's share of the tokens held at its weight.

    Args:
      main: per source, a Grain `IterDataset` of tokenized documents (`document_pairs` dicts), endless.
      extra: per source, None, or a second endless stream of the same documents in another order, from which
        its long documents are upsampled.
      sources: per source, `MixedSource`.
      documents: per source, the number of documents in one epoch of its stream (how long to look for a
        document the length rules keep before saying that there is none).
      split: a document -> its pieces of at most `seq_len` tokens (`jaxlong.data.pipeline.SplitLongDocuments`).
      stream: `(s, n)`: this is packing stream `s` of `n` (for messages).
      totals: per source, its documents over all streams (for messages; default `documents`).

    The mixer takes one piece at a time, so the shares hold to within a piece (at most `seq_len` tokens) however
    long the documents are; a document's length rules and whether it is long are judged on the whole document.
    Each output is the piece's dict with `source` (int32 `[n]`, the source index + 1 at every token) added.
    """

    def __init__(self, main, extra, sources: list[MixedSource], documents: list[int], split,
                 stream: tuple[int, int] = (0, 1), totals: list[int] | None = None):
        parents = [*main, *(e for e in extra if e is not None)]
        super().__init__(parents)
        self._main, self._extra, self._sources, self._documents = list(main), list(extra), sources, documents
        self._split, self._where = split, (stream, list(documents) if totals is None else list(totals))

    def __iter__(self) -> "_TokenShareMixIterator":
        return _TokenShareMixIterator(self)


class _TokenShareMixIterator(grain.DatasetIterator):
    def __init__(self, ds: TokenShareMix):
        mains = [iter(m) for m in ds._main]
        extras = [None if e is None else iter(e) for e in ds._extra]
        super().__init__([*mains, *(e for e in extras if e is not None)])
        self._mains, self._extras = mains, extras
        self._sources, self._documents, self._split, self._where = ds._sources, ds._documents, ds._split, ds._where
        total = sum(s.weight for s in ds._sources)
        self._shares = [s.weight / total for s in ds._sources]
        k = len(ds._sources)
        self._tokens = [0] * k  # tokens taken from each source (both streams)
        self._long = [0] * k  # long-document tokens drawn from each main stream
        self._upsampled = [0] * k  # tokens drawn from each extra stream
        # per source, the document whose pieces are being taken: the stream it came from ("main" or "extra"),
        # that stream's state before it was drawn, its pieces, and the next piece's index
        self._open: list[dict | None] = [None] * k

    def _stream(self, i: int, which: str):
        return self._mains[i] if which == "main" else self._extras[i]

    def _pull(self, i: int, which: str) -> dict:
        """The next document of source `i`'s `which` stream that the length rules keep (and that is long, from
        the upsampling stream).

        Raises:
          ValueError: a whole epoch of the stream has none (naming the source, its rules and its documents).
        """
        src, it, long_only = self._sources[i], self._stream(i, which), which == "extra"
        for _ in range(2 * self._documents[i] + 1):
            doc = next(it)
            n = int(doc["inputs"].size)
            if src.keeps(n) and (not long_only or n >= src.long_tokens):
                return doc
        what = f"long document (long_doc_tokens={src.long_tokens} or more, to upsample)" if long_only \
            else "document"
        (s, n), totals = self._where
        raise ValueError(f"{src.label}: no {what} within its length rules ({src.rules()}) among the "
                         f"{self._documents[i]:,} of its {totals[i]:,} documents dealt to packing stream {s} of {n} "
                         f"(each stream needs one); loosen the rules, lower global_batch (fewer streams), or drop "
                         f"the source")

    def _draw(self, i: int) -> None:
        """Open source `i`'s next document: from the upsampling stream while it is behind `upsample - 1` times
        the long tokens drawn from the main one, else from the main stream."""
        src = self._sources[i]
        which = "extra" if self._extras[i] is not None and (src.upsample - 1) * self._long[i] > self._upsampled[i] \
            else "main"
        before = self._stream(i, which).get_state()
        doc = self._pull(i, which)
        n = int(doc["inputs"].size)
        if which == "extra":
            self._upsampled[i] += n
        elif n >= src.long_tokens:
            self._long[i] += n
        self._open[i] = {"from": which, "before": before, "pieces": self._split(doc), "next": 0}

    def __next__(self) -> dict:
        total = sum(self._tokens)
        i = max(range(len(self._shares)), key=lambda j: (self._shares[j] * total - self._tokens[j], -j))
        if self._open[i] is None or self._open[i]["next"] >= len(self._open[i]["pieces"]):
            self._draw(i)
        cur = self._open[i]
        piece = cur["pieces"][cur["next"]]
        cur["next"] += 1
        n = int(piece["inputs"].size)
        self._tokens[i] += n
        return {**piece, "source": np.full(n, i + 1, np.int32)}

    def get_state(self) -> dict:
        """The streams' states as of before each open document was drawn, where that document is and how many of
        its pieces were taken, and the token counts: restoring draws the open documents again."""
        main = [m.get_state() for m in self._mains]
        extra = [None if e is None else e.get_state() for e in self._extras]
        for i, cur in enumerate(self._open):
            if cur is not None:
                (main if cur["from"] == "main" else extra)[i] = cur["before"]
        cursors = [None if cur is None else {"from": cur["from"], "next": cur["next"]} for cur in self._open]
        return {"main": main, "extra": extra, "open": cursors, "tokens": list(self._tokens),
                "long": list(self._long), "upsampled": list(self._upsampled)}

    def set_state(self, state: dict) -> None:
        if len(state["main"]) != len(self._mains):
            raise ValueError(f"the data state holds a mixture of {len(state['main'])} sources, not "
                             f"{len(self._mains)}: data.sources changed (resume with the sources it was saved with)")
        for it, st in zip(self._mains, state["main"]):
            it.set_state(st)
        for it, st in zip(self._extras, state["extra"]):
            if (it is None) != (st is None):
                raise ValueError("the data state's upsampling streams differ from data.sources' upsample_long")
            if it is not None:
                it.set_state(st)
        self._tokens, self._long, self._upsampled = (list(map(int, state[k])) for k in ("tokens", "long", "upsampled"))
        self._open = [None] * len(self._mains)
        for i, cur in enumerate(state.get("open", [None] * len(self._mains))):
            if cur is not None:  # draw the open document again (the counters already hold it)
                before = self._stream(i, cur["from"]).get_state()
                self._open[i] = {"from": cur["from"], "before": before, "next": int(cur["next"]),
                                 "pieces": self._split(self._pull(i, cur["from"]))}
