"""Corpus sources: which documents a run trains on, as a random-access Grain data source of strings.

* Default (`data.path: null`): the `*.py` source files of the Python standard library installed on this
  machine (`sysconfig.get_paths()['stdlib']`), nothing downloaded. Files under `site-packages`,
  `dist-packages`, `test`, `tests`, `idlelib`, `lib2to3` and `__pycache__` are excluded; paths are
  sorted relative to the stdlib root, so the corpus is deterministic for a Python installation. One file = one
  document (about 600 files / 11 MB on CPython 3.11).
* A `.txt` file: the whole file is one document.
* A `.jsonl` file: every non-blank line is a JSON object whose string field `data.text_field` (default
  `text`) is one document.
* A `.parquet` file (needs `pyarrow`: `pip install 'jaxlong[parquet]'`): every row of the string column
  `data.text_field` is one document, in file order; a null is no document (like a blank `.jsonl` line), an
  empty string is an empty document (like `{"text": ""}`). Documents are read by index from the row-group
  metadata (document -> row group, row): one row group's text column is decoded at a time and the last one is
  kept, so the file is never loaded whole. Shuffled reads decode one row group per document that misses this
  cache: keep row groups small (a few MB) for corpora of many short documents.
* A `.array_record` file (needs `array_record`: `pip install 'jaxlong[arrayrecord]'`), read with Grain's
  `ArrayRecordDataSource`: every record is one document of UTF-8 text (write it with
  `group_size:1` for fast random access).
* A directory: every `.txt` / `.jsonl` / `.parquet` / `.array_record` file below it (recursively), in
  sorted relative-path order.

Files are read as UTF-8 (undecodable bytes replaced). Everything that can be checked is checked when the source
is built, before anything compiles, and errors name the option, the file and, for `.jsonl`, the line: a
missing path, an unsupported extension, a directory without corpus files, an empty corpus, a file that is not
text (NUL bytes, or more than 30% of its first 64 KiB undecodable), a `.jsonl` line that is not JSON or lacks
the text field, a `.parquet` file without the column `data.text_field` (the message lists its string
columns) or whose column is not a string, a file that `pyarrow` / `array_record` cannot open, and either
library missing. A `.jsonl` file is indexed once (byte offset of every document line), a `.parquet` file
from its metadata (its text column is read once only for row groups that contain nulls); documents are then
read one at a time by index, so shuffling and resuming never re-read the corpus from the start.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools
import json
import os
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["DocRef", "DocumentSource", "ParquetDocuments", "ArrayRecordDocuments", "stdlib_files", "corpus_files",
           "check_text_file"]

_STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_SUFFIXES = (".txt", ".jsonl", ".parquet", ".array_record")
_ACCEPTED = (
    "null (Python stdlib sources), a .txt file, a .jsonl file (one JSON object per line with the text in "
    "data.text_field), a .parquet file (the text in the string column data.text_field), an .array_record file "
    "(one UTF-8 document per record), or a directory containing such files"
)
_SNIFF_BYTES = 64 * 1024
_MAX_UNDECODABLE = 0.3


def stdlib_files() -> list[Path]:
    """Sorted list of the stdlib `*.py` files forming the default corpus (see module doc)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDE]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def corpus_files(path: str | os.PathLike) -> list[Path]:
    """The corpus files of `data.path` (a `.txt`/`.jsonl`/`.parquet`/`.array_record` file, or a
    directory of them), sorted.

    Raises:
      ValueError: missing path, unsupported extension, or a directory without corpus files.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data.path={str(path)!r} does not exist; accepted: {_ACCEPTED}")
    if p.is_dir():
        files = sorted((q for q in p.rglob("*") if q.is_file() and q.suffix in _SUFFIXES),
                       key=lambda q: q.relative_to(p).as_posix())
        if not files:
            raise ValueError(f"data.path={str(path)!r} is a directory without .txt/.jsonl/.parquet/.array_record "
                             f"files; accepted: {_ACCEPTED}")
        return files
    if p.suffix not in _SUFFIXES:
        raise ValueError(f"data.path={str(path)!r} has unsupported extension {p.suffix!r}; accepted: {_ACCEPTED}")
    return [p]


def check_text_file(path: Path) -> None:
    """Raise ValueError (naming the file) unless its first 64 KiB look like text: no NUL byte and at most 30%
    of the characters undecodable as UTF-8."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    _check_text_bytes(path, head)


