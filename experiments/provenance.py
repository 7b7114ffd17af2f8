"""Where a result came from, for the header of every file under `experiments/results/`: the machine and the commit."""

from __future__ import annotations

import os
import platform
import subprocess


def machine() -> str:
    """This machine's CPU count and model, OS, Python version (the measurements and compiles run on the CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{os.cpu_count()} x {model}, {platform.system()}, Python {platform.python_version()}"


def commit() -> str:
    """The checkout's short commit hash, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
