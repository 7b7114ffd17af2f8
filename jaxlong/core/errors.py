"""The error every layer raises for a bad option (which option, what value, what would work), and the one form in
which every command (`python -m jaxlong.train`, `.eval`, `.memory`, `.export`) reports an error: one line on
stderr, `error: <message>`, exit code 2 for bad input (`BAD_INPUT`: options, files, checkpoints, refused before
anything compiles), 1 for a failure while running (`FAILED`: a checkpoint that could not be written) and 3 for a
recipe stopped by a stage's gate (`GATE_FAILED`, `jaxlong.recipes.gates`)."""

from __future__ import annotations

import argparse
import typing
import sys

BAD_INPUT = 2
FAILED = 1
GATE_FAILED = 3


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or the combination of values is impossible.

    `str(error)` is the one-line message. The fields say the same for code that acts on the error instead of
    reading it (`jaxlong.core.suggest`, tests):

    Attributes:
      key: the option the broken rule is about (`seq_len`, `attention.block_q`, a flag such as `--lengths`), or
        None.
      value: that option's value.
      keys: the other options the rule involves, each of which could also satisfy it (`("mesh.context",)`).
      suggestions: settings that fix it, each a dict `{option: value}` to apply together (one entry: a single
        option changed); each passes the whole validation with the rest of the config unchanged.
      errors: the errors a joined one stands for (a recipe's stages, each keyed `stages[i].KEY`), else ().
    """

    def __init__(self, message: str, *, key: str | None = None, value=None, keys: tuple[str, ...] = (),
                 suggestions: tuple[dict, ...] = (), errors: tuple[ConfigError, ...] = ()):
        super().__init__(message)
        self.key, self.value, self.keys = key, value, tuple(keys)
        self.suggestions, self.errors = tuple(suggestions), tuple(errors)


def fail(error: BaseException | str, code: int = BAD_INPUT) -> int:
    """Print `error: <error>` on stderr, the one form of every command's errors, and return `code` (the command's
    exit status)."""
    print(f"error: {error}", file=sys.stderr)
    return code


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors (an unknown flag, a missing argument, a value of the wrong
    type) take the commands' one form: `error: <what>; see <prog> --help`, one line, exit code 2."""

    def error(self, message: str):
        self.exit(BAD_INPUT, f"error: {message}; see {self.prog} --help\n")


def check_choice(key: str, value, tp) -> None:
    """Refuse a value of option `key` outside the closed set `tp` (a `typing.Literal`; a dataclass field can be set
    past the loader's type check).

    Raises:
      ConfigError: `key=value is not allowed; choose one of: ...`.
    """
    allowed = typing.get_args(tp)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
