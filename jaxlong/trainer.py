"""The train loop: data, ahead-of-time compile with a memory report, steps, metrics, checkpoints, profile.

The trainer knows no model internals: it builds the mesh, the state and the jitted step from `jaxlong.step`,
feeds batches already sharded on the mesh, and writes TensorBoard scalars under `<run_dir>/<run_name>/`:
`loss`, `lr`, `grad_norm`, `tokens_per_s`, `step_time_s`, `mfu` (when the device's peak is known) and
`device_memory/*` (where the backend reports it), `packing_efficiency` (the fraction of tokens that are not
padding), and every `eval_every` steps `eval/loss` and `eval/perplexity` on held-out documents
(`jaxlong.evaluate.Validator`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from tensorboardX import SummaryWriter
from tqdm import tqdm

from jaxlong import data as data_lib
from jaxlong import evaluate as eval_lib
from jaxlong import step as step_lib
from jaxlong.checkpoint import Checkpointer
from jaxlong.config import Config, ConfigError, to_dict, validate
from jaxlong.memstats import compiled_bytes, device_memory, fmt_bytes, format_compiled
from jaxlong.mesh import batch_spec, build_mesh, describe_param_sharding

# Dense bf16 peak FLOP/s per device, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 * (non-embedding matmul params) + causal attention 6 * layers * S * H * d.

    (Kaplan et al. 2020 §2.1 with the attention term; the causal mask halves 12 * layers * S * H * d.)
    """
    m = cfg.model
    per_layer = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden
    per_layer += 3 * m.hidden * m.mlp_hidden
    matmul_params = m.layers * per_layer + m.hidden * m.vocab_size
    return 6.0 * matmul_params + 6.0 * m.layers * cfg.seq_len * m.heads * m.head_dim


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def check_fits(compiled) -> None:
    """Raise ConfigError before allocating anything when the compiled step cannot fit device memory.

    Uses the device's `bytes_limit` where the backend reports one (GPUs); the CPU reports none.
    """
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    need = compiled_bytes(compiled)["peak"]
    if limit is None and jax.default_backend() == "cpu":  # simulated devices share the host's memory
        need *= len(jax.local_devices())
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if limit and need > limit:
        raise ConfigError(
            f"the train step needs {fmt_bytes(need)} per device but the device has {fmt_bytes(limit)} "
            f"(on the CPU: all simulated devices together against host memory); "
            f"lower seq_len, or add remat.policy=offload, tiling.loss=true, tiling.mlp=true, attention.impl=upipe "
            f"(plan with: python -m jaxlong.memory --ladder)"
        )


def _silent(*args, **kwargs) -> None:
    """`print` on the processes other than process 0."""


