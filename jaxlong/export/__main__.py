"""Export a run's checkpoint as a Hugging Face checkpoint: `python -m jaxlong.export RUN_DIR --out DIR [--step N]`.

Reads `RUN_DIR/checkpoints/<step>` (default: the latest) with the config saved next to the state, restores
only the parameters (onto all local devices, FSDP-sharded), and writes DIR with `config.json` (Llama or Qwen3,
the trained context length as `max_position_embeddings`, the run's RoPE theta and scaling), sharded
`model-*.safetensors` + `model.safetensors.index.json`, and the run's tokenizer files (its copy in
`RUN_DIR/imported/` of what `model.from_hf` or `data.tokenizer` gave it: tokenizer, chat template, generation
config), so that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`
load it and `apply_chat_template` works. A run trained before run directories kept that copy, whose import
directory has moved, names it: `python -m jaxlong.export RUN_DIR --out DIR model.from_hf=NEW_DIR`.
See `jaxlong.models.hf.save_hf`. Errors are one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


# What export's `key=value` arguments may set: where the tokenizer files are, for a run without its copy.
EXPORT_KEYS = ("model.from_hf", "data.tokenizer")


def restore_params(run_dir: str | Path, step: int | None = None, overrides: list[str] | tuple[str, ...] = ()):
    """(step, config, params) of the checkpoint at `step` (default: latest) in `run_dir/checkpoints`, the params
    restored FSDP-sharded over all local devices; optimizer state is not read. `overrides` (`key=value`, keys in
    `EXPORT_KEYS`) are applied to the saved config.

    Raises:
      FileNotFoundError: no checkpoint (at that step) in the run directory.
      ValueError: orbax cannot read the checkpoint (one line: which checkpoint, orbax's first line).
    """
    import jax  # noqa: PLC0415
    import orbax.checkpoint as ocp  # noqa: PLC0415

    from jaxlong.config import Config, MeshConfig, apply_setting, parse_override  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
    from jaxlong.training.checkpoint import Checkpointer  # noqa: PLC0415
    from jaxlong.training.checkpoint import restore_params as restore  # noqa: PLC0415
    from jaxlong.training.step import abstract_params  # noqa: PLC0415

    ckpt_dir = (Path(run_dir) / "checkpoints").absolute()
    latest = Checkpointer.latest_in(ckpt_dir)
    if latest is None:
        raise FileNotFoundError(f"RUN_DIR {run_dir}: no checkpoint in {ckpt_dir}")
    step = latest if step is None else step
    if not (ckpt_dir / str(step)).is_dir():
        raise FileNotFoundError(f"--step {step}: no checkpoint {ckpt_dir / str(step)}")
    manager = ocp.CheckpointManager(ckpt_dir)
    try:
        saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        cfg = Config()  # the saved config as is: `model.from_hf` is not re-read (the saved model fields hold the run's)
        for k, v in saved.items():
            apply_setting(cfg, k, v)
        for text in overrides:
            apply_setting(cfg, *parse_override(text))
        cfg.mesh = MeshConfig(data=1, fsdp=-1, context=1, num_devices=len(jax.devices()))
        params = restore(ckpt_dir, step, abstract_params(cfg, build_mesh(cfg.mesh)))
    except Exception as e:  # noqa: BLE001 (orbax's errors are long tracebacks; one line names the checkpoint)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"--step {step}: checkpoint {ckpt_dir / str(step)} could not be read "
                         f"({type(e).__name__}: {first})") from None
    finally:
        manager.close()
    return step, cfg, params


def main(argv: list[str] | None = None) -> int:
    from jaxlong.core.errors import ArgumentParser, fail  # noqa: PLC0415

    parser = ArgumentParser(prog="python -m jaxlong.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run directory (runs/<run_name>)")
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default 2GiB)")
    parser.add_argument("overrides", nargs="*", help="model.from_hf=DIR or data.tokenizer=PATH: where the tokenizer "
                                                     "files are, for a run trained before its directory kept a copy")
    args = parser.parse_intermixed_args(argv)
    from jaxlong.core.distributed import cpu_unless_gpu_driver  # noqa: PLC0415

    cpu_unless_gpu_driver()  # before jax creates a backend: no CUDA-plugin traceback on a machine without a GPU
    try:
        from jaxlong.core.units import parse_bytes  # noqa: PLC0415
        from jaxlong.models.hf import save_hf  # noqa: PLC0415

        from jaxlong.data import tokenizer_source  # noqa: PLC0415

        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"--out {out}: the directory exists and is not empty; choose a new one")
        for text in args.overrides:
            if text.split("=", 1)[0].strip() not in EXPORT_KEYS:
                raise ValueError(f"{text}: export takes only {' or '.join(k + '=...' for k in EXPORT_KEYS)} (where "
                                 f"the run's tokenizer files are); the model is the checkpoint's")
        step, cfg, params = restore_params(args.run_dir, args.step, args.overrides)
        source = tokenizer_source(cfg, args.run_dir)  # the run's copy first: one resolver for every command
        if source is None:
            print(f"note: {args.run_dir} uses the byte tokenizer (data.tokenizer=byte), which transformers has no "
                  f"file for; no tokenizer exported", file=sys.stderr)
        save_hf(params, cfg.model, out, seq_len=cfg.seq_len, param_dtype=cfg.param_dtype, source=source,
                max_shard_bytes=parse_bytes(args.max_shard_size))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        return fail(e)
    print(f"exported step {step} of {args.run_dir} to {out} ({cfg.model.name}, context {cfg.seq_len})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
