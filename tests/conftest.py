"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision, one persistent compilation cache.

XLA_FLAGS must be set before jax is imported anywhere, so this file does it at import time.

The two tiers (README, "Tests"): `python -m pytest` runs the fast tier (every test not marked `slow`);
`python -m pytest -m slow` runs the slow tier. Markers are registered in `pyproject.toml` (`--strict-markers`).

Compiled programs are shared through JAX's persistent compilation cache: the first conftest to be imported in a
test run (the pytest process, before pytest-xdist starts its workers) makes a temporary directory and exports it
as `JAX_COMPILATION_CACHE_DIR`, so the workers and every child process a test starts (trainer runs, the
multi-process tests) read and write the same cache; the directory is removed when that first process exits.
An explicit `JAX_COMPILATION_CACHE_DIR` is kept (and never removed).
"""
import atexit
import os
import shutil
import tempfile

# 8 simulated devices, XLA:CPU flags that compile the suite's tiny programs faster (they cost far more to compile
# than to run) and a patient collective timeout: tests/xla_flags.py says what each changes.
from xla_flags import COMPILE_SPEED, DEFAULT_EMITTERS, DEVICES, LITTLE_OPTIMIZATION, PATIENT_COLLECTIVES, \
    with_flags  # noqa: E402

_FLAGS = (DEVICES, *COMPILE_SPEED, *PATIENT_COLLECTIVES)
os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), _FLAGS)
os.environ.setdefault(LITTLE_OPTIMIZATION, "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxlong-test-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
# Cache every program, small ones too: most of the suite's programs compile in well under a second each, and
# the same ones recur across test files, workers and child processes.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from tiers import TIERS  # noqa: E402

# pytest-xdist's `--dist loadfile` with a worker that dies: the run goes on, the test reruns once (crash_retry.py).
from crash_retry import (  # noqa: E402, F401
    pytest_handlecrashitem,
    pytest_report_teststatus,
    pytest_terminal_summary,
    pytest_xdist_make_scheduler,
)

jax.config.update("jax_default_matmul_precision", "highest")

# `JAXLONG_TEST_TIMING=DIR python -m pytest ...` records where each test's time goes (tests/timing.py).
if os.environ.get("JAXLONG_TEST_TIMING"):
    pytest_plugins = ["timing"]


# The test files that take longest, started first. pytest-xdist (`--dist loadfile`) hands each worker whole files
# in collection order (`--no-loadscope-reorder`, pyproject.toml); started last, a long file leaves the other worker
# idle at the end of the run. Measured in the slow tier of a CI run (seconds on one worker, 2 cores; docs/testing.md):
# the docs' pasted commands ~590 and ~250, the real model's evaluation ~550 and RULER families ~520 (before they
# compiled fully optimized), the kill matrix ~290, the multi-process runs ~230, ~120 and ~100.
LONGEST_FIRST = (
    "test_docs.py",
    "evaluation/test_real_model_eval.py",
    "training/test_faults.py",
    "test_docs_fresh.py",
    "training/test_multinode.py",
    "layers/test_keep_attention.py",
    "training/test_multiprocess.py",
    "training/test_multinode_pairs.py",
    "plan/test_memory.py",
    "test_gpu_check_smoke.py",
    "parallel/test_ring_segments.py",
    "evaluation/test_eval.py",
    "models/test_real_model.py",
    "plan/test_plan_gpu.py",
    "parallel/test_ring.py",
    "parallel/test_packing.py",
    "training/test_train.py",
    "plan/test_fit.py",
    # then the fast tier's longest (measured with tests/timing.py), so that both workers end on short files
    "models/test_hf.py",
    "parallel/test_upipe.py",
    "training/test_recipe.py",
    "data/test_chat_data.py",
    "generation/test_generate.py",
    "layers/test_remat.py",
)
_TESTS = os.path.dirname(os.path.abspath(__file__))


def _name(item) -> str:
    return os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")


def pytest_collection_modifyitems(config, items):
    """Check that every collected file joins a tier explicitly (`tests/tiers.py`: listed, and its tests in the
    tiers it declares), then order the tests so that the files of `LONGEST_FIRST` come first (in its order), the
    rest after in the order pytest collected them.

    Raises:
      pytest.UsageError: a file that is not listed in `TIERS`, or has a test in a tier it does not declare.
    """
    found: dict[str, set[str]] = {}
    for item in items:
        found.setdefault(_name(item), set()).add("slow" if item.get_closest_marker("slow") else "fast")
    for name, tiers in sorted(found.items()):
        declared = TIERS.get(name)
        if declared is None:
            raise pytest.UsageError(f"tests/{name} joins no tier: add it to TIERS in tests/tiers.py as \"fast\", "
                                    f"\"slow\" or \"fast+slow\" (it has {' and '.join(sorted(tiers))} tests)")
        if not tiers <= set(declared.split("+")):
            raise pytest.UsageError(f"tests/{name} is declared {declared!r} in tests/tiers.py but has "
                                    f"{' and '.join(sorted(tiers - set(declared.split('+'))))} tests; declare "
                                    f"\"fast+slow\" or move them")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_name(item), len(rank)))


@pytest.fixture
def default_emitters(monkeypatch):
    """Every program the test compiles uses XLA's default CPU fusion emitters (tests/xla_flags.py): for the tests
    that compare compiled buffer sizes or HLO with a model rather than with another program."""
    real = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, **kwargs):
        return real(self, {**DEFAULT_EMITTERS, **(compiler_options or {})}, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)


@pytest.fixture(scope="module")
def optimized():
    """The programs of a module compiled fully optimized (tests/xla_flags.py: `LITTLE_OPTIMIZATION`), for the tests
    whose programs run longer than they compile (a real model)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
