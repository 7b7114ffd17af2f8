"""Corpus sources: which documents a run trains on, as a random-access Grain data source of strings.

* Default (``data.path: null``): the ``*.py`` source files of the Python standard library installed on this
  machine (``sysconfig.get_paths()['stdlib']``), nothing downloaded. Files under ``site-packages``,
  ``dist-packages``, ``test``, ``tests``, ``idlelib``, ``lib2to3`` and ``__pycache__`` are excluded; paths are
  sorted relative to the stdlib root, so the corpus is deterministic for a Python installation. One file = one
  document (about 600 files / 11 MB on CPython 3.11).
* A ``.txt`` file: the whole file is one document.
* A ``.jsonl`` file: every non-blank line is a JSON object whose string field ``data.text_field`` (default
  ``text``) is one document.
* A directory: every ``.txt`` / ``.jsonl`` file below it (recursively), in sorted relative-path order.

Files are read as UTF-8 (undecodable bytes replaced). Everything that can be checked is checked when the source
is built, before anything compiles, and errors name the option, the file and, for ``.jsonl``, the line: a
missing path, an unsupported extension, a directory without corpus files, an empty corpus, a file that is not
text (NUL bytes, or more than 30% of its first 64 KiB undecodable), a ``.jsonl`` line that is not JSON or lacks
the text field. A ``.jsonl`` file is indexed once (byte offset of every document line); documents are then
read one at a time by index, so shuffling and resuming never re-read the corpus from the start.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DocRef", "DocumentSource", "stdlib_files", "corpus_files", "check_text_file"]

_STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_SUFFIXES = (".txt", ".jsonl")
_ACCEPTED = (
    "null (Python stdlib sources), a .txt file, a .jsonl file (one JSON object per line with the text in "
    "data.text_field), or a directory containing .txt/.jsonl files"
)
_SNIFF_BYTES = 64 * 1024
_MAX_UNDECODABLE = 0.3


def stdlib_files() -> list[Path]:
    """Sorted list of the stdlib ``*.py`` files forming the default corpus (see module doc)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDE]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def corpus_files(path: str | os.PathLike) -> list[Path]:
    """The corpus files of ``data.path`` (a ``.txt``/``.jsonl`` file, or a directory of them), sorted.

    Raises:
      ValueError: missing path, unsupported extension, or a directory without .txt/.jsonl files.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data.path={str(path)!r} does not exist; accepted: {_ACCEPTED}")
    if p.is_dir():
        files = sorted((q for q in p.rglob("*") if q.is_file() and q.suffix in _SUFFIXES),
                       key=lambda q: q.relative_to(p).as_posix())
        if not files:
            raise ValueError(f"data.path={str(path)!r} is a directory without .txt/.jsonl files; accepted: {_ACCEPTED}")
        return files
    if p.suffix not in _SUFFIXES:
        raise ValueError(f"data.path={str(path)!r} has unsupported extension {p.suffix!r}; accepted: {_ACCEPTED}")
    return [p]


def check_text_file(path: Path) -> None:
    """Raise ValueError (naming the file) unless its first 64 KiB look like text: no NUL byte and at most 30%
    of the characters undecodable as UTF-8."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\x00" in head:
        raise ValueError(f"data.path: {path} is not a text file (it contains NUL bytes); give UTF-8 text")
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if text and bad / len(text) > _MAX_UNDECODABLE:
        raise ValueError(f"data.path: {path} is not a text file ({bad} of the first {len(text)} characters are not "
                         f"UTF-8); give UTF-8 text")


@dataclass(frozen=True)
class DocRef:
    """Where one document is: a whole file (``offset == -1``) or the ``.jsonl`` line at byte ``offset``."""

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


class DocumentSource:
    """Random-access Grain data source (``__len__``, ``__getitem__``) of the documents of a corpus, as ``str``.

    Args:
      path: ``data.path`` (None: the stdlib corpus).
      text_field: ``data.text_field``, the JSON field holding a ``.jsonl`` document.

    Raises:
      ValueError: see the module docstring (each message names ``data.path`` and the file / line).
    """

    def __init__(self, path: str | os.PathLike | None, text_field: str = "text"):
        self.path, self.text_field = path, text_field
        files = stdlib_files() if path is None else corpus_files(path)
        refs: list[DocRef] = []
        for f in files:
            if path is not None:
                check_text_file(f)
            refs += _index_jsonl(f, text_field) if f.suffix == ".jsonl" else [DocRef(str(f))]
        if not refs or all(os.path.getsize(r.path) == 0 for r in refs):
            raise ValueError(f"data.path={str(path)!r}: the corpus is empty (no documents); accepted: {_ACCEPTED}")
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> str:
        ref = self.refs[index]
        if ref.offset < 0:
            with open(ref.path, "rb") as f:
                return f.read().decode("utf-8", errors="replace")
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            line = f.readline().decode("utf-8", errors="replace")
        return _jsonl_text(ref.path, ref.lineno, line, self.text_field)

    def __repr__(self) -> str:
        return f"DocumentSource(path={self.path!r}, documents={len(self)})"
