"""Data pipeline: corpus loading, byte tokenizer, concatenate-and-chunk packing, sharded batches.

Corpora
-------
* Default (``path=None``): the ``*.py`` source files of the Python standard library installed
  on this machine, found with ``sysconfig.get_paths()['stdlib']``. Nothing is downloaded.
  Files under ``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idlelib``,
  ``lib2to3`` and ``__pycache__`` directories are excluded. Paths are sorted (relative to the
  stdlib root), so the corpus is deterministic for a given Python installation. Files are
  read as UTF-8 with ``errors='replace'``. One file = one document. On CPython 3.11 this is
  about 600 files / ~11 MB of text (≈ 11.07 M byte tokens incl. eod).
* ``path`` to a ``.txt`` file: the whole file is one document.
* ``path`` to a ``.jsonl`` file: every non-blank line is a JSON object with a string field
  ``text``; each line is one document.
* ``path`` to a directory: every ``*.txt`` / ``*.jsonl`` file below it (recursively), in sorted
  relative-path order, read as above.

Packing
-------
Each document is tokenized and followed by ``tokenizer.eod_id``; all documents are
concatenated into one int32 token stream (see :func:`load_corpus`, cached in memory). The
stream is cut into ``num_sequences = (len(tokens) - 1) // seq_len`` windows of ``seq_len + 1``
tokens with stride ``seq_len`` (window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``,
consecutive windows share one boundary token), so every token after the first is a target
exactly once per epoch. ``inputs = window[:-1]``, ``targets = window[1:]``. No padding is ever
needed; ``mask`` is all ones but kept so loss code can stay generic.

Order
-----
Each epoch visits the windows in a permutation drawn from ``np.random.default_rng([seed,
epoch])``; an epoch has ``num_sequences // global_batch`` steps (the remainder of the
permutation is dropped for that epoch). Batch ``step`` is therefore a pure function of
``(tokens, seq_len, global_batch, seed, step)``, which makes resuming at ``start_step`` exact
and O(1) (no replay).
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "get_tokenizer",
    "TOKENIZERS",
    "stdlib_files",
    "iter_documents",
    "load_corpus",
    "Batches",
    "make_batch_iterator",
    "put_on_mesh",
]


# --------------------------------------------------------------------------- tokenizer


class Tokenizer(Protocol):
    """Minimal tokenizer interface used by the pipeline.

    Attributes:
      name: registry name (used as part of the corpus cache key).
      vocab_size: number of token ids; all ids are in ``[0, vocab_size)``.
      eod_id: id appended after every document.
    """

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: id = UTF-8 byte value (0..255), plus ``eod_id = 256``.

    ``vocab_size`` is 257. ``encode(str) -> int32 [n_bytes]`` (no eod added; packing adds it).
    ``decode(ids) -> str`` drops eod (and any id outside 0..255) and decodes UTF-8 with
    ``errors='replace'``, so decoding an arbitrary slice (e.g. one cutting a multi-byte
    character) never raises.
    """

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod_id(self) -> int:
        return 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < 256)]
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """Return a tokenizer by registry name (``data.tokenizer``); currently only ``'byte'``.

    Raises:
      ValueError: unknown name (the message lists the allowed names).
    """
    if name not in TOKENIZERS:
        raise ValueError(
            f"data.tokenizer={name!r} is not supported; allowed: {sorted(TOKENIZERS)}"
        )
    return TOKENIZERS[name]()


# --------------------------------------------------------------------------- documents

_STDLIB_EXCLUDE = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_ACCEPTED = (
    "None (Python stdlib sources), a .txt file, a .jsonl file (one JSON object with a "
    "'text' field per line), or a directory containing .txt/.jsonl files"
)


def stdlib_files() -> list[Path]:
    """Sorted list of the stdlib ``*.py`` files forming the default corpus (see module doc)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDE]
        for f in filenames:
            if f.endswith(".py"):
                out.append(Path(dirpath) / f)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _iter_jsonl(path: Path) -> Iterator[str]:
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data.path: {path}:{lineno} is not valid JSON ({e})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(
                    f"data.path: {path}:{lineno} must be a JSON object with a string 'text' field"
                )
            yield obj["text"]


def _iter_file(path: Path) -> Iterator[str]:
    if path.suffix == ".txt":
        yield _read_text(path)
    else:
        yield from _iter_jsonl(path)


def iter_documents(path: str | os.PathLike | None) -> Iterator[str]:
    """Yield the documents (str) of a corpus lazily, in deterministic order.

    Args:
      path: ``None`` for the stdlib corpus, else a ``.txt`` / ``.jsonl`` file or a directory.

    Raises:
      ValueError: (naming ``data.path``) missing path, unsupported extension, a directory
        without .txt/.jsonl files, or a malformed jsonl line. Path errors are raised
        eagerly, on the call, not on first iteration.
    """
    if path is None:
        files = stdlib_files()
        return (_read_text(p) for p in files)
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data.path={str(path)!r} does not exist; accepted: {_ACCEPTED}")
    if p.is_dir():
        files = sorted(
            (q for q in p.rglob("*") if q.is_file() and q.suffix in (".txt", ".jsonl")),
            key=lambda q: q.relative_to(p).as_posix(),
        )
        if not files:
            raise ValueError(
                f"data.path={str(path)!r} is a directory without .txt/.jsonl files; "
                f"accepted: {_ACCEPTED}"
            )
    elif p.suffix in (".txt", ".jsonl"):
        files = [p]
    else:
        raise ValueError(
            f"data.path={str(path)!r} has unsupported extension {p.suffix!r}; accepted: {_ACCEPTED}"
        )
    return (doc for f in files for doc in _iter_file(f))


# --------------------------------------------------------------------------- corpus

_CORPUS_CACHE: dict[tuple, np.ndarray] = {}


def load_corpus(
    path: str | os.PathLike | None,
    tokenizer: Tokenizer,
    max_tokens: int | None = None,
    *,
    cache: bool = True,
) -> np.ndarray:
    """Tokenize a corpus into one packed token stream ``int32 [n_tokens]``.

    Every document is encoded and followed by ``tokenizer.eod_id``. Reading stops as soon as
    ``max_tokens`` tokens (eod included) are collected, and the stream is truncated to exactly
    ``max_tokens``; ``None`` reads everything. The result is cached in process memory, keyed
    by (resolved path, tokenizer name, max_tokens), and returned read-only; pass
    ``cache=False`` to re-read (e.g. after the files changed).

    Raises:
      ValueError: bad ``data.path`` (see :func:`iter_documents`), ``max_tokens < 1``, or a
        corpus with no tokens.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"data.max_tokens must be >= 1 or None, got {max_tokens}")
    key = (
        None if path is None else str(Path(path).resolve()),
        getattr(tokenizer, "name", type(tokenizer).__name__),
        max_tokens,
    )
    if cache and key in _CORPUS_CACHE:
        return _CORPUS_CACHE[key]

    eod = np.array([tokenizer.eod_id], dtype=np.int32)
    parts, n = [], 0
    for doc in iter_documents(path):
        ids = np.asarray(tokenizer.encode(doc), dtype=np.int32)
        parts += [ids, eod]
        n += ids.size + 1
        if max_tokens is not None and n >= max_tokens:
            break
    if n == 0:
        raise ValueError(f"data.path={path!r}: corpus is empty")
    tokens = np.concatenate(parts)[:max_tokens]
    tokens.setflags(write=False)
    if cache:
        _CORPUS_CACHE[key] = tokens
    return tokens


