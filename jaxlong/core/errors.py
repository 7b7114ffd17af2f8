"""The error every layer raises for a bad option (which option, what value, what would work), and the one form in
which every command (`python -m jaxlong.train`, `.eval`, `.memory`, `.export`) reports an error: one line on
stderr, `error: <message>`, exit code 2 for bad input (`BAD_INPUT`: options, files, checkpoints, refused before
anything compiles), 1 for a failure while running (`FAILED`: a checkpoint that could not be written) and 3 for a
recipe stopped by a stage's gate (`GATE_FAILED`, `jaxlong.training.gates`)."""

from __future__ import annotations

import argparse
import sys

BAD_INPUT = 2
FAILED = 1
GATE_FAILED = 3


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or the combination of values is impossible."""


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
