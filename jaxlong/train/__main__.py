"""Command line trainer: `python -m jaxlong.train [--config FILE] [--resume | --resume-with-changes] [--profile]
[key=value ...]`.

With no arguments it trains the default tiny Llama on the Python standard library's source over 8 devices
(simulated on the CPU). Examples:

    python -m jaxlong.train
    python -m jaxlong.train steps=100 seq_len=16384 mesh.context=8 model.heads=8
    python -m jaxlong.train --config configs/llama3_1_8b.yaml seq_len=1048576 mesh.context=8
    python -m jaxlong.train --resume            # continue runs/<run_name> from its latest checkpoint
    python -m jaxlong.train --resume-with-changes optim.lr=1e-3   # resume although the config changed
    python -m jaxlong.train --fit --config configs/llama3_1_8b.yaml seq_len=131072   # fastest setup that fits
    python -m jaxlong.train --config configs/recipes/tiny_extension.yaml   # a recipe: its stages in order

The config is validated before any device exists; on the CPU, `mesh.num_devices` simulated devices are created
(`--xla_force_host_platform_device_count`), which must happen before jax creates its backend.

Launched as several processes (`srun`, `mpirun`, or by hand with `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; see `jaxlong.core.distributed`), it calls `jax.distributed.initialize()`
first and the mesh spans the devices of all processes (on the CPU each process simulates
`mesh.num_devices / processes` of them).
"""

from __future__ import annotations

import argparse
import signal
import sys

from jaxlong.config import ConfigError, load_config
from jaxlong.core import distributed
from jaxlong.core.errors import FAILED, ArgumentParser, fail


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m jaxlong.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="YAML config (default: built-in defaults = configs/default.yaml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run's latest checkpoint; the config must equal the checkpoint's "
                             "except mesh/remat/tiling/attention, logging, checkpointing and steps")
    parser.add_argument("--resume-with-changes", action="store_true",
                        help="--resume even where the config changes the model, data stream or schedule")
    parser.add_argument("--profile", action="store_true", help="trace a few steps with jax.profiler into the run dir")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. mesh.context=8 seq_len=16384")
    from jaxlong.plan import fit_report as fit_cli  # noqa: PLC0415

    fit_cli.add_arguments(parser, planner_options=True)
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stages = None
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.stages:  # a recipe: one validated config per stage, before anything starts
            from jaxlong.recipes import expand  # noqa: PLC0415

            if args.fit:
                raise ConfigError(f"--fit with a recipe: plan its stages with python -m jaxlong.memory --fit --config "
                                  f"{args.config} --write-recipe PLANNED.yaml (add --target h100 to plan for "
                                  f"GPUs), then train python -m jaxlong.train --config PLANNED.yaml")
            stages = expand(cfg, args.overrides)
            cfg = stages[0].cfg
    except ConfigError as e:
        return fail(e)
    try:
        if args.fit:  # search the fastest configuration that fits, then train with it
            from jaxlong.plan import fit_report as fit_cli  # noqa: PLC0415

            if distributed.process_count_from_env() > 1:
                raise ConfigError("--fit runs in one process; run python -m jaxlong.memory --fit first and launch "
                                  "with the overrides it prints")
            cfg = fit_cli.fit_for_training(args, cfg, args.overrides)
        distributed.start(cfg.mesh, cfg.lost_process_timeout_s)
    except (ConfigError, ValueError) as e:
        return fail(e)
    from jaxlong.recipes import run_recipe, train  # noqa: PLC0415 (start-up: the trainer loads after parsing)
    from jaxlong.recipes.gates import GateFailed  # noqa: PLC0415
    from jaxlong.training.checkpoint import CheckpointError  # noqa: PLC0415

    from jaxlong.core import liveness  # noqa: PLC0415

    resume = args.resume or args.resume_with_changes
    try:
        if stages:  # each stage with the validation hooks, and its gate
            run_recipe(stages, resume=resume, profile=args.profile)
        else:  # the trainer with the validation hooks (held-out loss, RULER)
            train(cfg, resume=resume, profile=args.profile, allow_changes=args.resume_with_changes)
    except (FileNotFoundError, ValueError) as e:  # a bad option, a corpus that cannot be read, nothing to resume
        return fail(e)
    except GateFailed as e:  # a recipe's stage missed its gate: its checkpoint is saved, the recipe stops there
        return fail(e, GateFailed.EXIT_CODE)
    except CheckpointError as e:
        liveness.explain_failure()  # a save that failed because a process was lost: that process's line
        return fail(e, FAILED)
    except KeyboardInterrupt as e:  # SIGINT/SIGTERM: 128 + the signal's number, as a shell reports it
        return 128 + getattr(e, "signum", signal.SIGINT)
    except Exception:  # e.g. gloo's "Connection reset by peer" when another process died
        liveness.explain_failure()  # a lost process: one line and exit status 4, from the watchdog
        raise
    finally:
        liveness.stop_watchdog()
    return 0


if __name__ == "__main__":
    sys.exit(main())
