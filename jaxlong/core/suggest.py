"""Values that pass: the search behind every refusal's advice.

A check that refuses a config names the rule it broke (`ConfigError.key`, `.value`, `.keys`); what to use instead
is not worked out by the check, whose rule is one of many, but asked of the whole validation: candidate values are
tried, nearest first, and only those it accepts are suggested. `jaxlong.config.validate` advises a config this way
(`fixes`), and the commands their length flags (`nearest`, e.g. `jaxlong.evaluation.ruler.nearby_lengths`).

The search for a refusal, `fixes`:
  1. one option at a time, in the caller's order (the options the user set first, then the one whose rule
     broke): the nearest passing value below and above (numbers), or every passing choice (a closed set);
  2. failing that, two options together, then three: a value of an option of the rule that gets past that rule,
     then the same for the rule broken next, until nothing is refused (the rule's own option could not pass
     alone, or the config breaks other rules too).
Every suggestion is a dict of settings that passes as a whole; the search is bounded (`budget` refusals tried).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Sequence

from jaxlong.core.errors import ConfigError

__all__ = ["sides", "nearest", "fixes", "advice"]

# settings {option: value} -> the first rule the config breaks with them applied, or None when it passes
Refusal = Callable[[dict], "ConfigError | None"]
# (option, settings applied first) -> its candidate values, in sides each tried nearest first; () for none
Candidates = Callable[[str, dict], Sequence[Iterable]]


def sides(value: int, *, step: int = 1, lo: int = 1, hi: int | None = None) -> tuple[range, range]:
    """The integers near `value` that a search tries: the multiples of `step` in `[lo, hi]` below `value`
    (descending) and above it (ascending; `hi` None: unbounded, cut by the search's own limit)."""
    step = max(int(step), 1)
    first_up = max(value // step * step + step, -(-lo // step) * step)
    top = hi // step * step if hi is not None else first_up + step * 10**9
    return range((value - 1) // step * step, lo - 1, -step), range(first_up, top + 1, step)


def nearest(passes: Callable[[int], bool], value: int, *, step: int = 1, lo: int = 1, hi: int | None = None,
            tries: int = 512) -> list[int]:
    """The nearest integer below `value` and the nearest above it for which `passes` holds: at most one each,
    the lower first, among the multiples of `step` in `[lo, hi]`, `tries` of them each way (`sides`)."""
    found = [next((v for v in itertools.islice(side, tries) if passes(v)), None)
             for side in sides(value, step=step, lo=lo, hi=hi)]
    return [v for v in found if v is not None]


class _Search:
    """The refusals tried so far, within `budget`."""

    def __init__(self, refusal: Refusal, candidates: Candidates, budget: int, tries: int):
        self.refusal, self.candidates, self.left, self.tries = refusal, candidates, budget, tries

    def refuse(self, settings: dict) -> ConfigError | None | bool:
        """The refusal of `settings`; False once the budget is spent."""
        if self.left <= 0:
            return False
        self.left -= 1
        return self.refusal(settings)

    def single(self, key: str, base: dict, tries: int) -> list[dict]:
        """`base` with `key` set to its first passing value on each side of its candidates."""
        out = []
        for side in self.candidates(key, base):
            for v in itertools.islice(side, tries):
                got = self.refuse({**base, key: v})
                if got is False:
                    return out
                if got is None:
                    out.append({**base, key: v})
                    break
        return out

    def chain(self, error: ConfigError, base: dict, depth: int, order: Callable[[ConfigError], list[str]],
              out: list[dict], limit: int, width: int = 8) -> bool:
        """Append to `out` settings of `depth` more options than `base` under which nothing is refused: a value of
        an option of the refusal `error` (in `order`) that gets past its rule (`width` tried per side), then the
        same for the next refusal. True when one was found."""
        if depth == 1:
            found = next((f[0] for key in order(error) if key not in base
                          for f in [self.single(key, base, self.tries // 4)] if f), None)
            if found is not None and found not in out:
                out.append(found)
            return found is not None
        rank = {k: i for i, k in enumerate((error.key, *error.keys))}
        for key in (k for k in order(error) if k not in base):
            for side in self.candidates(key, base):
                tried = 0
                for v in itertools.islice(side, self.tries):
                    if len(out) >= limit:
                        return True
                    nxt = self.refuse({**base, key: v})
                    if nxt is False:
                        return bool(out)
                    if nxt is None or (nxt.key, nxt.keys) == (error.key, error.keys):
                        continue  # passing alone is found by a shorter chain; the same rule again is no progress
                    n = len(out)
                    if self.chain(nxt, {**base, key: v}, depth - 1, order, out, limit, width):
                        out[n:] = [dict(sorted(f.items(), key=lambda kv: rank.get(kv[0], len(rank))))
                                   for f in out[n:]]
                        break
                    tried += 1
                    if tried >= width:
                        break
        return len(out) > 0


def fixes(error: ConfigError, refusal: Refusal, candidates: Candidates, order: Callable[[ConfigError], list[str]],
          *, limit: int = 2, depth: int = 3, budget: int = 2500, tries: int = 512) -> tuple[dict, ...]:
    """Settings that fix the refusal `error`, each a dict `{option: value}` under which `refusal` finds nothing.

    Args:
      error: the first rule the config breaks (`refusal({})` would return it).
      refusal: settings -> the first rule broken with them applied, or None.
      candidates: (option, settings applied first) -> candidate values in sides, each nearest first (`sides`);
        () for an option that is not to be suggested (e.g. the device count, which is the hardware's).
      order: a refusal -> its options to try, in turn; the first with a passing value alone is the advice.
      limit: at most this many settings of several options; depth: of at most this many options;
      budget: at most this many refusals tried in all; tries: candidates tried per side of one option.

    Returns:
      The first option's nearest passing values (one dict each, below then above, or its passing choices); else
      up to `limit` settings of the fewest options (2, then up to `depth`) that pass together, each option's value
      getting past one rule and the next option's the rule broken next; else ().
    """
    search = _Search(refusal, candidates, budget, tries)
    for key in order(error):
        found = search.single(key, {}, tries)
        if found:
            return tuple(found)
    out: list[dict] = []
    for d in range(2, depth + 1):
        if search.chain(error, {}, d, order, out, limit):
            return tuple(out)
    return ()


def _text(value: Any) -> str:
    return str(value).replace("'", "") if isinstance(value, list) else str(value)


def _setting(key: str, value: Any) -> str:
    return f"{key} {_text(value)}" if key.startswith("--") else f"{key}={_text(value)}"


def _either(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def advice(suggestions: Sequence[dict]) -> str:
    """The suggestions of `fixes` as a clause of a one-line message: `use seq_len=4096 or 4352`; `no single
    option fixes it: change mesh.context=2 and global_batch=3 together, or mesh.context=1 and global_batch=6`;
    "" for none."""
    if not suggestions:
        return ""
    keys = {k for s in suggestions for k in s}
    if all(len(s) == 1 for s in suggestions) and len(keys) == 1:
        (key,) = keys
        return f"use {_setting(key, _either([_text(s[key]) for s in suggestions]))}"
    together = [" and ".join(_setting(k, v) for k, v in s.items()) for s in suggestions]
    return f"no single option fixes it: change {together[0]} together" + "".join(f", or {t}" for t in together[1:])
