"""Memory planner: per-device bytes of a training config, from the train step compiled ahead of time.

    python -m jaxlong.memory --target h100 --config configs/llama3_1_8b.yaml seq_len=3145728 --ladder
    python -m jaxlong.memory --target h100:8x2 --config configs/qwen3_32b.yaml --max-context
    python -m jaxlong.memory --config configs/llama3_1_8b.yaml seq_len=3145728     # CPU approximation

Where the compile comes from (the `source` of a plan):
  GPU compile   `--target NAME` (`jaxlong.plan.target`): XLA's GPU compiler for compile-only devices of that
                GPU, no GPU needed (needs the CUDA plugin, `pip install 'jax[cuda12]'`). The program is compiled
                as it will run: the run's compute dtype, the kernel `attention.backend=auto` picks there (cuDNN;
                the Pallas kernel for packed documents), XLA's GPU fusion, scheduling and rematerialization
                against the target's memory size.
  GPU           no `--target`, on a machine whose devices are GPUs: the same, for the real devices.
  CPU approx.   no `--target`, no GPU: simulated CPU devices (`--xla_force_host_platform_device_count`).
                XLA's CPU backend computes bf16 matmuls and all-to-alls in float32 (its buffer assignment holds
                float32 copies of bf16 operands), so the program is compiled in float32 and activation bytes
                are scaled by bytes(compute_dtype)/4; it drops memory-space annotations, so offloaded residuals
                are read from the jaxpr (`saved_residuals` types them `<host>`, U-Pipe's output buffer is
                added) and moved to the host column. Neither correction is exact: use a GPU target for numbers
                you publish.

Per device it reports:
  params, optimizer   exact, from the shardings of the train state (bytes of each leaf's shard).
  gradients           exact: same shapes and shardings as the parameters (param_dtype); transient, part of
                      the compiled temporaries.
  activations         compiled temporaries minus gradients (GPU: the device memory space only; CPU: minus the
                      offloaded residuals, scaled as above).
  host (offloaded)    GPU: the compiled host-memory-space bytes (`host_temp_size_in_bytes` and host
                      arguments/outputs), exact; per node it is this times the devices per node, checked
                      against `--host-budget`.
  peak                params + optimizer + gradients + activations: the compiled program's device bytes.
  reference           a frozen copy of the parameters that stays on the devices beside the step (GRPO with
                      `grpo.beta` > 0: its KL reference, `Objective.reference_on_device`), exact from the shardings.
  workspace           the attention kernel's run-time workspace, which no compile sees (`jaxlong.plan.workspace`).
  collectives         NCCL buffers (a model, `jaxlong.plan.workspace`).
  headroom            allocator fragmentation and what JAX holds besides the step (`--headroom`).
  total               peak + reference + workspace + collectives + headroom: what must fit the device budget.
The three rows after peak are GPU-only; the CPU approximation reports them as 0.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import jax

from jaxlong.config import Config, ConfigError, apply_setting, objective_of, parse_override, runtime, validate
from jaxlong.core.memstats import compiled_bytes
from jaxlong.core.mesh import CONTEXT_AXIS, RING_AXIS, build_mesh
from jaxlong.core.units import GiB, fmt_gib, parse_bytes
from jaxlong.core.xla_log import compile_logged
from jaxlong.layers.remat import default_offload_every, host_layer_inputs, offloads_attention_output
from jaxlong.models import llama as model_lib
from jaxlong.models.family import GLOBAL, layer_kinds
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.plan import workspace as ws
from jaxlong.plan.cost import hlo_cost, roofline
from jaxlong.plan.packing import attention_tile_fraction, document_lengths
from jaxlong.plan.tiles import blockwise_attention_cost, window_model_flops_per_token
from jaxlong.plan.target import compile_only_devices, parse_target
from jaxlong.training import step as step_lib
from jaxlong.training.metrics import flops_per_token

# The paper's Figure 1 order (U-Pipe, arXiv 2602.21196, Figure 1): each rung adds one technique to the one before.
LADDER = [
    ("default", "1 device: whole model, optimizer and sequence",
     ["mesh.num_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.ring=1", "mesh.context=1", "remat.policy=none",
      "tiling.loss=false", "tiling.mlp=false", "attention.impl=ulysses"]),
    ("fsdp", "ZeRO-3 over N devices, one sequence per device",
     ["mesh.data=1", "mesh.fsdp=-1", "mesh.context=1", "global_batch={n}"]),
    ("+ulysses", "sequence split over N devices (context parallelism)",
     ["mesh.fsdp=1", "mesh.context={n}", "global_batch=1"]),
    ("+checkpointing", "remat: keep only layer inputs", ["remat.policy=full"]),
    ("+offload", "layer inputs offloaded to pinned host memory", ["remat.policy=offload"]),
    ("+tiled loss & MLP", "ALST sequence tiling", ["tiling.loss=true", "tiling.mlp=true"]),
    ("+U-Pipe", "head-chunked Ulysses, U = C", ["attention.impl=upipe", "attention.heads_per_stage=0"]),
    ("+grouped offload", "one layer input per group of {k} layers on the host, groups recomputed",
     ["remat.offload_every={k}"]),
]
# With mesh.ring = R > 1 (several nodes), the ladder goes on across nodes: Ulysses over C = N/R devices inside
# a node, ring attention over the R nodes (USP hybrid), then U-Pipe's stages each running the ring.
HYBRID_LADDER = [
    ("+ulysses x ring", "Ulysses over {c} devices x ring attention over {r} (USP hybrid)",
     ["mesh.ring={r}", "mesh.context={c}", "attention.impl=ulysses", "data.packing=concat"]),
    ("+U-Pipe x ring", "U-Pipe stages over {c} devices, each stage a ring over {r}",
     ["attention.impl=upipe", "attention.heads_per_stage=0"]),
]


# The last rung spends memory on speed instead: every layer keeps its attention output and log-sum-exp (pinned host
# memory), so the backward's recomputation of a layer skips the attention forward (`jaxlong.layers.remat`).
KEEP_RUNG = ("+kept attention", "every layer's attention output and lse kept in host memory: attention forward "
             "once per step", ["remat.keep_attention={layers}", "remat.keep_attention_memory=host"])


# The host memory per node the planner allows for offloaded residuals (`--host-budget`): what an 8-GPU node can pin
# for them. A DGX H100 or H200 node has 2 TB (1.82 TiB) of RAM; the OS, the page cache, the data pipeline and the
# host copy of the train state that an asynchronous checkpoint stages (Llama-3.1-8B's float32 parameters and Adam
# moments: 90 GiB per node with FSDP over one node) need the remaining ~300 GiB. ALST's runs used nodes of 1.9 TB.
HOST_BUDGET = "1.5TiB"


def budgets(budget: str | None, host_budget: str, collective_buffers: str | None, target, num_devices: int):
    """(device budget, host budget per node, NCCL buffer override) in bytes from the planner's flags.

    `budget` defaults to the target's device memory (80 GiB without a target); `host_budget` is given per node
    of 8 devices and scaled down for smaller nodes; `collective_buffers` None keeps the model.

    Raises:
      ValueError: a size that cannot be parsed, or a budget that is not positive (the message names the flag).
    """
    device = parse_bytes(budget) if budget else (target.device_memory if target else 80 * GiB)
    if device <= 0:
        raise ValueError(f"--budget {budget}: must be positive")
    host = parse_bytes(host_budget, option="--host-budget")
    per_node = target.devices_per_node if target else min(num_devices, 8)
    host = host * per_node // 8 if per_node < 8 else host
    collectives = parse_bytes(collective_buffers, option="--collective-buffers") if collective_buffers else None
    return device, host, collectives


def shard_bytes(tree) -> int:
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _host_residual_bytes(cfg: Config, mesh) -> int:
    """Per-device bytes of the residuals the remat policy keeps in host memory (from the loss's jaxpr); with
    grouped checkpointing (`remat.offload_every` > 1) plus the layer inputs of the group being recomputed, which
    the backward pass moves to the host one group at a time (`jaxlong.layers.remat.host_layer_inputs`); with
    U-Pipe and `remat.policy=offload` plus one layer's output buffer (`offloads_attention_output`); with
    `remat.keep_attention` in host memory, the kept layers' attention output and float32 lse (the jaxpr's
    residuals)."""
    keep = min(cfg.remat.keep_attention, cfg.model.layers) if cfg.remat.keep_attention_memory == "host" else 0
    if not keep and (cfg.remat.policy not in ("offload", "custom")
                     or (cfg.remat.policy == "custom" and not cfg.remat.offload)):
        return 0

    try:
        from jax.ad_checkpoint import saved_residuals  # noqa: PLC0415
    except ImportError:
        from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415

    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step_lib.abstract_params(cfg, mesh))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step_lib.abstract_batch(cfg, mesh))
    lm = LanguageModeling()  # the forward's residuals: the same whatever the loss made of its outputs
    res = saved_residuals(lambda p, b: lm.sums(p, b, graphdef, rt)[0], params, batch)
    activation_shards = mesh.size  # activations are split over every mesh axis (batch x sequence)
    host = sum(math.prod(a.shape) * a.dtype.itemsize for a, _ in res if "<host>" in a.str_short())
    k, layers = cfg.remat.offload_every, cfg.model.layers
    b = batch["inputs"].shape[0]
    kept_layer = b * cfg.seq_len * cfg.model.heads * (cfg.model.head_dim * _itemsize(res) + 4)  # output, f32 lse
    if cfg.remat.policy == "offload" and k > 1:  # the saved ones are the ceil(L/k) group inputs
        inputs = max(host - keep * kept_layer, 0)  # the rest are the kept layers' attention, for the whole step
        host = inputs // -(-layers // k) * host_layer_inputs(layers, k) + keep * kept_layer
    if cfg.attention.impl == "upipe" and offloads_attention_output(cfg.remat, keep == layers):
        # U-Pipe's output buffer `[b, S, H, d]` of the layer in its backward (not a remat residual: the op
        # moves it itself), in the residuals' dtype
        host += b * cfg.seq_len * cfg.model.heads * cfg.model.head_dim * _itemsize(res)
    return host // activation_shards


def _itemsize(residuals) -> int:
    """Bytes per element of the offloaded residuals (the compute dtype of the CPU approximation's compile)."""
    return next((a.dtype.itemsize for a, _ in residuals if "<host>" in a.str_short()), 4)


def _target_for(target, n: int):
    """`target` resized to `n` devices: one node of n when n fits a node, else whole nodes."""
    per_node = min(n, target.devices_per_node)
    if n % per_node:
        raise ConfigError(f"mesh.num_devices={n} is not a whole number of {target.name} nodes of "
                          f"{target.devices_per_node} devices")
    return dataclasses.replace(target, devices_per_node=per_node, nodes=n // per_node)


def _estimate(cfg: Config, compiled, target, devices: list) -> dict:
    """Roofline estimate of the compiled step (`jaxlong.plan.cost`) against `target`'s peaks, or, without a
    target, against the shipped target whose GPU the devices are."""
    n = cfg.mesh.num_devices
    if target is None:
        kind = devices[0].device_kind
        name = next((k for k in ("h100", "h200", "a100") if k in kind.lower()), None)
        if name is None:
            raise ConfigError(f"--estimate: no peak FLOP/s known for {kind!r}; give --target h100, h200 or a100")
        target = _target_for(parse_target(name), n)
    if target.peak_flops is None:
        raise ConfigError(f"--estimate: target {target.name} has no peak FLOP/s (a spec file); use a shipped target")
    cost = hlo_cost(compiled.as_text(), n, target.devices_per_node)
    tokens, m = cfg.global_batch * cfg.seq_len, cfg.model
    # model FLOPs with each local layer's window (jaxlong.plan.tiles), not causal attention over the sequence
    model_flops = (flops_per_token(cfg) - 6.0 * m.layers * cfg.seq_len * m.heads * m.head_dim
                   + window_model_flops_per_token(cfg)) * tokens / n
    packed, fraction = document_lengths(cfg), 1.0
    if packed is not None:  # the kernels skip the tiles between documents (jaxlong.plan.packing)
        fraction = attention_tile_fraction(packed[0], cfg.seq_len, cfg.attention.block_q, cfg.attention.block_k)
        global_layers = layer_kinds(m).count(GLOBAL)
        model_flops -= 6.0 * global_layers * cfg.seq_len * m.heads * m.head_dim * tokens / n * (1.0 - fraction)
    if cost.tile_loop_groups:  # the blockwise kernel: its tiles per layer kind (jaxlong.plan.tiles)
        cost = blockwise_attention_cost(cost, cfg, fraction)
    elif packed is not None:
        cost = dataclasses.replace(cost, flops=cost.flops - cost.attention_flops * (1.0 - fraction),
                                   attention_flops=cost.attention_flops * fraction)
    est = roofline(cost, peak_flops=target.peak_flops, hbm_bandwidth=target.hbm_bandwidth,
                   link_bandwidth=target.link_bandwidth or target.hbm_bandwidth,
                   network_bandwidth=target.network_bandwidth if target.nodes > 1 else None,
                   model_flops=model_flops, tokens=tokens, devices=n,
                   pcie_bandwidth=target.pcie_bandwidth or 32e9)  # else PCIe 4.0 x16
    if packed is not None:
        est["packed_attention"] = {"tile_fraction": fraction, "lengths_from": packed[1], "documents": len(packed[0])}
    return {"basis": f"estimate: roofline of the GPU compile's HLO, {target.device_name} peaks", **est}


def plan(cfg: Config, target=None, *, headroom: str = "2%", collective_buffers: int | None = None,
         estimate: bool = False) -> dict:
    """Compile the train step of `cfg` ahead of time and return per-device bytes by category.

    Args:
      cfg: the run's config; `mesh.num_devices` devices are planned.
      target: a `jaxlong.plan.target.Target` for a deviceless GPU compile, or None for the devices present
        (GPUs, else the CPU approximation). See the module docstring.
      headroom: `--headroom` text (`'2%'` of device memory or a size); GPU plans only.
      collective_buffers: bytes of NCCL buffers per device, overriding the model; GPU plans only.
      estimate: also count the compiled step's cost and estimate its time: adds `estimate`, the dict of
        `jaxlong.plan.cost.roofline` (per device per step). GPU plans only: the CPU compile runs blockwise
        attention in loops of data-dependent length, whose FLOPs cannot be counted.

    Returns:
      dict with `params`, `optimizer`, `gradients`, `activations`, `host`, `peak`, `reference`, `workspace`,
      `collectives`, `headroom`, `total` (bytes per device), `host_per_node` (bytes), `device_memory` (bytes per device, None
      on the CPU), `source` (where the compile came from) and `compiled` (raw memory_analysis numbers).

    Raises:
      ConfigError: the config is invalid for its own `mesh.num_devices`, or the target cannot be compiled for,
        or `estimate` without a GPU (target) or without the target's peak FLOP/s.
    """
    gpu = target is not None or jax.default_backend() == "gpu"
    validate(cfg, platform="gpu" if gpu else "cpu")  # on GPUs, the limits of the kernel attention.backend=auto picks
    n = cfg.mesh.num_devices
    measured, scale, device_memory, per_node = cfg, 1.0, None, min(n, 8)
    if target is not None:
        t = _target_for(target, n)
        devices, source, device_memory, per_node = compile_only_devices(t), f"GPU compile, {t.describe()}", \
            t.device_memory, t.devices_per_node
    elif gpu:
        devices = jax.devices()[:n]
        source = f"GPU, {len(devices)} x {devices[0].device_kind}"
        device_memory = (devices[0].memory_stats() or {}).get("bytes_limit")
    else:
        devices, source = jax.devices()[:n], "CPU approximation (float32 compile, scaled)"
        if cfg.compute_dtype != "float32":
            measured = copy.deepcopy(cfg)
            measured.compute_dtype = "float32"
            scale = {"bfloat16": 2, "float16": 2}[cfg.compute_dtype] / 4
    if len(devices) < n:
        raise ConfigError(f"mesh.num_devices={n} but only {len(devices)} devices exist")
    if estimate and not gpu:
        raise ConfigError("--estimate needs a GPU target (--target h100, h200 or a100): the CPU compile runs "
                          "blockwise attention in loops of data-dependent length, whose FLOPs cannot be counted")
    mesh = build_mesh(measured.mesh, devices=devices)
    state = step_lib.abstract_state(measured, mesh)
    compiled = compile_logged(step_lib.compile_train_step, measured, mesh)
    raw = compiled_bytes(compiled)
    params = shard_bytes(state["params"])
    optimizer = shard_bytes(state["opt_state"])
    gradients = params
    if gpu:
        host = raw["host_temp"] + raw["host_argument"] + raw["host_output"]
        activations = max(raw["temp"] - gradients, 0)
    else:
        host = _host_residual_bytes(measured, mesh)
        activations = max(raw["temp"] - gradients - host, 0) * scale
        host = host * scale
    peak = params + optimizer + gradients + activations
    rows = {"reference": params if objective_of(cfg).reference_on_device else 0, "workspace": 0, "collectives": 0,
            "headroom": 0}
    if gpu:
        batch_local = max(cfg.global_batch // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
        backend = runtime(cfg, mesh).attention_backend
        rows["workspace"] = ws.attention_workspace_bytes(cfg, backend, mesh.shape[CONTEXT_AXIS], batch_local,
                                                         ring=mesh.shape.get(RING_AXIS, 1))
        rows["collectives"] = ws.collective_buffer_bytes(n, collective_buffers)
        rows["headroom"] = ws.parse_headroom(headroom, device_memory) if device_memory else 0
    total = peak + sum(rows.values())  # total = peak + reference + workspace + collectives + headroom
    out = {"params": params, "optimizer": optimizer, "gradients": gradients, "activations": activations,
           "host": host, "peak": peak, **rows, "total": total, "host_per_node": host * per_node,
           "device_memory": device_memory, "source": source, "compiled": raw}
    if estimate:
        out["estimate"] = _estimate(cfg, compiled, t if target is not None else None, devices)
    return out


def fits(p: dict, budget: int, host_budget: int | None = None) -> bool:
    """Whether plan `p` fits `budget` bytes per device (its `total`) and `host_budget` bytes of host memory
    per node (None: unchecked)."""
    return p["total"] <= budget and (host_budget is None or p["host_per_node"] <= host_budget)


def apply_rung(cfg: Config, overrides: list[str], n: int, **sizes: int) -> Config:
    out = copy.deepcopy(cfg)
    for text in overrides:
        apply_setting(out, *parse_override(text.format(n=n, **sizes)))
    return out


def ladder(cfg: Config) -> list[tuple[str, str, Config]]:
    """The configs of the ladder rungs for `cfg`'s model and sequence length, cumulative, in paper order;
    with `mesh.ring` = R > 1, then the hybrid rungs (`HYBRID_LADDER`: Ulysses x ring, U-Pipe x ring, with
    context N/R); last, the speed rung `KEEP_RUNG` (attention kept for every layer), which spends host memory."""
    n, r = cfg.mesh.num_devices, cfg.mesh.ring
    rungs, cur = [], copy.deepcopy(cfg)
    cur.mesh.num_devices = n
    k = default_offload_every(cfg.model.layers)
    for i, (name, what, overrides) in enumerate(LADDER):
        if "{k}" in what and k == 1:
            continue  # too few layers for a group to save host memory
        cur = apply_rung(cur, overrides, n, k=k)
        if i == 1:
            cur.mesh.num_devices = n
        rungs.append((name, what.format(k=k), copy.deepcopy(cur)))
    if r > 1 and n % r == 0:
        for name, what, overrides in HYBRID_LADDER:
            cur = apply_rung(cur, overrides, n, r=r, c=n // r, k=k)
            rungs.append((name, what.format(r=r, c=n // r), copy.deepcopy(cur)))
    name, what, overrides = KEEP_RUNG
    rungs.append((name, what, apply_rung(cur, overrides, n, layers=cfg.model.layers)))
    return rungs


def max_context(cfg: Config, budget: int, *, target=None, host_budget: int | None = None, headroom: str = "2%",
                collective_buffers: int | None = None, granularity: int = 65536, start: int = 65536,
                limit: int = 1 << 30) -> tuple[int, dict | None]:
    """Largest multiple of `granularity` tokens whose plan fits `budget` per device (and `host_budget` per node).

    Memory is close to linear in the sequence length, so the search brackets the answer by doubling from
    `start`, then narrows the bracket with linear interpolation of the plans' excess over the budget
    (regula falsi, Illinois variant), falling back to bisection; every probe is a compiled plan. Returns
    (seq_len, plan) or (0, None) if even `start` does not fit. `target`, `headroom`, `collective_buffers` as
    for `plan`. The doubling stops at `limit` tokens (2**30; several nodes of U-Pipe x ring fit more than 2**25).

    Raises:
      ConfigError: the config is invalid at `start` tokens (e.g. heads not divisible by the context degree).
    """
    def probe(s: int):
        c = copy.deepcopy(cfg)
        c.seq_len = s
        try:
            p = plan(c, target, headroom=headroom, collective_buffers=collective_buffers)
        except ConfigError:  # a length the tiling cannot split (sizes other than `start` only)
            return None, None
        excess = p["total"] / budget - 1
        if host_budget is not None:
            excess = max(excess, p["host_per_node"] / host_budget - 1)
        return excess, p

    first = copy.deepcopy(cfg)
    first.seq_len = start
    validate(first)  # a config that is invalid at any length is an error, not "does not fit"
    e_lo, p = probe(start)
    if e_lo is None or e_lo > 0:
        return 0, None
    lo, best, hi, e_hi = start, p, start * 2, None
    while hi <= limit:
        e, p = probe(hi)
        if e is not None and e <= 0:
            lo, e_lo, best, hi = hi, e, p, hi * 2
            continue
        e_hi = e
        break
    else:
        return lo, best
    side = 0
    while hi - lo > granularity:
        mid = (lo + hi) // 2
        if e_hi is not None and e_hi > e_lo:  # interpolate where the excess crosses zero
            mid = int(lo + (hi - lo) * (-e_lo) / (e_hi - e_lo))
        mid = min(max(mid // granularity * granularity, lo + granularity), hi - granularity)
        e, p = probe(mid)
        if e is not None and e <= 0:
            lo, e_lo, best = mid, e, p
            if side == -1 and e_hi is not None:
                e_hi /= 2  # Illinois: keep the stale end from stalling the interpolation
            side = -1
        else:
            hi, e_hi = mid, e
            if side == 1:
                e_lo /= 2
            side = 1
    return lo, best


def format_context(tokens: int, start: int = 65536) -> str:
    """Max-context cell: 0 from the search means not even its first size fits."""
    return f"< {start:,}" if tokens == 0 else f"{tokens:,}"


def format_table(rows: list[dict], budget: int, host_budget: int | None = None) -> str:
    """Markdown table of plans (GiB per device; host per node in GiB), one row per rung."""
    head = ("| rung | params | grads | optimizer | activations | peak (compiled) | attention workspace | "
            "collectives | headroom | total | host offload / device | host / node | fits |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['name']} | {fmt_gib(r['params'])} | {fmt_gib(r['gradients'])} | {fmt_gib(r['optimizer'])} | "
            f"{fmt_gib(r['activations'])} | {fmt_gib(r['peak'])} | {fmt_gib(r['workspace'])} | {fmt_gib(r['collectives'])} | "
            f"{fmt_gib(r['headroom'])} | **{fmt_gib(r['total'])}** | {fmt_gib(r['host'])} | {fmt_gib(r['host_per_node'])} | "
            f"{'yes' if fits(r, budget, host_budget) else 'no'} |"
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
                       ("activations", "#dd8452"), ("workspace", "#c44e52"), ("collectives", "#937860"),
                       ("headroom", "#bbbbbb")):
        vals = [r.get(key, 0) / GiB for r in rows]
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