def _check_text_bytes(path, head: bytes) -> None:
    if b"\x00" in head:
        raise ValueError(f"data.path: {path} is not a text file (it contains NUL bytes); give UTF-8 text")
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if text and bad / len(text) > _MAX_UNDECODABLE:
        raise ValueError(f"data.path: {path} is not a text file ({bad} of the first {len(text)} characters are not "
                         f"UTF-8); give UTF-8 text")


@dataclass(frozen=True)
class DocRef:
    """Where one document is: a whole file (`offset == -1`) or the `.jsonl` line at byte `offset`."""

    path: str
    offset: int = -1
    lineno: int = 0


def _jsonl_text(path, lineno: int, line: bytes | str, field: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"data.path: {path}:{lineno} is not valid JSON ({e})") from e
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise ValueError(f"data.path: {path}:{lineno} must be a JSON object with a string {field!r} field "
                         f"(data.text_field={field!r})")
    return obj[field]


def _index_jsonl(path: Path, field: str) -> list[DocRef]:
    """One DocRef per non-blank line; every line is parsed once here so a bad line fails before compiling."""
    refs, offset = [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                _jsonl_text(path, lineno, line.decode("utf-8", errors="replace"), field)
                refs.append(DocRef(str(path), offset, lineno))
            offset += len(line)
    return refs


def _need(module: str, extra: str, path) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"data.path: reading {path} needs the {module} package, which is not installed; "
                         f"pip install 'jaxlong[{extra}]' (or pip install {module})")


def _is_string(t) -> bool:
    import pyarrow as pa  # noqa: PLC0415

    if pa.types.is_dictionary(t):
        t = t.value_type
    string_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or string_view(t)


class ParquetDocuments:
    """The documents of one `.parquet` file: the non-null rows of its string column `field`, in file order.

    Random access by document index without loading the file: the row-group metadata maps a document to
    (row group, row) (row groups that contain nulls, by their null count statistics or missing statistics, have
    their column's validity read once here); `__getitem__` decodes one row group's text column and keeps the
    last one. Picklable (the open file and the cache are rebuilt after unpickling) and thread-safe.

    Raises:
      ValueError: pyarrow missing, a file pyarrow cannot open, no column `field` (the message lists the
        string columns), or a column that is not a string; each names `data.path`/`data.text_field`.
    """

    def __init__(self, path: str | os.PathLike, field: str = "text"):
        _need("pyarrow", "parquet", path)
        self.path, self.field = str(path), field
        f = self._open()
        schema = f.schema_arrow
        strings = [n for n in schema.names if _is_string(schema.field(n).type)]
        if field not in schema.names:
            raise ValueError(f"data.path: {path} has no column {field!r} (data.text_field={field!r}); "
                             f"its string columns: {strings}")
        if field not in strings:
            raise ValueError(f"data.path: {path} column {field!r} has type {schema.field(field).type}, not a "
                             f"string (data.text_field={field!r}); its string columns: {strings}")
        md = f.metadata
        leaf = [md.schema.column(j).path for j in range(md.num_columns)].index(field)
        self.starts, self.rows = [0], []  # first document of each row group; its rows with text (None: all)
        for g in range(md.num_row_groups):
            n, stats = md.row_group(g).num_rows, md.row_group(g).column(leaf).statistics
            if stats is not None and stats.has_null_count and stats.null_count == 0:
                rows = None
            else:
                valid = f.read_row_group(g, columns=[field]).column(0).is_valid()
                rows = np.flatnonzero(valid.to_numpy(zero_copy_only=False))
                if rows.size == n:
                    rows = None
            self.rows.append(rows)
            self.starts.append(self.starts[-1] + (n if rows is None else int(rows.size)))

    def _open(self):
        import pyarrow.parquet as pq  # noqa: PLC0415

        try:
            self._file = pq.ParquetFile(self.path)
        except Exception as e:  # noqa: BLE001 - any reader failure becomes an error naming the file
            raise ValueError(f"data.path: {self.path} is not a readable Parquet file ({e})") from e
        self._cached, self._lock = (-1, None), threading.Lock()
        return self._file

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_file", "_cached", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)} in {self.path}")
        g = bisect.bisect_right(self.starts, index) - 1
        row = index - self.starts[g] if self.rows[g] is None else int(self.rows[g][index - self.starts[g]])
        with self._lock:
            if self._cached[0] != g:
                self._cached = (g, self._file.read_row_group(g, columns=[self.field]).column(0))
            return self._cached[1][row].as_py()


