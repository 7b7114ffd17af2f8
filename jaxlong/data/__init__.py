"""Training data: corpus sources, tokenizers, packed documents, a resumable Grain pipeline, sharded batches.

* `jaxlong.data.sources` — the documents of `data.path` (stdlib sources, .txt, .jsonl, .parquet, .array_record)
  as a Grain data source, with every file checked before anything compiles.
* `jaxlong.data.tokenizer` — the byte tokenizer and Hugging Face `tokenizer.json` files (BOS/EOS from the
  tokenizer's own config files).
* `jaxlong.data.pipeline` — shuffle, tokenize, pack (`data.packing=documents|concat`) and batch with Grain;
  batches carry `segment_ids` and per-document `positions`; the iterator state goes into checkpoints.
* `put_on_mesh` (here) — a process's host batch onto the device mesh.
"""
from __future__ import annotations

import numpy as np

from jaxlong.data.pipeline import (
    batch_iterator,
    document_pairs,
    document_tokens,
    make_dataset,
    packing_efficiency,
)
from jaxlong.data.sources import DocumentSource, corpus_files, stdlib_files
from jaxlong.data.tokenizer import TOKENIZERS, ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, get_tokenizer

__all__ = [
    "Tokenizer", "ByteTokenizer", "HFTokenizer", "get_tokenizer", "check_vocab", "TOKENIZERS",
    "DocumentSource", "stdlib_files", "corpus_files",
    "document_tokens", "document_pairs", "make_dataset", "batch_iterator", "packing_efficiency",
    "put_on_mesh",
]


def put_on_mesh(batch: dict, sharding, *, process_local: bool = True) -> dict:
    """Place a host batch onto the mesh, already sharded (no host gather).

    With `process_local=True` (training) each process passes the rows its pipeline produced
    (`[global_batch / process_count, seq_len]`, see `jaxlong.data.pipeline`), placed with
    `jax.make_array_from_process_local_data`. With `process_local=False` every process holds the same global
    batch (evaluation's fixed batches) and each device takes its block of it (`jax.make_array_from_callback`).
    With one process both are the same.

    Args:
      batch: dict of numpy arrays `[local_batch, seq_len]` (`[global_batch, seq_len]` when not process-local).
      sharding: a `jax.sharding.Sharding` used for every entry, typically
        `NamedSharding(mesh, P(('data', 'fsdp'), 'context'))`.
      process_local: whether `batch` holds this process's rows only.

    Returns:
      dict of global `jax.Array`s with the same keys and dtypes.

    Raises:
      ValueError: an array's shape cannot be sharded by `sharding` (the message names the key).
    """
    import jax  # noqa: PLC0415

    out = {}
    for k, v in batch.items():
        arr = np.asarray(v)
        global_shape = (arr.shape[0] * (jax.process_count() if process_local else 1), *arr.shape[1:])
        try:
            sharding.shard_shape(global_shape)
        except Exception as e:  # noqa: BLE001 - re-raise with the key for context
            raise ValueError(f"batch[{k!r}] of shape {global_shape} cannot be sharded by {sharding}: {e}") from e
        if process_local:
            out[k] = jax.make_array_from_process_local_data(sharding, arr, global_shape)
        else:
            out[k] = jax.make_array_from_callback(global_shape, sharding, lambda index, a=arr: a[index])
    return out
