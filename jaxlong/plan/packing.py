"""The attention work of packed documents: the share of causal attention's tiles the kernels compute.

With segment ids (`data.packing: documents`) the attention kernels skip whole tiles between documents
(`jaxlong.kernels.pallas_gpu`, "Skipped tiles"; `jaxlong.kernels.blockwise` alike): query tile `i` (`block_q`
queries) runs kv tiles `[lo_i, hi_i)` with `hi_i = ceil((i + 1) * block_q / block_k)` (the causal bound) and `lo_i =
floor(s_i / block_k)`, `s_i` the start of the document holding the tile's first query; the backward's dK/dV loop
has the mirror bounds. Dense causal attention runs `[0, hi_i)`. So a row of documents much longer than a tile costs
about `sum(L_d^2) / S^2` of causal attention, and many short conversations packed into a 1M-token row cost a few
thousandths of it, which the HLO count of `jaxlong.plan.cost` cannot see (the kernels' bounds are data).

`attention_tile_fraction` packs a sample of document lengths into rows as the data pipeline does (first fit,
`jaxlong.data.pipeline`, documents longer than a row split into pieces) and counts the tiles; `jaxlong.plan`'s
estimate scales the compiled step's attention FLOPs by it. The lengths come from `data.doc_lengths` (a sample of
the data's document lengths, in tokens) or, for a chat or preference source whose file is there, from the data
itself (`document_lengths`). Under ring attention the diagonal blocks have these bounds and the off-diagonal ones
are skipped where a block holds no query's document (`kv_starts`): the same count over the whole row, an
approximation at the block edges.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxlong.data.pipeline import PACKING_BINS, first_source

__all__ = ["pack_rows", "attention_tile_fraction", "document_lengths"]


def pack_rows(lengths, seq_len: int, rows: int) -> list[list[int]]:
    """Document lengths (tokens) packed into at most `rows` rows of `seq_len` by first fit over `PACKING_BINS`
    open rows (the pipeline's), the sample shuffled (seeded) and repeated until the rows are full; a document longer
    than `seq_len` is cut into pieces of `seq_len` (as `data.split_positions` does). Returns each row's document
    lengths, in order."""
    lengths = [int(n) for n in lengths if int(n) > 0]
    if not lengths:
        raise ValueError("no document lengths to pack")
    pieces = []
    for n in lengths:
        pieces += [seq_len] * (n // seq_len) + ([n % seq_len] if n % seq_len else [])
    rng = np.random.default_rng(0)  # the pipeline shuffles the documents each epoch
    done: list[list[int]] = []
    bins: list[list[int]] = []
    k = 0
    order = rng.permutation(len(pieces))
    while len(done) < rows and k < 64 * rows * len(pieces):
        if k and k % len(pieces) == 0:
            order = rng.permutation(len(pieces))
        n = pieces[order[k % len(pieces)]]
        k += 1
        fit = next((b for b in bins if sum(b) + n <= seq_len), None)
        if fit is None:
            if len(bins) == PACKING_BINS:
                done.append(bins.pop(0))
            fit = []
            bins.append(fit)
        fit.append(n)
    return (done + bins)[:rows]


def _row_tiles(row: list[int], seq_len: int, block_q: int, block_k: int) -> tuple[int, int]:
    """(tiles computed, tiles of dense causal attention) of one packed row; its padding is one more run."""
    starts = np.cumsum([0, *row])
    if starts[-1] < seq_len:  # padding: one run to the end (the kernel's `_runs`)
        starts = np.append(starts, seq_len)
    nq, nk = -(-seq_len // block_q), -(-seq_len // block_k)
    first = np.arange(nq) * block_q  # each query tile's first query
    doc_start = starts[np.searchsorted(starts, first, side="right") - 1]
    hi = np.minimum(nk, -(-(np.arange(nq) + 1) * block_q // block_k))
    lo = np.minimum(doc_start // block_k, hi)
    return int(np.sum(hi - lo)), int(np.sum(hi))


def attention_tile_fraction(lengths, seq_len: int, block_q: int, block_k: int, rows: int = 32) -> float:
    """The share of dense causal attention's tiles that the kernels compute for documents of `lengths` (a sample
    of the data's document lengths in tokens) packed into rows of `seq_len` with tiles of `block_q` x `block_k`:
    in `(0, 1]`, 1 for one document filling the row. Averaged over `rows` packed rows (`pack_rows`).

    Raises:
      ValueError: no positive length."""
    tiles = [_row_tiles(row, seq_len, block_q, block_k) for row in pack_rows(lengths, seq_len, rows)]
    return sum(c for c, _ in tiles) / max(sum(d for _, d in tiles), 1)


def document_lengths(cfg) -> tuple[list[int], str] | None:
    """A sample of the run's document lengths (tokens) and where it comes from, for a plan of packed data:
    `data.doc_lengths` when set; else, for a chat or preference source (`data.format`) whose file or directory
    exists, every conversation's or pair's length as the source measures it when it opens (the run's tokenizer
    and template: `model.from_hf` or `data.tokenizer`); else None (the plan counts dense causal attention)."""
    d = cfg.data
    if d.packing != "documents":
        return None
    if d.doc_lengths:
        return [int(n) for n in d.doc_lengths], "data.doc_lengths"
    if d.sources or d.format == "text" or d.path is None or not Path(d.path).exists():
        return None
    source = first_source(cfg)
    lengths = source.halves.ravel() if d.format == "preference" else source.lengths  # a pair's halves: 2 documents
    return [int(n) for n in lengths], f"measured from {d.path} ({len(source):,} {d.format} records)"
