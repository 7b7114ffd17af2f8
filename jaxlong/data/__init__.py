"""Training data: corpus sources, tokenizers, packed documents, a resumable Grain pipeline.

Batches go onto the mesh with `jaxlong.core.batch.put_batch` (the input layout of every step).

* `jaxlong.data.sources` — the documents of `data.path` (stdlib sources, .txt, .jsonl, .parquet, .array_record)
  as a Grain data source, with every file checked before anything compiles.
* `jaxlong.data.tokenizer` — the byte tokenizer and Hugging Face `tokenizer.json` files (BOS/EOS from the
  tokenizer's own config files).
* `jaxlong.data.imported` — the run's copy of the tokenizer files it was imported with (`RUN_DIR/imported/`) and
  the one tokenizer resolver, `run_tokenizer`.
* `jaxlong.data.pipeline` — shuffle, tokenize, pack (`data.packing=documents|concat`) and batch with Grain;
  batches carry `segment_ids` and per-document `positions`; the iterator state goes into checkpoints.
* `jaxlong.data.mixture` — `data.sources`: several corpora mixed by their share of the tokens, with length rules
  and long-document upsampling per source, the rules checked and heavy repetition warned about before training.
"""
from __future__ import annotations

from jaxlong.data.pipeline import (
    PAIR_FEATURE,
    DocumentSubset,
    PipelineOptions,
    batch_iterator,
    document_pairs,
    document_tokens,
    first_source,
    make_dataset,
    merge_states,
    mixture_sources,
    packing_efficiency,
    source_shares,
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
from jaxlong.data.sources import DocumentSource, corpus_files, stdlib_files
from jaxlong.data.tokenizer import (
    TOKENIZERS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_vocab,
    get_tokenizer,
)
from jaxlong.data.imported import run_tokenizer, tokenizer_source

__all__ = [
    "Tokenizer", "ByteTokenizer", "HFTokenizer", "get_tokenizer", "run_tokenizer", "tokenizer_source", "check_vocab",
    "TOKENIZERS", "DocumentSource", "stdlib_files", "corpus_files",
    "document_tokens", "document_pairs", "DocumentSubset", "make_dataset", "PipelineOptions", "merge_states",
    "batch_iterator", "packing_efficiency", "first_source", "mixture_sources", "source_shares", "SOURCE_FEATURE",
    "MixedSource", "TokenShareMix", "source_name", "source_label", "SourceLengths", "measure_lengths",
    "check_lengths", "repetition_warnings", "PAIR_FEATURE",
]

