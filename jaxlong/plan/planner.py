"""Memory planner: per-device bytes of a training config, compiled ahead of time on simulated devices.

    python -m jaxlong.memory --config configs/llama3_1_8b.yaml seq_len=3145728 --budget 80GiB
    python -m jaxlong.memory --config configs/llama3_1_8b.yaml seq_len=3145728 --ladder --out experiments/results
    python -m jaxlong.memory --config configs/llama3_1_8b.yaml --max-context --budget 80GiB

The train step is lowered and compiled for `mesh.num_devices` CPU devices (`--xla_force_host_platform_
device_count`); nothing is allocated, so 8x H100 shapes plan on a laptop. Per device it reports:

  params, optimizer   exact, from the shardings of the train state (bytes of each leaf's shard).
  gradients           exact: same shapes and shardings as the parameters (param_dtype); transient, they
                      are part of the compiled temporaries.
  activations         compiled temporaries minus gradients minus host-offloaded residuals, for the compute
                      dtype (see the bf16 correction below).
  host (offloaded)    residuals the remat policy sends to `pinned_host` (read from the jaxpr of the loss:
                      `saved_residuals` types them `<host>`). XLA's CPU backend drops memory-space
                      annotations, so the CPU compile counts them as device temporaries; the plan moves
                      them to the host column. On a GPU they live in pinned host memory.
  peak                params + optimizer + gradients + activations (+ XLA's argument/output accounting):
                      what must fit the device `--budget`.

bf16 correction: XLA's CPU backend computes bf16 matmuls and all-to-alls in float32 (its buffer assignment
holds float32 copies of bf16 operands), so a CPU compile of a bf16 program overstates activation bytes.
The planner therefore compiles the program in float32 and scales activation bytes by
bytes(compute_dtype)/4. Buffers that are float32 whatever the compute dtype (softmax statistics, logits of
the loss) are understated by that scaling; they are small next to the `[S/C, hidden]` activations.
"""

from __future__ import annotations

import copy
import math
import re

from jaxlong.config import Config, ConfigError, validate

GiB = 1024**3

# The paper's Figure 1 order (design brief §2): each rung adds one technique to the one before.
LADDER = [
    ("default", "1 device: whole model, optimizer and sequence",
     ["mesh.num_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.context=1", "remat.policy=none",
      "tiling.loss=false", "tiling.mlp=false", "attention.impl=ulysses"]),
    ("fsdp", "ZeRO-3 over N devices, one sequence per device",
     ["mesh.data=1", "mesh.fsdp=-1", "mesh.context=1", "global_batch={n}"]),
    ("+ulysses", "sequence split over N devices (context parallelism)",
     ["mesh.fsdp=1", "mesh.context={n}", "global_batch=1"]),
    ("+checkpointing", "remat: keep only layer inputs", ["remat.policy=full"]),
    ("+offload", "layer inputs offloaded to pinned host memory", ["remat.policy=offload"]),
    ("+tiled loss & MLP", "ALST sequence tiling", ["tiling.loss=true", "tiling.mlp=true"]),
    ("+U-Pipe", "head-chunked Ulysses, U = C", ["attention.impl=upipe", "attention.heads_per_stage=0"]),
]


def parse_bytes(text: str) -> int:
    """'80GiB' / '80GB' / '1.5TiB' / '123' -> bytes.

    Raises:
      ValueError: unparseable size.
    """
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--budget {text!r}: expected a size like 80GiB, 80GB or 85899345920")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if "I" in unit or unit in ("K", "M", "G", "T") else 1000
    return int(value * base ** powers[unit[0]])


def _shard_bytes(tree) -> int:
    import jax  # noqa: PLC0415

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _host_residual_bytes(cfg: Config, mesh) -> int:
    """Per-device bytes of the residuals the remat policy keeps in host memory (from the loss's jaxpr)."""
    if cfg.remat.policy not in ("offload", "custom") or (cfg.remat.policy == "custom" and not cfg.remat.offload):
        return 0
    import jax  # noqa: PLC0415

    from jaxlong import model as model_lib  # noqa: PLC0415
    from jaxlong import step as step_lib  # noqa: PLC0415

    try:
        from jax.ad_checkpoint import saved_residuals  # noqa: PLC0415
    except ImportError:
        from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415

    graphdef, rt = model_lib.model_graphdef(cfg), model_lib.Runtime(mesh=mesh, cfg=cfg)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step_lib.abstract_state(cfg, mesh)["params"])
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step_lib.abstract_batch(cfg, mesh))
    res = saved_residuals(lambda p, b: step_lib.loss_fn(p, b, graphdef, rt), params, batch)
    activation_shards = mesh.size  # activations are split over every mesh axis (batch x sequence)
    host = sum(math.prod(a.shape) * a.dtype.itemsize for a, _ in res if "<host>" in a.str_short())
    return host // activation_shards


