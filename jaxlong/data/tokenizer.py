"""Tokenizers: the byte-level default and Hugging Face `tokenizer.json` files (the `tokenizers` library).

`data.tokenizer=byte` (default): id = UTF-8 byte value, plus one special id 256 that ends a document and
also starts the next one (BOS = EOS = 256, like GPT-2's `<|endoftext|>`); vocabulary 257.

`data.tokenizer=/path/to/tokenizer.json`: loaded with `tokenizers.Tokenizer.from_file`. BOS and EOS come
from the tokenizer's own files: `bos_token` / `eos_token` of `tokenizer_config.json` (or
`special_tokens_map.json`) in the same directory, else the first of the usual names (`<|begin_of_text|>`,
`<s>`, ...; `<|end_of_text|>`, `<|endoftext|>`, `</s>`, ...) among the tokenizer's added tokens. A
tokenizer without an EOS token is refused (documents must end with one); BOS is optional. Text is encoded
without the tokenizer's post-processor (`add_special_tokens=False`): the pipeline adds BOS and EOS itself,
exactly once per document.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxlong.core.errors import ConfigError

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "get_tokenizer", "TOKENIZERS", "stop_ids", "special_tokens"]

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|im_end|>")


class Tokenizer(Protocol):
    """What the pipeline needs of a tokenizer.

    Attributes:
      name: `data.tokenizer` as given (part of cache keys and messages).
      vocab_size: number of ids; every id is in `[0, vocab_size)`.
      bos_id: id put before every document, or None.
      eos_id: id put after every document.
    """

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...

    def encode_prompt(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: id = UTF-8 byte value (0..255); 256 ends (and starts) a document; vocab 257.

    `encode(str) -> int32 [n_bytes]` (no BOS/EOS); `decode(ids)` drops ids outside 0..255 and decodes with
    `errors='replace'`, so decoding any slice (e.g. one cutting a multi-byte character) never raises.
    """

    name = "byte"
    vocab_size = 257
    eos_id = 256
    bos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """`encode(text)` and each byte's `[start, end)` character span in `text`, int64 `[n, 2]`."""
        per_char = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
        char = np.repeat(np.arange(len(text), dtype=np.int64), per_char)
        return self.encode(text), np.stack([char, char + 1], axis=1).reshape(-1, 2)

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt as the documents it was trained on begin: the document token (256), then the bytes."""
        return np.concatenate([[self.bos_id], self.encode(text)]).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < 256)]
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(directory: Path, keys=("bos_token", "eos_token")) -> dict[str, str]:
    """The special tokens `keys` named in a tokenizer directory's tokenizer_config.json, else in its
    special_tokens_map.json (ValueError: one of them is not JSON)."""
    found: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = directory / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"data.tokenizer: {f} cannot be read as JSON ({e})") from e
        for key in keys:
            content = _token_content(cfg.get(key))
            if content is not None:
                found.setdefault(key, content)
    return found


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (see the module docstring for BOS/EOS), given as the file or as the
    checkpoint directory holding it (`model.from_hf=DIR`). In a checkpoint directory, `config.json`'s
    `eos_token_id` (the first if a list) is the EOS when the tokenizer's config files name none.

    Args:
      path: `tokenizer.json` or a directory containing it.
      option: the config key the path came from, used in error messages.

    Raises:
      ValueError: the file is missing or cannot be parsed, a special token named in the config files is not in
        the vocabulary, or no EOS token is found (each message names the option and the file).
    """

    def __init__(self, path: str | Path, option: str | None = "data.tokenizer"):
        from tokenizers import Tokenizer as _HF  # noqa: PLC0415 (only needed for this tokenizer)

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        where = f"{option}={str(path)!r}" if option else str(path)
        if not p.is_file():
            advice = ("give the Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"
                      if option == "model.from_hf" else
                      "give 'byte' or the path of a Hugging Face tokenizer.json (or its checkpoint directory)")
            raise ValueError(f"{where}: no such file {p}; {advice}")
        try:
            self._tok = _HF.from_file(str(p))
        except Exception as e:  # noqa: BLE001 (the library raises a bare Exception on bad files)
            raise ValueError(f"{where} cannot be read as a Hugging Face tokenizer.json ({e})") from e
        self.name = str(path)
        special = special_tokens(p.parent)
        self.bos_id = self._find(special.get("bos_token"), _BOS_NAMES, p)
        self.eos_id = self._find(special.get("eos_token"), (), p)
        if self.eos_id is None:
            self.eos_id = _config_eos(p.parent)
        if self.eos_id is None:
            self.eos_id = self._find(None, _EOS_NAMES, p)
        if self.eos_id is None:
            raise ValueError(f"{where} has no EOS token: add 'eos_token' to "
                             f"{p.parent / 'tokenizer_config.json'} (or one of {list(_EOS_NAMES)} to the tokenizer)")
        self.vocab_size = max(int(self._tok.get_vocab_size(with_added_tokens=True)), self.eos_id + 1)

    def _find(self, named: str | None, usual: tuple[str, ...], path: Path) -> int | None:
        if named is not None:
            i = self._tok.token_to_id(named)
            if i is None:
                raise ValueError(f"tokenizer {str(path)!r}: special token {named!r} from the tokenizer's config "
                                 f"files is not in its vocabulary")
            return int(i)
        return next((int(i) for i in map(self._tok.token_to_id, usual) if i is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """`encode(text)` and each token's `[start, end)` character span in `text`, int64 `[n, 2]` (a rendered chat
        template, tokenized whole as transformers tokenizes it, its assistant tokens found by their spans)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

    def encode_prompt(self, text: str) -> np.ndarray:
        """A plain prompt as transformers tokenizes it: with the tokenizer's own post-processor (`tokenizer.json`),
        which adds BOS where the checkpoint's tokenizer does (Llama-3) and nothing where it does not."""
        return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


def _config_eos(directory: Path) -> int | None:
    """`eos_token_id` of a checkpoint's `config.json` (the first if a list), or None."""
    f = directory / "config.json"
    if not f.is_file():
        return None
    try:
        eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return int(eos) if isinstance(eos, int) else None


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """`data.tokenizer`: `'byte'`, or the path of a Hugging Face `tokenizer.json`.

    Raises:
      ValueError: an unknown name, or a tokenizer file that cannot be used (see `HFTokenizer`).
    """
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    if str(name).endswith(".json"):
        return HFTokenizer(name)
    raise ValueError(f"data.tokenizer={name!r} is not supported; give one of {sorted(TOKENIZERS)} or the path of a "
                     f"Hugging Face tokenizer.json")


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raise ConfigError (a ValueError) when the tokenizer has more ids than `model.vocab_size` (checked before
    compiling)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of data.tokenizer="
                         f"{tokenizer.name!r} ({tokenizer.vocab_size} ids); use model.vocab_size >= "
                         f"{tokenizer.vocab_size}")


def stop_ids(tokenizer, directory=None) -> list[int]:
    """The token ids that end generation: the tokenizer's EOS and, where the tokenizer's directory `directory` has
    a `generation_config.json`, its `eos_token_id` (an id or a list: Llama-3.1-Instruct's holds its end-of-turn
    token)."""
    eos = {int(tokenizer.eos_id)}
    gen = Path(directory) / "generation_config.json" if directory is not None else None
    if gen is not None and gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        eos |= set(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return sorted(eos)
