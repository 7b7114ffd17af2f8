"""The tokenizer of a Hugging Face checkpoint (`tokenizer.json`, read with the `tokenizers` library), in the
`jaxlong.data.Tokenizer` interface, for runs started with `model.from_hf`. numpy only (no jax)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class HFTokenizer:
    """`tokenizer.json` of a checkpoint directory. `encode(str) -> int32 [n]` adds no special tokens (packing
    appends `eod_id` after each document); `eod_id` is config.json's `eos_token_id` (the first if a list), else
    the tokenizer's `</s>`/`<|endoftext|>`/`<|end_of_text|>` token.

    Raises:
      FileNotFoundError: no tokenizer.json in the directory.
      ValueError: no end-of-document token can be found.
    """

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer  # noqa: PLC0415

        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model.from_hf={str(directory)!r}: no tokenizer.json in that directory")
        self._tok = Tokenizer.from_file(str(path))
        self.name = f"hf:{self.directory.resolve()}"
        eos = None
        cfg = self.directory / "config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text()).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
        if eos is None:
            for t in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"):
                eos = self._tok.token_to_id(t)
                if eos is not None:
                    break
        if eos is None:
            raise ValueError(f"model.from_hf={str(directory)!r}: no eos_token_id in config.json and no known "
                             f"end-of-text token in tokenizer.json")
        self._eod = int(eos)

    @property
    def vocab_size(self) -> int:
        return max(self._tok.get_vocab_size(with_added_tokens=True), self._eod + 1)

    @property
    def eod_id(self) -> int:
        return self._eod

    name = "hf"
    bos_id = None  # the data pipeline's interface (`jaxlong.data.Tokenizer`): documents end with eos_id only

    @property
    def eos_id(self) -> int:
        return self._eod

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])