def plan(cfg: Config) -> dict:
    """Compile the train step of `cfg` ahead of time and return per-device bytes by category.

    Returns a dict with `params`, `optimizer`, `gradients`, `activations`, `host`, `peak` (bytes per device)
    and the raw `compiled` memory_analysis numbers.

    Raises:
      ConfigError: the config is invalid for its own `mesh.num_devices`.
    """
    import jax  # noqa: PLC0415

    from jaxlong import step as step_lib  # noqa: PLC0415
    from jaxlong.memstats import compiled_bytes  # noqa: PLC0415
    from jaxlong.mesh import build_mesh  # noqa: PLC0415

    validate(cfg)
    measured = copy.deepcopy(cfg)
    scale = 1.0
    if cfg.compute_dtype != "float32":
        measured.compute_dtype = "float32"
        scale = {"bfloat16": 2, "float16": 2}[cfg.compute_dtype] / 4
    devices = jax.devices()[: cfg.mesh.num_devices]
    if len(devices) < cfg.mesh.num_devices:
        raise ConfigError(f"mesh.num_devices={cfg.mesh.num_devices} but only {len(devices)} devices exist")
    mesh = build_mesh(measured.mesh, devices=devices)
    state = step_lib.abstract_state(measured, mesh)
    compiled = step_lib.compile_train_step(measured, mesh)
    raw = compiled_bytes(compiled)
    params = _shard_bytes(state["params"])
    optimizer = _shard_bytes(state["opt_state"])
    gradients = params
    host = _host_residual_bytes(measured, mesh)
    activations = max(raw["temp"] - gradients - host, 0) * scale
    peak = params + optimizer + gradients + activations
    return {"params": params, "optimizer": optimizer, "gradients": gradients, "activations": activations,
            "host": host * scale, "peak": peak, "compiled": raw}


def apply_rung(cfg: Config, overrides: list[str], n: int) -> Config:
    from jaxlong.config import _apply, parse_override  # noqa: PLC0415

    out = copy.deepcopy(cfg)
    for text in overrides:
        _apply(out, *parse_override(text.format(n=n)))
    return out


def ladder(cfg: Config) -> list[tuple[str, str, Config]]:
    """The configs of the ladder rungs for `cfg`'s model and sequence length, cumulative, in paper order."""
    n = cfg.mesh.num_devices
    rungs, cur = [], copy.deepcopy(cfg)
    cur.mesh.num_devices = n
    for i, (name, what, overrides) in enumerate(LADDER):
        cur = apply_rung(cur, overrides, n)
        if i == 1:
            cur.mesh.num_devices = n
        rungs.append((name, what, copy.deepcopy(cur)))
    return rungs


def max_context(cfg: Config, budget: int, *, granularity: int = 65536, start: int = 65536,
                limit: int = 1 << 25) -> tuple[int, dict | None]:
    """Largest multiple of `granularity` tokens whose plan peak fits `budget`, by doubling then bisection over
    compiled sizes. Returns (seq_len, plan) or (0, None) if even `start` does not fit.

    Raises:
      ConfigError: the config is invalid at `start` tokens (e.g. heads not divisible by the context degree).
    """

    def fits(s: int):
        c = copy.deepcopy(cfg)
        c.seq_len = s
        try:
            p = plan(c)
        except ConfigError:  # a length the tiling cannot split (sizes other than `start` only)
            return False, None
        return p["peak"] <= budget, p

    first = copy.deepcopy(cfg)
    first.seq_len = start
    validate(first)  # a config that is invalid at any length is an error, not "does not fit"
    ok, p = fits(start)
    if not ok:
        return 0, None
    lo, best = start, p
    hi = start * 2
    while hi <= limit:
        ok, p = fits(hi)
        if not ok:
            break
        lo, best, hi = hi, p, hi * 2
    else:
        return lo, best
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        ok, p = fits(mid)
        if ok:
            lo, best = mid, p
        else:
            hi = mid
    return lo, best


def _ctx(tokens: int, start: int = 65536) -> str:
    """Max-context cell: 0 from the search means not even its first size fits."""
    return f"< {start:,}" if tokens == 0 else f"{tokens:,}"


def _gib(x: float) -> str:
    v = x / GiB
    return f"{v:.1f}" if v >= 1 or v == 0 or v != v else f"{v:.2g}"  # small plans keep two digits


def format_table(rows: list[dict], budget: int) -> str:
    head = "| rung | params | grads | optimizer | activations | host (offload) | peak | fits |\n|---|---:|---:|---:|---:|---:|---:|---|"
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['name']} | {_gib(r['params'])} | {_gib(r['gradients'])} | {_gib(r['optimizer'])} | "
            f"{_gib(r['activations'])} | {_gib(r['host'])} | {_gib(r['peak'])} | "
            f"{'yes' if r['peak'] <= budget else 'no'} |"
        )
    return "\n".join(lines)


def plot_ladder(rows: list[dict], budget: int, path: str, title: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 5))
    bottom = [0.0] * len(rows)
    for key, color in (("params", "#4c72b0"), ("gradients", "#55a868"), ("optimizer", "#8172b2"),
                       ("activations", "#dd8452")):
        vals = [r[key] / GiB for r in rows]
        ax.bar(names, vals, bottom=bottom, label=key, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(budget / GiB, color="red", linestyle="--", label=f"budget {budget / GiB:.0f} GiB")
    ax.set_yscale("log")
    ax.set_ylim(bottom=1)
    ax.set_ylabel("GiB per device (log)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    for i, b in enumerate(bottom):
        ax.text(i, b * 1.05, f"{b:.0f}", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