class ArrayRecordDocuments:
    """The documents of one `.array_record` file: one UTF-8 record each (Grain's `ArrayRecordDataSource`).

    Raises:
      ValueError: array_record missing, a file it cannot open, or a first record that is not text.
    """

    def __init__(self, path: str | os.PathLike):
        _need("array_record", "arrayrecord", path)
        import grain  # noqa: PLC0415

        self.path = str(path)
        try:
            self.source = grain.sources.ArrayRecordDataSource([self.path])
            n = len(self.source)
            head = self.source[0][:_SNIFF_BYTES] if n else b""
        except Exception as e:  # noqa: BLE001 - any reader failure becomes an error naming the file
            raise ValueError(f"data.path: {path} is not a readable ArrayRecord file ({e})") from e
        _check_text_bytes(path, head)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> str:
        return self.source[index].decode("utf-8", errors="replace")


class DocumentSource:
    """Random-access Grain data source (`__len__`, `__getitem__`) of the documents of a corpus, as `str`.

    Args:
      path: `data.path` (None: the stdlib corpus).
      text_field: `data.text_field`, the JSON field of a `.jsonl` document / the column of a `.parquet` one.

    Raises:
      ValueError: see the module docstring (each message names `data.path` and the file / line).
    """

    def __init__(self, path: str | os.PathLike | None, text_field: str = "text"):
        self.path, self.text_field = path, text_field
        files = stdlib_files() if path is None else corpus_files(path)
        # parts: runs of DocRefs (.txt/.jsonl) or per-file readers (.parquet/.array_record), in file order
        self.parts: list = []
        nonempty = False
        for f in files:
            if f.suffix == ".parquet":
                part = ParquetDocuments(f, text_field)
            elif f.suffix == ".array_record":
                part = ArrayRecordDocuments(f)
            else:
                if path is not None:
                    check_text_file(f)
                refs = _index_jsonl(f, text_field) if f.suffix == ".jsonl" else [DocRef(str(f))]
                if self.parts and isinstance(self.parts[-1], list):
                    self.parts[-1] += refs
                else:
                    self.parts.append(refs)
                nonempty = nonempty or any(r.offset >= 0 or os.path.getsize(r.path) > 0 for r in refs)
                continue
            self.parts.append(part)
            nonempty = nonempty or len(part) > 0
        if not nonempty:
            raise ValueError(f"data.path={str(path)!r}: the corpus is empty (no documents); accepted: {_ACCEPTED}")
        self.starts = [0, *itertools.accumulate(map(len, self.parts))]

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> str:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        k = bisect.bisect_right(self.starts, index) - 1
        ref = self.parts[k][index - self.starts[k]]
        if not isinstance(ref, DocRef):
            return ref
        with open(ref.path, "rb") as f:
            if ref.offset < 0:
                return f.read().decode("utf-8", errors="replace")
            f.seek(ref.offset)
            line = f.readline().decode("utf-8", errors="replace")
        return _jsonl_text(ref.path, ref.lineno, line, self.text_field)

    def __repr__(self) -> str:
        return f"DocumentSource(path={self.path!r}, documents={len(self)})"
