"""Write `configs/data/stdlib_grpo.jsonl`: prompts for GRPO in miniature (`configs/recipes/tiny_grpo.yaml`), made
from the Python standard library's own functions (real code, nothing downloaded), in TRL's prompt-only format.

Each record's `prompt` is a function's `def` line and the first line of its docstring, as its source writes them;
its `refs` column lists the function's parameter names (at least 3 characters each, `self` and `cls` left out).
The shipped reward `string_match_all` then scores a completion by the share of the parameters its body names: a
verifiable, partial-credit reward that a small model pretrained on Python source earns sometimes, so that the
rewards of a group differ.

Run: `python experiments/make_stdlib_grpo.py`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data" / "stdlib_grpo.jsonl"
MODULES = ("json", "textwrap", "shutil", "difflib", "fnmatch", "glob", "gzip", "shlex", "tempfile", "csv",
           "calendar", "contextlib", "dataclasses", "inspect", "pprint", "warnings", "argparse", "configparser",
           "tarfile", "zipfile", "logging", "ast", "dis", "tokenize", "string", "heapq", "bisect", "statistics")


def records():
    for module in MODULES:
        mod = importlib.import_module(module)
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module:
                continue
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            try:
                params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
                source = inspect.getsource(fn).splitlines()
            except (TypeError, ValueError, OSError):
                continue
            if not doc or not 1 <= len(params) <= 4 or any(len(p) < 3 for p in params) or len(doc[0]) > 100:
                continue
            head = next((i for i, line in enumerate(source) if line.rstrip().endswith(":")), None)
            if head is None or head > 3:
                continue
            indent = " " * (len(source[0]) - len(source[0].lstrip()))
            lines = [line[len(indent):] for line in source[:head + 1]]
            prompt = "\n".join(lines) + f'\n    """{doc[0]}"""\n'
            yield {"prompt": prompt, "refs": params, "function": f"{module}.{name}"}


def main() -> None:
    out = list(records())
    random.Random(0).shuffle(out)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in out))
    print(f"{len(out)} prompts -> {OUT}")


if __name__ == "__main__":
    main()
