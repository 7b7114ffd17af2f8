"""The XLA flags of a test run (set by tests/conftest.py before jax is imported, and given to the child processes
the tests start). Imports nothing heavy, so that conftest can read it first. Measured in docs/testing.md.

`DEVICES` simulates 8 CPU devices in the test processes. `COMPILE_SPEED` makes XLA:CPU compile faster: one LLVM
module per program rather than a split for parallel codegen, and the elemental IR emitters rather than the MLIR
fusion emitters, which fuse differently: buffer sizes change (a ratio between two programs holds; one U-Pipe
layer's temporaries against the memory model's figure do not) and some fusions become loops. The tests that
compare a program's buffers or HLO with a model compile with XLA's defaults (`DEFAULT_EMITTERS`).

`LITTLE_OPTIMIZATION` (JAX's `jax_disable_most_optimizations`: LLVM at level 0, its expensive passes off) is set
in the test processes and inherited by the trainers and multi-process runs they start: the suite's programs are
tiny, so compiling them costs far more than running them, and no HLO pass changes. A real model's programs run
3 times slower so (a 4K-token forward of the 135M model: 55 s against 18 s on one core), so its tests compile
fully optimized (conftest's `optimized` fixture), as do the docs' commands, which run as a user runs them.
"""

DEVICES = "--xla_force_host_platform_device_count=8"
COMPILE_SPEED = ("--xla_cpu_parallel_codegen_split_count=1", "--xla_cpu_use_fusion_emitters=false")
LITTLE_OPTIMIZATION = "JAX_DISABLE_MOST_OPTIMIZATIONS"  # an environment variable, "1" in a test run
# 8 simulated devices share 2 cores: under load one device's thread can reach a collective long after the others,
# and XLA:CPU aborts the process when one waits a minute (a warning after 20 s, the abort 40 s later,
# `--xla_cpu_collective_call_terminate_timeout_seconds`; seen with the real model's train step). A test run waits
# up to 15 minutes instead (the commands themselves ask for an hour: jaxlong.core.distributed).
PATIENT_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=900",)
# XLA's default fusion emitters, for the programs whose HLO or buffer sizes a test compares with a model
# (conftest's `default_emitters` fixture passes it to every compile of the test).
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def with_flags(existing: str, flags) -> str:
    """`existing` XLA_FLAGS with each of `flags` added unless a value for that flag is already there."""
    out = existing
    for flag in flags:
        if flag.split("=")[0] not in out:
            out += " " + flag
    return out.strip()


def for_children(existing: str = "") -> str:
    """XLA_FLAGS for a child process that sets its own device count (a trainer, a docs command, one process of a
    multi-process launch): `COMPILE_SPEED` and `PATIENT_COLLECTIVES`, added to `existing` less any device count."""
    kept = " ".join(f for f in existing.split() if not f.startswith("--xla_force_host_platform_device_count"))
    return with_flags(kept, (*COMPILE_SPEED, *PATIENT_COLLECTIVES))


def user_env(environ: dict, root: str) -> dict:
    """The environment of a command a test runs as a user types it (a docs command, the real model's trainer and
    evaluation): `environ` less `LITTLE_OPTIMIZATION` (fully optimized, as a user compiles), `JAX_PLATFORMS=cpu`,
    the checkout `root` importable, XLA_FLAGS `for_children` (each command sets its own device count); the
    compilation cache (`JAX_COMPILATION_CACHE_DIR`) is kept."""
    env = {k: v for k, v in environ.items() if k != LITTLE_OPTIMIZATION}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=root, XLA_FLAGS=for_children(environ.get("XLA_FLAGS", "")))
    return env