# --------------------------------------------------------------------------- batches


class Batches:
    """Infinite, deterministic, resumable iterator over packed batches.

    Yields dicts ``{'inputs': int32 [B, L], 'targets': int32 [B, L], 'mask': float32 [B, L]}``
    (host numpy) with ``B = global_batch`` and ``L = seq_len``. ``step`` is the index of the
    next batch to be yielded; ``batch_at(step)`` computes any batch directly.

    Attributes:
      num_sequences: number of ``seq_len + 1`` windows in the stream, ``(n_tokens-1)//seq_len``.
      steps_per_epoch: ``num_sequences // global_batch``.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, seed: int,
                 start_step: int = 0):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len and global_batch must be >= 1, got {seq_len}, {global_batch}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {seed}")
        self.tokens = tokens.astype(np.int32, copy=False)
        self.seq_len, self.global_batch, self.seed = int(seq_len), int(global_batch), int(seed)
        self.num_sequences = max(0, (tokens.size - 1) // self.seq_len)
        if self.num_sequences < self.global_batch:
            raise ValueError(
                f"corpus too small: {tokens.size} tokens give {self.num_sequences} sequences of "
                f"seq_len={seq_len} (+1 target token), fewer than global_batch={global_batch}; "
                f"need at least {global_batch * self.seq_len + 1} tokens "
                f"(raise data.max_tokens / use a bigger corpus, or lower seq_len / global_batch)"
            )
        self.steps_per_epoch = self.num_sequences // self.global_batch
        self.step = int(start_step)
        self._perm_epoch, self._perm = -1, None
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_sequences), epoch
        return self._perm

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The batch of global step ``step`` (epoch ``step // steps_per_epoch``)."""
        epoch, j = divmod(int(step), self.steps_per_epoch)
        seq_ids = self._permutation(epoch)[j * self.global_batch:(j + 1) * self.global_batch]
        windows = self.tokens[seq_ids[:, None] * self.seq_len + self._offsets]  # [B, L+1]
        return {
            "inputs": np.ascontiguousarray(windows[:, :-1]),
            "targets": np.ascontiguousarray(windows[:, 1:]),
            "mask": np.ones((self.global_batch, self.seq_len), dtype=np.float32),
        }

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch


def make_batch_iterator(tokens: np.ndarray, *, seq_len: int, global_batch: int, seed: int,
                        start_step: int = 0) -> Batches:
    """Infinite iterator of global batches; see :class:`Batches`.

    ``start_step=k`` yields exactly what the uninterrupted iterator yields from step ``k`` on.

    Raises:
      ValueError: fewer than ``global_batch`` sequences in the corpus, or bad arguments.
    """
    return Batches(tokens, seq_len=seq_len, global_batch=global_batch, seed=seed,
                   start_step=start_step)


# --------------------------------------------------------------------------- placement


def put_on_mesh(batch: dict, sharding) -> dict:
    """Place a host global batch onto a mesh, already sharded (no host gather).

    Uses ``jax.make_array_from_callback`` so each process only transfers its addressable
    shards; in multi-process runs every process must hold the same global host batch (it
    does, since batches depend only on seed and step).

    Args:
      batch: dict of numpy arrays with the global shape, e.g. ``[global_batch, seq_len]``.
      sharding: a ``jax.sharding.Sharding`` used for every entry, typically
        ``NamedSharding(mesh, P(('data', 'fsdp'), 'context'))``.

    Returns:
      dict of ``jax.Array`` with the same keys, global shapes and dtypes.

    Raises:
      ValueError: an array's shape is not divisible by the sharding (message names the key).
    """
    import jax

    out = {}
    for k, v in batch.items():
        arr = np.asarray(v)
        try:
            sharding.shard_shape(arr.shape)
        except Exception as e:  # noqa: BLE001 - re-raise with the key for context
            raise ValueError(f"batch[{k!r}] of shape {arr.shape} cannot be sharded by "
                             f"{sharding}: {e}") from e
        out[k] = jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx])
    return out
