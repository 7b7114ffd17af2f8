"""Held-out validation data: whole documents of the corpus, packed into batches by the training pipeline
(`jaxlong.data.make_dataset`), so held-out and training batches present documents alike. The trainer leaves them out
of training and validates on them; `python -m jaxlong.eval` evaluates the same ones.

Messages name the options of the command that prints them (`HeldOutOptions`: the trainer's `eval_batches` and
`eval_every=0`, the evaluation's `--batches`)."""

from __future__ import annotations

import itertools

import numpy as np

from dataclasses import dataclass

from jaxlong.data.mixture import source_label
from jaxlong.data.pipeline import PAIR_FEATURE, DocumentSubset, PipelineOptions, document_tokens, make_dataset

__all__ = ["HeldOutOptions", "TRAINER", "EVALUATION", "held_out_documents", "validation_batches", "validation_split",
           "corpus_label", "eval_batch_size"]


@dataclass(frozen=True)
class HeldOutOptions:
    """The options a held-out split's messages name: `batches` sets the batch count (`{}` its value), `none` is the
    setting that needs no held-out documents and `none_does` what it does."""

    batches: str = "eval_batches={}"
    none: str = "eval_every=0"
    none_does: str = "to train without validation"

    @property
    def batches_name(self) -> str:
        return self.batches.split("{}")[0].rstrip("= ")


TRAINER = HeldOutOptions()  # python -m jaxlong.train
EVALUATION = HeldOutOptions("--batches {}", "--batches 0", "to evaluate without validation batches")  # jaxlong.eval


def held_out_documents(source, tokenizer, fraction: float, seed: int, min_tokens: int = 0,
                       corpus: str = "the corpus", options: HeldOutOptions = TRAINER) -> list[int]:
    """Hold out whole documents of a corpus (`jaxlong.data.DocumentSource` or any sequence of texts) for
    validation: taken in the order of `np.random.default_rng([seed, 1]).permutation(n_docs)`, at least
    `max(1, round(fraction * n_docs))` and more until their tokens (`[BOS] ids [EOS]` each) reach `min_tokens`,
    never all of them. Only the documents taken are tokenized. `corpus` names the corpus in messages
    (`corpus_label`), `options` the command's options (`HeldOutOptions`).

    Returns the held-out document indices, sorted (the training pipeline skips them).

    Raises:
      ValueError: the corpus has fewer than two documents (option `eval_fraction`, or `eval_every=0`).
    """

    n_docs = len(source)
    if n_docs < 2:
        raise ValueError(f"{corpus}: eval_fraction={fraction}: it has {n_docs} document(s); a held-out split needs "
                         f"at least 2 (use a corpus of several documents, or {options.none} {options.none_does})")
    order = np.random.default_rng([seed, 1]).permutation(n_docs)
    want, held, total = max(1, round(fraction * n_docs)), [], 0
    for i in order[: n_docs - 1]:
        if len(held) >= want and total >= min_tokens:
            break
        held.append(int(i))
        total += document_tokens(source[int(i)], tokenizer).size
    return sorted(held)


def validation_batches(cfg, source, tokenizer, indices, n_batches: int) -> list[dict]:
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
                      global_batch=eval_batch_size(cfg),
                      options=PipelineOptions(seed=cfg.seed, packing=d.packing, split_positions=d.split_positions,
                                              shuffle=False, repeat=False, read_threads=d.read_threads,
                                              read_buffer=d.read_buffer))
    batches = list(itertools.islice(iter(ds), n_batches))
    for b in batches:  # preference pairs: which pair each token is of (the reference pass's, not a step input)
        b.pop(PAIR_FEATURE, None)
    return batches


def validation_split(cfg, source, tokenizer, n_batches: int | None = None,
                     options: HeldOutOptions = TRAINER) -> tuple[list[int], list[dict]]:
    """The held-out documents of a run and its validation batches: what the trainer validates on, and what
    `python -m jaxlong.eval` evaluates (the same documents for the same `eval_fraction`, `seed`, corpus and
    batch count). `options` names the command's options in the messages (`HeldOutOptions`).

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
        indices = held_out_documents(source, tokenizer, cfg.eval_fraction, cfg.seed, need, corpus, options)
        batches = validation_batches(cfg, source, tokenizer, indices, n_batches)
        if len(batches) == n_batches:
            return indices, batches
        if len(indices) >= len(source) - 1:
            raise ValueError(f"{corpus}: {options.batches.format(n_batches)}: its {len(source)} documents cannot "
                             f"fill {n_batches} validation batches of {eval_batch_size(cfg)} x seq_len={cfg.seq_len} "
                             f"tokens while keeping a document for training; lower {options.batches_name} or "
                             f"seq_len, use a larger corpus, or {options.none}")
        need += need // 2


def corpus_label(cfg) -> str:
    """How messages name the corpus validation holds documents out of: `data.path='x.jsonl'` (`data.path=null
    (the Python stdlib sources)`), or with `data.sources` the first source, `data.sources[0] (PATH)`."""
    if cfg.data.sources:
        return source_label(cfg.data.sources[0], 0)
    return "data.path=null (the Python stdlib sources)" if cfg.data.path is None else f"data.path={cfg.data.path!r}"


def eval_batch_size(cfg) -> int:
    """Sequences per eval batch: one training micro-batch (`global_batch / grad_accum`), so evaluation holds
    no more activations than a training micro-step."""
    return cfg.global_batch // cfg.grad_accum
