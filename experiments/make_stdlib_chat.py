"""Write `configs/data/stdlib_chat.jsonl` and `configs/data/stdlib_preference.jsonl`: a small chat corpus and a
small preference corpus made from the Python standard library's own docstrings (real text, nothing downloaded), for
SFT and DPO in miniature (docs/post-training.md).

Each record is a conversation in the `messages` format: the user asks what a standard-library function does, the
assistant answers with the first paragraph of its docstring; every third conversation goes on with a second turn
(which module holds it) and every fifth starts with a system message.

Each preference pair asks the same question of another function (not one of the chat corpus's): `chosen` is its
own docstring's first paragraph, `rejected` another function's, a fluent but wrong answer. Every fourth pair is in
TRL's implicit-prompt format (the prompt inside `chosen` and `rejected`), the others give it apart.

Run: `python experiments/make_stdlib_chat.py`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data" / "stdlib_chat.jsonl"
PAIRS = OUT.with_name("stdlib_preference.jsonl")
MODULES = ("json", "os.path", "textwrap", "itertools", "functools", "collections", "re", "math", "string", "shutil",
           "heapq", "bisect", "statistics", "base64", "difflib", "fnmatch", "glob", "gzip", "html", "keyword",
           "operator", "random", "secrets", "shlex", "tempfile", "time", "unicodedata", "urllib.parse", "uuid",
           "zlib", "copy", "csv", "calendar", "colorsys", "contextlib", "dataclasses", "hashlib", "inspect", "io",
           "pprint", "typing", "warnings", "weakref")
QUESTIONS = ("What does `{name}` do?", "Explain `{name}` in a few words.", "What is `{name}` for?",
             "I found `{name}` in some code. What does it do?")


def answers():
    for module in MODULES:
        mod = importlib.import_module(module)
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or not callable(obj) or getattr(obj, "__module__", module) not in (module, None):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.split("\n\n")[0].replace("\n", " ").strip()
            if 40 <= len(first) <= 400 and not first.startswith(attr + "("):
                yield module, f"{module}.{attr}", first


def main() -> None:
    rng = random.Random(0)
    rows = list(answers())
    rng.shuffle(rows)
    with open(OUT, "w", encoding="utf-8") as f:
        for k, (module, name, text) in enumerate(rows[:240]):
            messages = [{"role": "user", "content": rng.choice(QUESTIONS).format(name=name)},
                        {"role": "assistant", "content": text}]
            if k % 5 == 0:
                messages.insert(0, {"role": "system", "content": "You are a concise Python assistant."})
            if k % 3 == 0:
                messages += [{"role": "user", "content": "Which module is it in?"},
                             {"role": "assistant", "content": f"It is in the `{module}` module."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {OUT}: {min(len(rows), 240)} conversations")
    rest = rows[240:]
    with open(PAIRS, "w", encoding="utf-8") as f:
        for k, (module, name, text) in enumerate(rest[:200]):
            wrong = rest[(k + 1 + rng.randrange(len(rest) - 1)) % len(rest)][2]
            prompt = [{"role": "user", "content": rng.choice(QUESTIONS).format(name=name)}]
            chosen, rejected = [{"role": "assistant", "content": text}], [{"role": "assistant", "content": wrong}]
            record = {"chosen": prompt + chosen, "rejected": prompt + rejected} if k % 4 == 3 else \
                {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(record) + "\n")
    print(f"wrote {PAIRS}: {min(len(rest), 200)} pairs")


if __name__ == "__main__":
    main()
