"""What a run keeps from where it was imported, so that its run directory stands alone (docs/hf-models.md).

A run that starts from a Hugging Face checkpoint (`model.from_hf=DIR`) or tokenizes with a Hugging Face
tokenizer (`data.tokenizer=PATH/tokenizer.json`) copies, when it first starts, the files that describe its
tokenizer, chat template and generation settings into `RUN_DIR/imported/` (`FILES`: those the import directory
has). The weights are not copied: from the first checkpoint on they are in the run's checkpoints. The sha256 of
every copied file is recorded in the config saved with each checkpoint (the `imported` key), so a copy changed
after training is refused rather than silently used.

One resolver, `run_tokenizer`, serves training, evaluation, export and every probe: the run's copy, then
`model.from_hf`, then `data.tokenizer`. `config_source` does the same for the model's `config.json`, so that
`--resume`, a recipe's next stage, evaluation and export all work once the import directory is gone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from jaxlong.data.chat import RUN_TEMPLATE
from jaxlong.data.tokenizer import HFTokenizer, Tokenizer, get_tokenizer

__all__ = ["IMPORTED", "FILES", "import_source", "run_directory", "keep_imported", "check_copy", "run_tokenizer",
           "config_source", "tokenizer_source", "RUN_TEMPLATE", "keep_chat_template"]

IMPORTED = "imported"  # RUN_DIR/imported/
# Copied when the import directory has them. config.json holds the model's shape and its token ids (bos, eos,
# pad); chat_template.jinja is where transformers 5 writes a chat template (older ones keep it in
# tokenizer_config.json, which is copied too).
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "generation_config.json", "config.json")


def run_directory(cfg) -> Path:
    """`RUN_DIR` of a config: `run_dir / run_name`."""
    return Path(cfg.run_dir) / cfg.run_name


def import_source(cfg) -> tuple[Path, Path, str] | None:
    """Where the run imports its tokenizer from, as (directory, tokenizer file, option): `model.from_hf`'s
    directory, else the directory of `data.tokenizer`'s `tokenizer.json`; None for the byte tokenizer."""
    if cfg.model.from_hf:
        d = Path(cfg.model.from_hf)
        return d, d / "tokenizer.json", "model.from_hf"
    if str(cfg.data.tokenizer).endswith(".json"):
        f = Path(cfg.data.tokenizer)
        return f.parent, f, "data.tokenizer"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_copy(copy: Path, recorded: dict[str, str], where: str = "") -> None:
    """Refuse a run's copy (`RUN_DIR/imported/`) whose files differ from the sha256 `recorded` in the config saved
    with its checkpoint (`{}`: nothing recorded, a run from before copies were kept, nothing to check).

    Raises:
      ValueError: one line naming the file, the recorded and the present digest, and what would work.
    """
    for name, digest in sorted(recorded.items()):
        f = copy / name
        now = _sha256(f) if f.is_file() else None
        if now != digest:
            state = "is missing" if now is None else f"has sha256 {now[:12]}"
            raise ValueError(f"{f} {state}, but the run{where} recorded sha256 {digest[:12]} for it: the run's copy "
                             f"of the files it was imported with changed after training; put the original {name} "
                             f"back (from the directory it was imported from), or train a new run_name")


def keep_imported(cfg, run_dir: Path, *, recorded: dict[str, str] | None, write: bool, say=print) -> dict[str, str]:
    """Keep the run's copy of its import directory's files in `RUN_DIR/imported/`; returns the sha256 of each
    copied file (`{}` for the byte tokenizer), which the trainer records in the config it saves.

    Args:
      cfg: the run's `Config`. run_dir: `RUN_DIR`.
      recorded: the digests saved with the checkpoint the run resumes (None: a fresh start; `{}`: a checkpoint of
        a run from before copies were kept). A fresh start copies afresh; a resume checks the copy against
        `recorded` (`check_copy`), and a resumed older run gets its copy now, from the import directory.
      write: whether this process writes (process 0); the others only compute the digests. The copy appears
        whole or not at all (written aside, then renamed).

    Raises:
      ValueError: the copy changed since it was recorded (`check_copy`), or an older run's import directory is
        gone (the message names the override that works).
    """
    source = import_source(cfg)
    if source is None:
        return {}
    directory, tokenizer_file, option = source
    copy = run_dir / IMPORTED
    if recorded is not None and (copy / "tokenizer.json").is_file():  # a resume: the copy is the run's
        check_copy(copy, recorded)
        if tokenizer_file.is_file() and _sha256(tokenizer_file) != _sha256(copy / "tokenizer.json"):
            say(f"note: {tokenizer_file} ({option}) differs from the run's copy {copy / 'tokenizer.json'}; the run "
                f"keeps its copy (a new run_name takes the new tokenizer)")
        return {name: _sha256(copy / name) for name in FILES if (copy / name).is_file()}
    if not tokenizer_file.is_file():
        raise ValueError(_gone(option, tokenizer_file, run_dir))
    files = {name: directory / name for name in FILES if (directory / name).is_file()}
    files["tokenizer.json"] = tokenizer_file  # data.tokenizer may name its file otherwise
    if write:
        tmp = run_dir / f".{IMPORTED}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, f in files.items():
            shutil.copyfile(f, tmp / name)
        shutil.rmtree(copy, ignore_errors=True)  # a fresh start's leftover (no checkpoint depends on it)
        os.rename(tmp, copy)
    return {name: _sha256(f) for name, f in sorted(files.items())}