def run(cfg: Config, *, resume: bool = False, profile: bool = False) -> dict:
    """Train for `cfg.steps` steps. Returns the last step's metrics and the run directory.

    Raises:
      ConfigError: the config does not fit the devices present (checked before compiling).
      FileNotFoundError: `resume` with no checkpoint in the run directory.
      ValueError: the corpus cannot be read or is too small (before compiling).
      KeyboardInterrupt: on SIGINT/SIGTERM, after saving the last finished step.
    """
    validate(cfg, num_devices=len(jax.devices()))
    main = jax.process_index() == 0  # process 0 logs, writes TensorBoard and shows the progress bar
    say = print if main else _silent
    mesh = build_mesh(cfg.mesh)
    run_dir = Path(cfg.run_dir) / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.from_hf:  # the checkpoint's tokenizer.json; its tensors are checked before compiling
        from jaxlong.models import hf  # noqa: PLC0415

        hf.check_checkpoint(cfg.model.from_hf, cfg)
        tokenizer = hf.HFTokenizer(cfg.model.from_hf)
    else:
        tokenizer = data_lib.get_tokenizer(cfg.data.tokenizer)
    try:
        data_lib.check_vocab(tokenizer, cfg.model.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    say(f"jaxlong: {cfg.model.name}, seq_len {cfg.seq_len}, global batch {cfg.global_batch}, "
          f"mesh {dict(mesh.shape)} on {len(jax.devices())} x {jax.devices()[0].device_kind}, "
          f"attention {cfg.attention.impl}/{cfg.attention.backend}, remat {cfg.remat.policy}")

    ckpt_dir = run_dir / "checkpoints"
    latest = Checkpointer.latest_in(ckpt_dir)
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint found in {ckpt_dir.absolute()}")
    if not resume and latest is not None:
        raise ConfigError(
            f"run_name={cfg.run_name!r}: {ckpt_dir} already holds checkpoints (up to step {latest}); "
            f"pass --resume to continue it, or choose a new run_name"
        )
    start = latest or 0
    if start >= cfg.steps:
        say(f"nothing to do: the latest checkpoint is step {start} and steps={cfg.steps}; "
              f"pass steps=N with N > {start} to train further")
        return {"metrics": {}, "run_dir": str(run_dir)}
    # Data first: a bad corpus fails before the (possibly long) compile.
    source = data_lib.DocumentSource(cfg.data.path, cfg.data.text_field)
    validator, held_out = None, ()
    if cfg.eval_every:  # whole documents held out for validation, left out of training
        held_out, eval_tokens = eval_lib.held_out_documents(source, tokenizer, cfg.eval_fraction, cfg.seed,
                                                            eval_lib.Validator.tokens_needed(cfg))
        validator = eval_lib.Validator(cfg, mesh, eval_tokens, tokenizer.eod_id, held_out=True)
    batches = data_lib.batch_iterator(cfg, tokenizer, source=source, exclude=held_out)

    t0 = time.perf_counter()
    compiled = step_lib.compile_train_step(cfg, mesh)
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    say(format_compiled(compiled))
    check_fits(compiled)
    if validator:
        say(format_compiled(validator.compile(), "eval step"))

    ckpt = Checkpointer(ckpt_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints)
    if resume:
        start, state = ckpt.restore(step_lib.abstract_state(cfg, mesh))
        data_state = ckpt.restore_data(start)
        if data_state is not None:
            batches.set_state(data_state)
        else:  # a checkpoint without the data iterator's state: replay the batches it consumed
            for _ in range(start):
                next(batches)
        say(f"resumed from {ckpt.directory / str(start)}")
    elif cfg.model.from_hf:
        state = step_lib.init_state(cfg, mesh, hf.load_params(cfg.model.from_hf, cfg, mesh))
        say(f"loaded the weights of {cfg.model.from_hf}")
    else:
        state = step_lib.init_state(cfg, mesh)
    sharded = describe_param_sharding(mesh, state["params"])
    replicated = [line for line in sharded if "replicated" in line]
    say(f"FSDP: {len(sharded) - len(replicated)} of {len(sharded)} parameter leaves sharded over fsdp x ring x context"
          + (f"; replicated: {', '.join(r.split()[0] for r in replicated)}" if replicated else ""))

    batch_sharding = NamedSharding(mesh, batch_spec())
    writer = SummaryWriter(str(run_dir)) if main else None
    tokens_per_step = cfg.seq_len * cfg.global_batch
    flops, peak = flops_per_token(cfg), peak_flops()
    metrics: dict = {}
    packed: list[float] = []
    last_saved = start
    profiling = False
    profile_start = start + 1  # skip the first step (allocation, warm-up)
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=not main)
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)  # preemption: save, then stop
    done, data_state_done = start, batches.get_state()
    try:
        t_last = time.perf_counter()
        for step in range(start, cfg.steps):
            if profile and step == profile_start:
                jax.profiler.start_trace(str(run_dir))
                profiling = True
            host_batch = next(batches)
            packed.append(data_lib.packing_efficiency(host_batch))
            batch = data_lib.put_on_mesh(host_batch, batch_sharding)
            state, m = compiled(state, batch)
            if profiling and step == profile_start + cfg.profile_steps - 1:
                jax.block_until_ready(m)
                jax.profiler.stop_trace()
                profiling = False
                say(f"profile of {cfg.profile_steps} steps written under {run_dir}/plugins/profile")
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                # replicated scalars: every process reads its own copy (multi-process arrays are not
                # fully addressable, so no device_get of the global array)
                metrics = {k: float(np.asarray(v.addressable_data(0))) for k, v in m.items()}
                metrics["packing_efficiency"], packed = sum(packed) / len(packed), []
                now = time.perf_counter()
                n_steps = cfg.log_every if step + 1 - start >= cfg.log_every else step + 1 - start
                metrics["step_time_s"] = (now - t_last) / n_steps
                metrics["tokens_per_s"] = tokens_per_step / metrics["step_time_s"]
                if peak:
                    metrics["mfu"] = metrics["tokens_per_s"] * flops / (peak * len(jax.devices()))
                for k, v in device_memory().items():
                    metrics[f"device_memory/{k}"] = v
                for k, v in metrics.items():
                    if writer is not None:
                        writer.add_scalar(k, v, step + 1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                packed=f"{metrics['packing_efficiency']:.2f}")
                t_last = now
            if validator and validator.due(step + 1):
                ev = validator.run(state["params"])
                if writer is not None:
                    writer.add_scalar("eval/loss", ev["loss"], step + 1)
                    writer.add_scalar("eval/perplexity", ev["perplexity"], step + 1)
                bar.write(f"step {step + 1}: eval loss {ev['loss']:.4f} (perplexity {ev['perplexity']:.2f}, "
                          f"{ev['tokens']:.0f} held-out tokens)")
            bar.update(1)
            done, data_state_done = step + 1, batches.get_state()
            if ckpt.save(step + 1, state, to_dict(cfg), data_state=batches.get_state()):
                last_saved = step + 1
        if last_saved != cfg.steps and start < cfg.steps:
            ckpt.save(cfg.steps, state, to_dict(cfg), force=True, data_state=batches.get_state())
    except KeyboardInterrupt:
        if done > last_saved:
            try:
                ckpt.save(done, state, to_dict(cfg), force=True, data_state=data_state_done)
                last_saved = done
            except Exception as e:  # noqa: BLE001 (the state of an interrupted step may be gone)
                say(f"could not save step {done}: {e}")
        ckpt.wait()  # commit it before reporting; `finally` closes the manager
        say(f"interrupted after step {done}; latest checkpoint: step {last_saved}; continue with --resume")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        if profiling:
            jax.profiler.stop_trace()
        bar.close()
        if writer is not None:
            writer.close()
        ckpt.close()  # waits for pending asynchronous saves: a finished save is never lost
    say(f"done: step {cfg.steps}, loss {metrics.get('loss', float('nan')):.4f}; "
          f"TensorBoard: tensorboard --logdir {cfg.run_dir}; checkpoints in {ckpt.directory}")
    return {"metrics": metrics, "run_dir": str(run_dir)}
