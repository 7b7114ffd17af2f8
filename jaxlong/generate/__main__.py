"""Generate text: `python -m jaxlong.generate SOURCE (--prompt TEXT | --prompt-file F) [--chat]
[--max-new-tokens N] [--temperature T --top-p P --top-k K --seed S] [--stop TEXT ...] [--step N] [key=value ...]`.

SOURCE is a run directory (its latest checkpoint, or `--step N`, on the mesh it was trained with; `key=value`
overrides change it as in `python -m jaxlong.eval`, e.g. `mesh.context=8`) or a Hugging Face checkpoint directory
(without `mesh.*` overrides, on the mesh fastest on the host: one device on a CPU host, FSDP over every device on
GPUs or in a launch of several processes; stderr says which). The prompt is prefilled with the training forward on
that mesh (any context-parallel mode), then decoded one token per step with a KV cache split by sequence over the
devices (`jaxlong.generation`, docs/generation.md). Only the generated text goes to stdout, streamed as it comes,
and one newline after it; progress and figures go to stderr.

A plain prompt is tokenized as transformers tokenizes it, with the checkpoint's own special-token rules (BOS
where its tokenizer adds one; the byte tokenizer starts it as its documents start). `--chat` renders the prompt as
a user turn with the checkpoint's chat template and opens the assistant's turn. Decoding stops at an EOS id (the
tokenizer's and `generation_config.json`'s, a list for Llama-3.1-Instruct, which includes its end-of-turn
token), at a `--stop` string, or after `--max-new-tokens`. `--temperature 0` (the default) is greedy; otherwise
tokens are sampled with top-k / top-p from `--seed` (without it, a seed drawn at random and printed on stderr, so
that `--seed N` repeats the run). Launched as several processes, as the trainer is, it generates on one mesh over
all of them and process 0 prints. Nothing is written. Errors are one line on stderr, exit code 2. Examples:

    python -m jaxlong.generate runs/default --prompt "def fibonacci(n):" --max-new-tokens 64
    python -m jaxlong.generate ckpt/smollm2-135m-instruct --chat --prompt "What is RoPE?" --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path

from jaxlong.config import ConfigError, from_dict, load_config
from jaxlong.core.errors import ArgumentParser, fail


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m jaxlong.generate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a run directory (runs/<run_name>) or a Hugging Face checkpoint directory")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="the prompt text")
    text.add_argument("--prompt-file", help="a UTF-8 file holding the prompt")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn of the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="the sampling seed (default: drawn at random when sampling, printed on stderr to repeat the "
                        "run; greedy decoding takes none)")
    p.add_argument("--stop", action="append", default=[], help="a string that ends the text (repeatable)")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the latest)")
    p.add_argument("overrides", nargs="*", help="config key=value overrides (e.g. mesh.context=8)")
    return p.parse_intermixed_args(argv)


def resolve(args):
    """(cfg, run_dir or None, step, token ids of the prompt, tokenizer, EOS ids) from the arguments, before jax
    starts: every bad input is refused here, before anything loads or compiles.

    Raises:
      FileNotFoundError, ConfigError, ValueError: one line naming the argument and what would work.
    """
    from jaxlong.data import HFTokenizer, run_tokenizer, tokenizer_source  # noqa: PLC0415
    from jaxlong.data.chat import run_template  # noqa: PLC0415
    from jaxlong.data.tokenizer import stop_ids  # noqa: PLC0415
    from jaxlong.generation.generate import check_positions  # noqa: PLC0415
    from jaxlong.training.checkpoint import committed_steps, saved_config  # noqa: PLC0415

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError(f"--temperature={args.temperature}, --top-p={args.top_p}, --top-k={args.top_k}: give a "
                          f"temperature >= 0, a top-p in (0, 1] and a top-k >= 0")
    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"--prompt-file {args.prompt_file}: no such file") from None
        except OSError as e:  # a directory, no permission
            raise ValueError(f"--prompt-file {args.prompt_file}: cannot be read ({e.strerror}); give a UTF-8 text "
                             f"file") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start}: {e.reason}); "
                             f"convert it, e.g. iconv -t UTF-8") from None
    else:
        prompt = args.prompt
    if not prompt:
        raise ConfigError("the prompt is empty: give --prompt TEXT or a --prompt-file with text")
    source = Path(args.source)
    run_dir, step, args.mesh_choice = None, None, None
    if (source / "checkpoints").is_dir():
        run_dir = source
        steps = committed_steps(source / "checkpoints")
        if not steps:
            raise FileNotFoundError(f"{source}: no checkpoint in {source / 'checkpoints'} (train first)")
        step = steps[-1] if args.step is None else args.step
        if step not in steps:
            raise FileNotFoundError(f"--step {step}: no checkpoint at that step in {source / 'checkpoints'}; have "
                                    f"{steps}")
        saved = saved_config(source / "checkpoints", step)
        cfg = _for_generation(lambda extra: from_dict(saved, [*args.overrides, *extra]), args.overrides)
        trained = int(saved.get("seq_len", cfg.seq_len))  # the context it was trained to, whatever the overrides
        tokenizer, directory = run_tokenizer(cfg, run_dir), tokenizer_source(cfg, run_dir)
    elif (source / "config.json").is_file():
        if args.step is not None:
            raise ConfigError(f"--step {args.step}: {source} is a Hugging Face directory, which has no steps")
        mesh_keys, args.mesh_choice = hf_mesh(args.overrides)
        settings = [f"model.from_hf={source}", *mesh_keys, *args.overrides]
        cfg = _for_generation(lambda extra: load_config(None, [*settings, *extra]), args.overrides)
        trained = 0  # the checkpoint's own max_position_embeddings is its limit
        tokenizer, directory = HFTokenizer(source, option="SOURCE"), source
    else:
        raise FileNotFoundError(f"SOURCE {source}: neither a run directory (with checkpoints/) nor a Hugging Face "
                                f"checkpoint directory (with config.json)")
    if args.chat:
        template = run_template(cfg.data.chat_template, directory, run_dir=run_dir)
        if template is None:
            raise ConfigError(f"--chat: {source} has no chat template (its tokenizer's files have none and "
                              f"data.chat_template is not set); drop --chat, or give data.chat_template=FILE.jinja")
        text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tokenizer.encode(text)  # the template places the special tokens
    else:
        ids = tokenizer.encode_prompt(prompt)
    if len(ids) == 0:
        raise ConfigError("the prompt has no tokens: give some text")
    check_positions(cfg, len(ids), args.max_new_tokens, trained=trained)
    if args.top_k > tokenizer.vocab_size:
        raise ConfigError(f"--top-k={args.top_k} exceeds the tokenizer's {tokenizer.vocab_size} tokens; give at most "
                          f"{tokenizer.vocab_size}, or 0 for all")
    args.trained = trained
    return cfg, run_dir, step, ids, tokenizer, stop_ids(tokenizer, directory)


def cpu_host() -> bool:
    """Whether jax will run on the CPU platform, decided before jax starts as `jaxlong.core.distributed` decides
    it: the first platform JAX_PLATFORMS names, or, where it is unset or empty, the absence of an NVIDIA driver."""
    from jaxlong.core.distributed import gpu_driver_present  # noqa: PLC0415

    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()]
    return platforms[0] == "cpu" if platforms else not gpu_driver_present()


# A Hugging Face directory's mesh where the user names none: one device on a CPU host (its simulated devices share
# its cores, so splitting the model over them adds collectives and copies without adding compute), FSDP over every
# device on GPUs and in a launch of several processes (which was launched to span them).
ONE_DEVICE = ("mesh.num_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.ring=1", "mesh.context=1")
EVERY_DEVICE = ("mesh.fsdp=-1", "mesh.context=1")


def hf_mesh(overrides) -> tuple[tuple[str, ...], str | None]:
    """(mesh settings, choice) for a Hugging Face directory: with a `mesh.*` key among `overrides`, FSDP over every
    device under them as before (choice None); otherwise `ONE_DEVICE` on a CPU host in one process (choice "one"),
    else `EVERY_DEVICE` (choice "every"). Decided before jax starts (`cpu_host`)."""
    from jaxlong.core.distributed import process_count_from_env  # noqa: PLC0415

    if any(o.split("=", 1)[0].strip().startswith("mesh.") for o in overrides):
        return EVERY_DEVICE, None
    if cpu_host() and process_count_from_env() == 1:
        return ONE_DEVICE, "one"
    return EVERY_DEVICE, "every"


def mesh_line(choice: str, mesh) -> str:
    """The stderr line that says which mesh a Hugging Face directory runs on and why (`hf_mesh`'s `choice`)."""
    if choice == "one":
        return "mesh: 1 CPU device (the fastest on this host; give mesh.* overrides to shard)"
    n = mesh.devices.size
    return (f"mesh: FSDP over {n} {mesh.devices.flat[0].platform.upper()} device{'s' if n > 1 else ''} (every "
            f"device of this launch; give mesh.* overrides for another split)")


# What generation takes from the prompts themselves, not from the training config: the prompt length and the
# batch. A refusal about one of them that the user did not set is answered with its suggestion.
OWN_KEYS = ("seq_len", "global_batch", "grad_accum")


def _for_generation(load, overrides, hops: int = 4):
    """`load(extra_overrides)`, retried with the validator's own suggestion while it refuses one of `OWN_KEYS` that
    `overrides` does not set (a batch of 2 does not divide a mesh of 8 FSDP ways; generation batches its prompts
    itself).

    Raises:
      ConfigError: any other refusal, as `load` raises it.
    """
    extra: list[str] = []
    for _ in range(hops):
        try:
            return load(extra)
        except ConfigError as e:
            mine = [o.split("=", 1)[0].strip() for o in overrides]
            fix = next((f for f in e.suggestions if set(f) <= set(OWN_KEYS) and not set(f) & set(mine)), None)
            if e.key not in OWN_KEYS or fix is None:
                raise
            extra += [f"{k}={v}" for k, v in fix.items()]
    return load(extra)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg, run_dir, step, ids, tokenizer, eos = resolve(args)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        return fail(e)
    from jaxlong.core import distributed, liveness  # noqa: PLC0415

    try:
        distributed.start(cfg.mesh, cfg.lost_process_timeout_s)
        return run(cfg, run_dir, step, ids, tokenizer, eos, args)
    except (FileNotFoundError, ValueError) as e:
        return fail(e)
    finally:
        liveness.stop_watchdog()


def run(cfg, run_dir, step, ids, tokenizer, eos, args) -> int:
    """Load the weights on the run's mesh, generate, stream the text to stdout (process 0)."""
    import jax  # noqa: PLC0415 (after the device count is set)

    from jaxlong.config import run_mesh  # noqa: PLC0415
    from jaxlong.generation.decode import Sampling  # noqa: PLC0415
    from jaxlong.generation.generate import Generator  # noqa: PLC0415

    mesh = run_mesh(cfg)
    main = jax.process_index() == 0
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if main else (lambda *a: None)
    if args.mesh_choice is not None:
        say(mesh_line(args.mesh_choice, mesh))
    seed = draw_seed(args, say)
    t0 = time.perf_counter()
    if run_dir is not None:
        from jaxlong.training.checkpoint import restore_weights  # noqa: PLC0415

        params = restore_weights(cfg, mesh, run_dir / "checkpoints", step, hint=" (drop the override)")
        say(f"restored {run_dir / 'checkpoints' / str(step)} on mesh {dict(mesh.shape)} in "
            f"{time.perf_counter() - t0:.1f} s")
    else:
        from jaxlong.models import hf  # noqa: PLC0415

        hf.check_checkpoint(cfg.model.from_hf, cfg.model)
        params = hf.load_params(cfg.model.from_hf, cfg.model, mesh, cfg.param_dtype)
        say(f"loaded {cfg.model.from_hf} on mesh {dict(mesh.shape)} in {time.perf_counter() - t0:.1f} s")
    gen = Generator(cfg, mesh, params, tokenizer, max_new_tokens=args.max_new_tokens,
                    sampling=Sampling(args.temperature, args.top_k, args.top_p), eos_ids=eos, stop=args.stop,
                    trained=args.trained, prefill_bar=main)
    stream = (lambda row, text: print(text, end="", flush=True)) if main else None
    t0 = time.perf_counter()
    out = gen([ids], seed=seed, on_text=stream)[0]
    if main:  # the text, then one newline: the shell's prompt starts a line of its own (out[:-1] is the text)
        print(flush=True)
    seconds = time.perf_counter() - t0
    say(f"prompt {len(ids)} tokens, {len(out.tokens)} generated (stopped: {out.reason}) in {seconds:.1f} s with "
        f"compiles ({gen.timing()})")
    return 0


def draw_seed(args, say) -> int:
    """The sampling seed: `--seed`, or when sampling without it one drawn at random in [0, 2**31 - 1] (process 0's
    draw on every process of a launch) and printed through `say` as the `--seed` that repeats the run; 0, unused,
    for greedy decoding."""
    if args.seed is not None:
        return args.seed
    if args.temperature <= 0:
        return 0
    from jaxlong.core.distributed import allgather_json  # noqa: PLC0415

    seed = int(allgather_json(secrets.randbelow(2**31))[0])  # every process samples the same tokens
    say(f"seed: {seed} (pass --seed {seed} to repeat)")
    return seed


if __name__ == "__main__":
    sys.exit(main())
