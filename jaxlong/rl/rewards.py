"""GRPO's rewards, called as TRL's `GRPOTrainer` calls a reward function (trl v1.9.0, `_calculate_rewards`):
`fn(prompts=..., completions=..., completion_ids=..., **columns)` with one entry per completion in each list, the
dataset's other columns passed by name, returning a list of floats with `None` for a completion it cannot score.

A prompt or a completion is text, or (conversational data) a list of messages `{"role", "content"}`; the shipped
rewards read a conversational completion's last message's content.

Shipped rewards (`REWARDS`, named in `grpo.reward_funcs`):

* `string_match_all`: RULER's metric for its retrieval, multi-hop tracing and aggregation tasks (Hsieh et al.,
  arXiv 2404.06654, its `string_match_all`): the share of the `refs` column's items found in the completion,
  case-insensitive, after RULER's post-processing;
* `string_match_part`: RULER's metric for its QA tasks (`string_match_part`): 1 if any of `refs` is found;
* `think_format`: 1 if the completion is its reasoning in one `<think>...</think>` block followed by its answer,
  else 0 (TRL's `think_format_reward`).

A user's reward is `module:function` (an importable module, or a `.py` file path before the colon).
`score_completions` calls every reward and checks what it returns, naming the reward in one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import traceback
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jaxlong.evaluation.ruler.prompts import postprocess
from jaxlong.evaluation.ruler.prompts import string_match_all as _match_all

__all__ = ["REWARDS", "NEEDS_COLUMNS", "string_match_all", "string_match_part", "think_format", "load_reward", "score_completions",
           "completion_text"]


def completion_text(completion) -> str:
    """The text of a completion: itself, or a conversational completion's last message's content."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


def _refs(refs, n: int) -> list:
    if refs is None or len(refs) != n:
        raise ValueError(f"needs a refs column with one list of reference strings per completion ({n}); got "
                         f"{'none' if refs is None else len(refs)}")
    return [[r] if isinstance(r, str) else list(r) for r in refs]


def string_match_all(prompts=None, completions=(), refs=None, **kwargs) -> list[float]:
    """RULER's `string_match_all` of each completion against its `refs` (module docstring), in [0, 1]."""
    return [_match_all(completion_text(c), r) for c, r in zip(completions, _refs(refs, len(completions)))]


def string_match_part(prompts=None, completions=(), refs=None, **kwargs) -> list[float]:
    """RULER's `string_match_part` of each completion: 1.0 if any of its `refs` is in it (case-insensitive)."""
    preds = [postprocess(completion_text(c)).lower() for c in completions]
    return [float(any(x.lower() in p for x in r)) for p, r in zip(preds, _refs(refs, len(completions)))]


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format(prompts=None, completions=(), **kwargs) -> list[float]:
    """1.0 where the completion opens with one `<think>...</think>` block (and no second `<think>`), else 0.0."""
    return [1.0 if _THINK.match(completion_text(c)) else 0.0 for c in completions]


NEEDS_COLUMNS = {"string_match_all": ("refs",), "string_match_part": ("refs",)}  # what a shipped reward reads

REWARDS: dict[str, Callable] = {"string_match_all": string_match_all, "string_match_part": string_match_part,
                                "think_format": think_format}


def load_reward(spec: str) -> Callable:
    """A reward function by name: one of `REWARDS`, or `module:function` (`module` importable, or a `.py` path).

    Raises:
      ValueError: naming `spec`: not shipped and not `module:function`, the module or function missing, or not
        callable."""
    if spec in REWARDS:
        return REWARDS[spec]
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"grpo.reward_funcs: {spec!r} is neither a shipped reward ({', '.join(REWARDS)}) nor "
                         f"module:function")
    try:
        if module.endswith(".py"):
            path = Path(module)
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or not path.is_file():
                raise FileNotFoundError(module)
            mod = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except FileNotFoundError:
        raise ValueError(f"grpo.reward_funcs: {spec!r}: no such file {module!r}") from None
    except ImportError as e:
        raise ValueError(f"grpo.reward_funcs: {spec!r}: cannot import {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"grpo.reward_funcs: {spec!r}: {module!r} has no function {name!r}")
    return fn


def score_completions(funcs: Sequence[tuple[str, Callable]], prompts: list, completions: list,
                      completion_ids: list, columns: dict[str, list] | None = None) -> np.ndarray:
    """Every reward of every completion, float64 `[completions, rewards]`, NaN where a reward returned None.

    Args:
      funcs: `(name, function)` pairs (`load_reward`).
      prompts, completions, completion_ids: one entry per completion (a prompt repeated for each of its group's).
      columns: the dataset's other columns, one entry per completion, passed to each reward by name.

    Raises:
      ValueError: naming the reward: it raised, returned something not a list of one value per completion, or a
        value that is neither a number nor None."""
    n = len(completions)
    out = np.full((n, len(funcs)), np.nan)
    for j, (name, fn) in enumerate(funcs):
        try:
            got = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **(columns or {}))
        except Exception as e:  # a user's function: name it, what it raised and where
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise ValueError(f"reward {name!r} raised {type(e).__name__}: {e} (at {frame.filename}:{frame.lineno}, "
                             f"in {frame.name})") from e
        if not isinstance(got, (list, tuple, np.ndarray)) or len(got) != n:
            size = len(got) if hasattr(got, "__len__") else type(got).__name__
            raise ValueError(f"reward {name!r} returned {size} values for {n} completions; it must return a list of "
                             f"one float (or None) per completion")
        for i, x in enumerate(got):
            if x is None:
                continue
            if not isinstance(x, (bool, np.bool_, int, float, np.floating, np.integer)):  # True counts 1.0, as in TRL
                raise ValueError(f"reward {name!r} returned {x!r} for completion {i}; give a float, or None where it "
                                 f"cannot score")
            out[i, j] = float(x)
    return out