def keep_chat_template(cfg, run_dir: Path, *, write: bool) -> None:
    """Copy `data.chat_template`, when set, to `RUN_DIR/chat_template.jinja` each time the run (or a recipe's
    stage) starts, so that `python -m jaxlong.generate RUN --chat` and `python -m jaxlong.eval RUN --chat` render
    with the template the run last trained with, wherever the file has gone since (`jaxlong.data.chat.run_template`).
    Written aside, then renamed; only by the process that writes (`write`).

    Raises:
      ValueError: `data.chat_template` names no file (the message names the option).
    """
    src = cfg.data.chat_template
    if src is None or not write:
        return
    if not Path(src).is_file():
        raise ValueError(f"data.chat_template={src!r}: no such file; give a Jinja chat template file, or null for the "
                         f"tokenizer's own")
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RUN_TEMPLATE}.tmp-{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, run_dir / RUN_TEMPLATE)


def _gone(option: str, tokenizer_file: Path, run_dir: Path, recorded: dict | None = None) -> str:
    value = tokenizer_file.parent if option == "model.from_hf" else tokenizer_file
    why = (f"its {IMPORTED}/ directory, where it kept a copy ({', '.join(sorted(recorded))}), is gone: restore it, or"
           if recorded else f"it holds no copy of the tokenizer (a run trained before run directories kept one in "
                            f"{IMPORTED}/);")
    return (f"{option}={str(value)!r}: no such file {tokenizer_file}, and in {run_dir} {why} pass {option}=NEW_PATH, "
            f"where {'that checkpoint directory' if option == 'model.from_hf' else 'that tokenizer.json'} is now")


def tokenizer_source(cfg, run_dir: str | Path | None = None) -> Path | None:
    """The directory whose tokenizer files the run uses (`run_tokenizer`'s order: the run's copy, then
    `model.from_hf`, then `data.tokenizer`'s directory); None for the byte tokenizer. What export copies.

    Raises:
      ValueError: the run imports a tokenizer that neither its copy nor the import directory has any more (the
        message names the override that works).
    """
    source = import_source(cfg)
    if source is None:
        return None
    run_dir = run_directory(cfg) if run_dir is None else Path(run_dir)
    copy = run_dir / IMPORTED
    if (copy / "tokenizer.json").is_file():
        check_copy(copy, getattr(cfg, "imported", {}) or {})
        return copy
    directory, tokenizer_file, option = source
    if not tokenizer_file.is_file():
        raise ValueError(_gone(option, tokenizer_file, run_dir, getattr(cfg, "imported", None)))
    return directory


def run_tokenizer(cfg, run_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a run, for training, evaluation, export and every probe alike: the run's copy
    (`RUN_DIR/imported/tokenizer.json`, checked against the digests in `cfg.imported`), then `model.from_hf`'s
    `tokenizer.json`, then `data.tokenizer`. `cfg` is a `jaxlong.config.Config`; `run_dir` defaults to
    `cfg.run_dir / cfg.run_name` (evaluation passes the directory it was given).

    Raises:
      ValueError: a changed copy (`check_copy`), an import directory that is gone with no copy (naming the
        override that works), or a tokenizer file that cannot be used (`HFTokenizer`, `get_tokenizer`).
    """
    directory = tokenizer_source(cfg, run_dir)
    if directory is None:
        return get_tokenizer(cfg.data.tokenizer)
    _, tokenizer_file, option = import_source(cfg)
    if directory == tokenizer_file.parent:  # the import directory itself (no copy yet)
        return HFTokenizer(tokenizer_file, option=option)
    return HFTokenizer(directory, option=None)  # the run's copy, named by its path


def config_source(cfg) -> Path:
    """The directory to read `model.from_hf`'s `config.json` from: `model.from_hf` while it has one, else the run's
    copy (`RUN_DIR/imported/config.json`, e.g. for `--resume` once the import directory is moved away), else
    `model.from_hf` (whose reading then names what is missing)."""
    d = Path(cfg.model.from_hf)
    if (d / "config.json").is_file():
        return d
    copy = run_directory(cfg) / IMPORTED
    return copy if (copy / "config.json").is_file() else d
