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
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import numpy as np

__all__ = ["MixedSource", "TokenShareMix", "SOURCE_FEATURE", "source_name"]

SOURCE_FEATURE = "source"  # per-token source index of a packed batch (int32 [B, L]; padding 0, source i -> i + 1)


def source_name(src, index: int) -> str:
    """The name of `data.sources[index]` (a `jaxlong.config.SourceConfig`) in logs: its `name`, else its path's
    file or directory name without suffix, `stdlib` for the embedded corpus."""
    if src.name:
        return src.name
    return "stdlib" if src.path is None else (Path(str(src.path).rstrip("/")).stem or f"source{index}")


@dataclasses.dataclass
class MixedSource:
    """One source of a mixture as the pipeline mixes it: `weight` (relative), documents shorter than
    `min_tokens` or longer than `max_tokens` dropped (None: no upper bound), long documents (`long_tokens` or
    more, after the length rules) drawn `upsample` times as often; `name` for messages and logs. Token counts
    are next-token pairs of `[BOS] text [EOS]`."""

    name: str
    weight: float
    min_tokens: int = 0
    max_tokens: int | None = None
    long_tokens: int = 1
    upsample: float = 1.0

    def keeps(self, n: int) -> bool:
        return n >= self.min_tokens and (self.max_tokens is None or n <= self.max_tokens)


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

    The mixer takes one piece at a time, so the shares hold to within a piece (at most `seq_len` tokens) however
    long the documents are; a document's length rules and whether it is long are judged on the whole document.
    Each output is the piece's dict with `source` (int32 `[n]`, the source index + 1 at every token) added.
    """

    def __init__(self, main, extra, sources: list[MixedSource], documents: list[int], split):
        parents = [*main, *(e for e in extra if e is not None)]
        super().__init__(parents)
        self._main, self._extra, self._sources, self._documents = list(main), list(extra), sources, documents
        self._split = split

    def __iter__(self) -> "_TokenShareMixIterator":
        return _TokenShareMixIterator(self)


class _TokenShareMixIterator(grain.DatasetIterator):
    def __init__(self, ds: TokenShareMix):
        mains = [iter(m) for m in ds._main]
        extras = [None if e is None else iter(e) for e in ds._extra]
        super().__init__([*mains, *(e for e in extras if e is not None)])
        self._mains, self._extras = mains, extras
        self._sources, self._documents, self._split = ds._sources, ds._documents, ds._split
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
        the upsampling stream)."""
        src, it, long_only = self._sources[i], self._stream(i, which), which == "extra"
        for _ in range(2 * self._documents[i] + 1):
            doc = next(it)
            n = int(doc["inputs"].size)
            if src.keeps(n) and (not long_only or n >= src.long_tokens):
                return doc
        what = f"document of at least {src.long_tokens} tokens (long_doc_tokens, to upsample)" if long_only \
            else "document"
        bounds = f"{src.min_tokens}..{'' if src.max_tokens is None else src.max_tokens}"
        raise ValueError(f"data.sources: source {src.name!r} has no {what} within its length rules (tokens "
                         f"{bounds}: min_doc_tokens..max_doc_tokens) in a whole epoch of its "
                         f"{self._documents[i]} documents; loosen the rules or drop the source")

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
        cursors = []
        for i, cur in enumerate(self._open):
            if cur is None:
                cursors.append(None)
                continue
            (main if cur["from"] == "main" else extra)[i] = cur["before"]
            cursors.append({"from": cur["from"], "next": cur["next"]})
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
                self._open[i] = {"from": cur["from"], "before": before, "pieces": self._split(self._pull(i, cur["from"])),
                                 "next": int(cur["next"])}
