"""Held-out validation data: whole documents of the corpus, packed into batches by the training pipeline
(`jaxlong.data.make_dataset`), so held-out and training batches present documents alike."""

from __future__ import annotations

import itertools

import numpy as np

from jaxlong.config import Config
from jaxlong.data import PAIR_FEATURE, DocumentSubset, document_tokens, make_dataset, source_label


def held_out_documents(source, tokenizer, fraction: float, seed: int, min_tokens: int = 0,
                       corpus: str = "the corpus") -> list[int]:
    """Hold out whole documents of a corpus (`jaxlong.data.DocumentSource` or any sequence of texts) for
    validation: taken in the order of `np.random.default_rng([seed, 1]).permutation(n_docs)`, at least
    `max(1, round(fraction * n_docs))` and more until their tokens (`[BOS] ids [EOS]` each) reach `min_tokens`,
    never all of them. Only the documents taken are tokenized. `corpus` names the corpus in messages
    (`corpus_label`).

    Returns the held-out document indices, sorted (the training pipeline skips them).

    Raises:
      ValueError: the corpus has fewer than two documents (option `eval_fraction`, or `eval_every=0`).
    """

    n_docs = len(source)
    if n_docs < 2:
        raise ValueError(
            f"{corpus}: eval_fraction={fraction}: it has {n_docs} document(s); a held-out split needs at least 2 "
            f"(use a corpus of several documents, or eval_every=0 to train without validation)"
        )
    order = np.random.default_rng([seed, 1]).permutation(n_docs)
    want, held, total = max(1, round(fraction * n_docs)), [], 0
    for i in order[: n_docs - 1]:
        if len(held) >= want and total >= min_tokens:
            break
        held.append(int(i))
        total += document_tokens(source[int(i)], tokenizer).size
    return sorted(held)


def validation_batches(cfg: Config, source, tokenizer, indices, n_batches: int) -> list[dict]:
    """The validation batches of the documents at `indices`, cut by the training pipeline itself
    (`jaxlong.data.make_dataset` with the run's `seq_len`, `data.packing` and `data.split_positions`; no
    shuffle, one pass): each document is `[BOS] ids [EOS]` in its own segment, positions restart per document
    (or per piece of a long one), padding is masked. A training batch of the same documents has the same
    segment ids, positions and loss mask.

    Returns at most `n_batches` host batches `{'inputs', 'targets', 'positions', 'segment_ids' int32, 'mask'
    float32}` of `[eval_batch_size(cfg), seq_len]`; fewer when the documents cannot fill them.
    """

    d = cfg.data
    ds = make_dataset(DocumentSubset(source, indices), tokenizer, seq_len=cfg.seq_len,
                      global_batch=eval_batch_size(cfg), seed=cfg.seed, packing=d.packing,
                      split_positions=d.split_positions, shuffle=False, repeat=False,
                      read_threads=d.read_threads, read_buffer=d.read_buffer)
    batches = list(itertools.islice(iter(ds), n_batches))
    for b in batches:  # preference pairs: which pair each token is of (the reference pass's, not a step input)
        b.pop(PAIR_FEATURE, None)
    return batches


def validation_split(cfg: Config, source, tokenizer, n_batches: int | None = None) -> tuple[list[int], list[dict]]:
    """The held-out documents of a run and its validation batches: what the trainer validates on, and what
    `python -m jaxlong.eval` evaluates (the same documents for the same `eval_fraction`, `seed`, corpus and
    batch count).

    Documents are held out (`held_out_documents`) until their tokens would fill `n_batches` (default
    `eval_batches`) batches of `eval_batch_size(cfg) x seq_len`; when packing leaves the batches short (padding,
    streams of unequal length), half as many tokens again are asked for, until the batches are full.

    Returns `(indices, batches)`: the held-out document indices (sorted) and `n_batches` host batches
    (`validation_batches`).

    Raises:
      ValueError: fewer than two documents, or all documents but one cannot fill the batches (the message names
        the corpus, `data.path` or `data.sources[0]` and its path (`corpus_label`), its documents and
        `eval_batches` or `eval_fraction`).
    """
    n_batches = n_batches or cfg.eval_batches
    need = n_batches * eval_batch_size(cfg) * cfg.seq_len + 1
    corpus = corpus_label(cfg)
    while True:
        indices = held_out_documents(source, tokenizer, cfg.eval_fraction, cfg.seed, need, corpus)
        batches = validation_batches(cfg, source, tokenizer, indices, n_batches)
        if len(batches) == n_batches:
            return indices, batches
        if len(indices) >= len(source) - 1:
            raise ValueError(
                f"{corpus}: eval_batches={n_batches}: its {len(source)} documents cannot fill {n_batches} validation "
                f"batches of {eval_batch_size(cfg)} x seq_len={cfg.seq_len} tokens while keeping a document for "
                f"training; lower eval_batches or seq_len, use a larger corpus, or eval_every=0"
            )
        need += need // 2


def corpus_label(cfg: Config) -> str:
    """How messages name the corpus validation holds documents out of: `data.path='x.jsonl'` (`data.path=null
    (the Python stdlib sources)`), or with `data.sources` the first source, `data.sources[0] (PATH)`."""
    if cfg.data.sources:
        return source_label(cfg.data.sources[0], 0)
    return "data.path=null (the Python stdlib sources)" if cfg.data.path is None else f"data.path={cfg.data.path!r}"


def eval_batch_size(cfg: Config) -> int:
    """Sequences per eval batch: one training micro-batch (`global_batch / grad_accum`), so evaluation holds
    no more activations than a training micro-step."""
    return cfg.global_batch // cfg.grad_accum
