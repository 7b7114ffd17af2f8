"""Fit a context to your GPUs: the fastest configuration of a run that fits the memory budget.

    python -m jaxlong.memory --fit --target h100 --config configs/llama3_1_8b.yaml seq_len=131072
    python -m jaxlong.train  --fit --target h100 --config configs/llama3_1_8b.yaml seq_len=131072

The flags, tables and JSON are in `jaxlong.plan.fit_report`. Memory is a currency: add memory techniques one at
a time, stop as soon as the context fits, and spend the memory left over on speed. The search covers the
options that change memory and speed but not the model's result (the loss and gradients are the same up to
floating-point order):

  mesh        the split of the devices over `mesh.fsdp` x `mesh.ring` x `mesh.context` (`mesh.data` and
              `global_batch` are kept; ring > 1 only across nodes). Categorical: each split is its own space.
  attention   Ulysses, then U-Pipe with heads per stage U from H down to C (the values `check_upipe_schedule`
              allows): fewer heads per stage, less attention memory, more stages.
  remat       none, save_dots, full, offload (layer inputs in pinned host memory), grouped offload (one layer
              input per group of `remat.offload_every` layers on the host, `jaxlong.layers.remat`; groups of 2
              and of `default_offload_every`, where grouping saves host memory: `offload_groupings`). Grouped
              offload needs slightly more device memory than offload (a group's recompute), so the device order
              of its levels is approximate: they exist to pass the host budget, which prunes nothing.
  tiled loss  off, on (`tiling.loss_tile` derived from its byte budget).
  tiled MLP   off, ALST's tile count, 4x as many tiles.
  kept attention  with full and offload remat: every layer keeps its attention output and lse in host memory
              (`remat.keep_attention`: the backward does not run attention's forward again), as many layers as
              the host budget leaves room for after the offloaded layer inputs of each offload level
              (`keep_levels`), or none. Spends host memory for speed. With no remat and save_dots the dimension
              has one level (nothing to keep): the first with no remat (every residual is kept), the last with
              save_dots (attention recomputed).

Within one mesh split every dimension is ordered from the fastest expected level (index 0) to the most
memory-saving one, and the search assumes both orders are monotone: a candidate whose every level is at least
another's needs no more device memory and runs no faster. Hence, without compiling:
  - if a candidate does not fit the device budget, no candidate with the same attention setting and every
    other level at most its levels fits (e.g. if full remat does not fit, no remat will not);
  - if a candidate fits, every candidate with every level at least its levels is dominated (it needs no
    more memory and is slower) and is not compiled;
  - with a cost model known before compiling (`analytic_cost`), a candidate estimated slower than the best
    fitting one is not compiled.
The memory order does not cross attention settings: the compiled memory is not monotone in them (U-Pipe with
U = H can need more than Ulysses, U = 16 more than U = 32), so a candidate that does not fit prunes only
candidates with its own attention setting. Host memory (offload) is not monotone in the remat order, so a
candidate that fails only the host budget prunes nothing.

The order of compiles: the candidates are sorted by expected speed, `analytic_cost` (FLOPs with each technique's
recompute, fastest first). The most memory-saving candidate of each mesh split is compiled first, so a run that
can fit gets an answer even within a small `--max-compiles`. Then a binary search along the speed order: the
median of the unresolved candidates between the slowest known not to fit and the fastest known to fit. Memory
falls roughly along that order, so each compile halves the stretch where the fastest fitting candidate lies, and
the default budget reaches the fast end (at 128K tokens on 8 x H100: no remat, no offload). The order only
chooses what to compile; the memory order above alone prunes. When no candidate expected faster than a known fit
is left, the next is the one that settles the most others whichever way it goes.

Candidates are ranked by `cost_model(cfg, plan) -> seconds per step`; the default (`estimated_cost`) reads
`plan["estimate"]["step_seconds"]`, the roofline estimate of the compiled GPU program from
`plan(cfg, target, estimate=True)`. `analytic_cost` is a closed-form FLOP count (no compile needed). Equal
estimates (the roofline sees no tile or stage launches, so tile counts can tie exactly) go to the candidate
earlier in the expected-speed order.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import json
import sys
import time
from typing import Callable

from tqdm import tqdm

from jaxlong.config import Config, ConfigError, apply_setting, parse_override, validate
from jaxlong.core.mesh import resolve_mesh_shape
from jaxlong.core.units import fmt_gib
from jaxlong.layers.remat import default_offload_every, host_layer_inputs
from jaxlong.layers.tiled import default_mlp_tiles
from jaxlong.parallel.upipe import check_upipe_schedule
from jaxlong.plan import planner
from jaxlong.training.metrics import PEAK_FLOPS, flops_per_token

REMAT_LEVELS = ("none", "save_dots", "full", "offload")


class FitError(ConfigError):
    """The fit cannot run: no candidate is valid, or the cost model has nothing to rank by."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search space: its mesh split (index into the splits) and a level per dimension."""

    mesh: int
    levels: tuple[int, ...]
    overrides: tuple[str, ...]  # key=value, applied on top of the base config

    @property
    def key(self) -> str:
        return " ".join(self.overrides)

    def below(self, other: Candidate) -> bool:
        """Every level of self is at most other's (self needs at least other's memory, runs no slower)."""
        return self.mesh == other.mesh and all(a <= b for a, b in zip(self.levels, other.levels))

    def needs_more_memory(self, other: Candidate) -> bool:
        """`below`, for the device-memory order, within one attention setting only. The compiled memory is not
        monotone in the attention method: U-Pipe with U = H heads per stage can need more than Ulysses (46.1
        against 44.5 GiB for Llama-3.1-8B at 3M tokens on 8xH100, GPU compile), and at a short sequence U = 16
        more than U = 32 (one attention layer at 64K: 357 against 325 MiB; its stages' query tensors are twice
        U = 8's and the weights dominate), so a candidate that does not fit says nothing about another attention
        setting."""
        return self.below(other) and self.levels[0] == other.levels[0]


# ----------------------------------------------------------------------------------------------
# The space.


@functools.lru_cache(maxsize=None)
def parse_setting(text: str) -> tuple[list[str], object]:
    """`key=value` -> (key path, value as the config stores it), type-checked once by `jaxlong.config.apply_setting`."""
    key, value, raw = parse_override(text)
    probe = Config()
    apply_setting(probe, key, value, raw)
    path = key.split(".")
    return path, functools.reduce(getattr, path, probe)


def configure(cfg: Config, overrides) -> Config:
    """A copy of `cfg` with `key=value` overrides applied (not validated; `planner.apply_rung` without the
    per-call parsing, since the search applies the same few overrides to hundreds of candidates).

    Raises:
      ConfigError: unknown key or wrong type.
    """
    out = copy.deepcopy(cfg)
    for text in overrides:
        path, value = parse_setting(text)
        setattr(functools.reduce(getattr, path[:-1], out), path[-1], copy.copy(value))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_splits(cfg: Config, devices_per_node: int, nodes: int) -> list[tuple[str, ...]]:
    """Overrides of every `fsdp x ring x context` split of `devices_per_node * nodes` devices (the config's own
    split first), keeping `mesh.data`; context stays inside a node, ring > 1 only across nodes."""
    n, data = devices_per_node * nodes, max(cfg.mesh.data, 1)

    def split(data, fsdp, ring, context):
        return (f"mesh.num_devices={n}", f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.ring={ring}",
                f"mesh.context={context}")

    out = [split(data, n // (data * ring * context), ring, context) for ring in _divisors(nodes)
           for context in _divisors(devices_per_node) if n % (data * ring * context) == 0]
    try:
        mine = split(*resolve_mesh_shape(cfg.mesh, n))
        if mine in out:
            out.remove(mine)
            out.insert(0, mine)
    except ConfigError:
        pass
    return out


def kept_layers_that_fit(cfg: Config, host_budget: int, offload_every: int = 1) -> int:
    """How many layers (0 to `model.layers`) can keep their attention (`remat.keep_attention`) within `host_budget`
    bytes per node beside the layer inputs that `remat.policy=offload` with `remat.offload_every` puts on the host
    (`host_layer_inputs`). Per node, a layer's kept attention is its output `[b, S, heads, head_dim]` in the compute
    dtype and its float32 lse `[b, heads, S]` over the node's share of the sequence; a layer input is
    `[b, S, hidden]`. An analytic count: the compile decides whether a candidate fits."""
    m, layers = cfg.model, cfg.model.layers
    nodes = max(cfg.mesh.num_devices // 8, 1)
    tokens = cfg.global_batch * cfg.seq_len / nodes  # per node: the sequence is split over the nodes (ring)
    itemsize = 2 if cfg.compute_dtype in ("bfloat16", "float16") else 4
    kept = tokens * m.heads * (m.head_dim * itemsize + 4)
    inputs = tokens * m.hidden * itemsize * host_layer_inputs(layers, offload_every)
    return max(0, min(layers, int((host_budget - inputs) // kept))) if kept else 0


def keep_levels(cfg: Config, host_budget: int | None) -> list[int]:
    """Layers that keep their attention (`remat.keep_attention`), fastest first: every layer, then as many as fit
    `host_budget` bytes per node beside the offloaded layer inputs of each offload level the search tries (plain
    offload, groups of 2, groups of `default_offload_every`; `kept_layers_that_fit`), then none. Grouping puts
    fewer layer inputs on the host and so leaves room to keep more layers."""
    layers = cfg.model.layers
    if host_budget is None:
        return [layers, 0]
    some = {kept_layers_that_fit(cfg, host_budget, k) for k in offload_groupings(layers)}
    return [layers, *sorted((n for n in some if 0 < n < layers), reverse=True), 0]


def offload_groupings(layers: int) -> list[int]:
    """The `remat.offload_every` values of the search's offload levels: 1 (every layer input on the host), 2 (the
    smallest group: the least device memory for a group's recompute; with kept attention, the group's kept
    outputs are on the device together in its backward) and `default_offload_every` (the fewest host inputs),
    those that divide `layers` and save host memory."""
    k = default_offload_every(layers)  # 1 when no grouping saves host memory
    if k == 1:
        return [1]
    return [1, *(g for g in sorted({2, k}) if layers % g == 0 and host_layer_inputs(layers, g) < layers)]


def dimension_levels(cfg: Config, host_budget: int | None = None) -> list[list[tuple[str, ...]]]:
    """Per dimension (attention, remat, tiled loss, tiled MLP, kept attention), the overrides of each level, fastest
    expected first, for `cfg`'s mesh; `host_budget` (bytes per node) sizes the kept-attention level between all and
    none (`keep_levels`)."""
    m = cfg.model
    _, _, ring, context = resolve_mesh_shape(cfg.mesh, cfg.mesh.num_devices)
    attention = [("attention.impl=ulysses", "attention.heads_per_stage=0")]
    for u in range(m.heads, context - 1, -context):
        try:
            check_upipe_schedule(m.heads, m.kv_heads, context, u)
        except ConfigError:
            continue
        attention.append(("attention.impl=upipe", f"attention.heads_per_stage={u}"))
    remat = [(f"remat.policy={p}", "remat.offload_every=1") for p in REMAT_LEVELS]
    remat += [("remat.policy=offload", f"remat.offload_every={k}") for k in offload_groupings(m.layers)[1:]]
    loss = [("tiling.loss=false", "tiling.loss_tile=0"), ("tiling.loss=true", "tiling.loss_tile=0")]
    mlp = [("tiling.mlp=false", "tiling.mlp_tiles=0"), ("tiling.mlp=true", "tiling.mlp_tiles=0")]
    s_local = cfg.seq_len // (ring * context)
    if s_local > 0:
        base = default_mlp_tiles(s_local, m.hidden)
        more = next((d for d in _divisors(s_local) if d >= 4 * base), None)
        if more is not None and more > base:
            mlp.append(("tiling.mlp=true", f"tiling.mlp_tiles={more}"))
    keep = [(f"remat.keep_attention={n}",) for n in keep_levels(cfg, host_budget)]
    return [attention, remat, loss, mlp, keep]


def _keep_level(remat_level: tuple[str, ...], levels: int) -> int:
    """The one kept-attention level of a remat level that recomputes no layer: the first with no remat (every
    residual is kept, as fast as keeping attention), the last with save_dots (attention is recomputed, as when
    none is kept), so that the search's speed order holds across the two dimensions."""
    return 0 if "remat.policy=none" in remat_level else levels - 1


def _recomputes_layers(remat_level: tuple[str, ...]) -> bool:
    """Whether a remat level's policy recomputes whole layers in the backward (full, offload): only then is there
    an attention forward to keep."""
    return any(o in ("remat.policy=full", "remat.policy=offload") for o in remat_level)


def candidate_space(cfg: Config, devices_per_node: int, nodes: int,
                    host_budget: int | None = None) -> tuple[list[tuple[str, ...]], list[Candidate], list[dict]]:
    """(mesh splits, valid candidates in expected-speed order, invalid ones as `{"overrides", "reason"}`).

    A split whose fastest candidate `validate` rejects (e.g. `global_batch` not divisible by `mesh.fsdp`) is
    reported once; other invalid candidates one by one."""
    splits = mesh_splits(cfg, devices_per_node, nodes)
    cands, invalid = [], []
    for i, split in enumerate(splits):
        base = configure(cfg, split)
        try:
            validate(base)
        except ConfigError as e:
            invalid.append({"overrides": " ".join(split), "reason": f"invalid: {e}", "by": None})
            continue
        dims = dimension_levels(base, host_budget)
        for levels in itertools.product(*(range(len(d)) for d in dims)):
            parts = [d[lv] for d, lv in zip(dims, levels)]
            if not _recomputes_layers(parts[1]):  # nothing to keep: one kept-attention level
                if levels[4] != _keep_level(parts[1], len(dims[4])):
                    continue
                parts[4] = ("remat.keep_attention=0",)
            ov = tuple(split) + tuple(o for part in parts for o in part)
            c = Candidate(i, tuple(levels), ov)
            c_cfg = configure(cfg, ov)
            try:
                validate(c_cfg)
            except ConfigError as e:
                invalid.append({"overrides": c.key, "reason": f"invalid: {e}", "by": None})
                continue
            cands.append((analytic_cost(c_cfg), _prior(c), c.mesh, len(cands), c))
    cands.sort()
    return splits, [entry[-1] for entry in cands], invalid


def _prior(c: Candidate) -> float:
    """Expected slowness among candidates of equal analytic estimate (which sees no memory technique that costs
    no FLOPs): remat first, then kept attention, U-Pipe stages, tiling."""
    attention, remat, loss, mlp, keep = c.levels
    return 10 * remat + 5 * keep + 3 * attention + loss + 2 * mlp


# ----------------------------------------------------------------------------------------------
# Cost models: cost_model(cfg, plan) -> seconds per step (lower is better).


def estimated_cost(cfg: Config, p: dict) -> float:
    """Seconds per step from the compiled program's roofline estimate, `plan(..., estimate=True)["estimate"]`.

    Raises:
      FitError: the plan carries no `estimate` (a planner without step-time estimates).
    """
    est = p.get("estimate")
    if not est or "step_seconds" not in est:
        raise FitError("the plan has no step-time estimate (plan(..., estimate=True)['estimate']['step_seconds']); "
                       "rank with --cost-model analytic instead")
    return float(est["step_seconds"])


estimated_cost.needs_estimate = True


def analytic_flops(cfg: Config) -> tuple[float, float]:
    """(model FLOPs per step, recompute factor) in closed form, for ranking without a compile.

    Model FLOPs: 6 x matmul parameters x tokens plus causal attention, 3 x 2 x 2 x S^2/2 x H x d per layer and
    sequence (forward + backward = 3 forwards). Recomputed FLOPs (factor = executed / model): save_dots
    recomputes attention's forward, full and offload the whole layer's forward (grouped offload,
    `remat.offload_every` > 1, twice), U-Pipe attention's forward once more (its backward recomputes it), tiled
    loss the logits' forward, tiled MLP the MLP's forward; layers that keep their attention
    (`remat.keep_attention`) recompute the layer without its attention forward.
    """
    m, s, b = cfg.model, cfg.seq_len, cfg.global_batch
    tokens = s * b
    attn_w = m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
    mlp_w = 3 * m.hidden * m.mlp_hidden
    head_w = m.hidden * m.vocab_size
    attn_fwd = 2 * 2 * (s * s / 2) * m.heads * m.head_dim * b  # per layer, causal
    layer_fwd = 2 * (attn_w + mlp_w) * tokens + attn_fwd
    model = flops_per_token(cfg) * tokens  # = 3 x (layers x layer_fwd + 2 x head_w x tokens)
    extra = 0.0
    policy = cfg.remat.policy
    if policy == "save_dots":
        extra += m.layers * attn_fwd
    elif policy in ("full", "offload", "custom"):
        extra += m.layers * layer_fwd
        if policy == "offload" and cfg.remat.offload_every > 1:
            extra += m.layers * layer_fwd  # the group's forward, recomputed before its layers' backward
        if policy in ("full", "offload"):  # kept layers' recomputation skips the attention forward
            extra -= min(cfg.remat.keep_attention, m.layers) * attn_fwd
    if cfg.attention.impl == "upipe":
        extra += m.layers * attn_fwd
    if cfg.tiling.loss:
        extra += 2 * head_w * tokens
    if cfg.tiling.mlp:
        extra += m.layers * 2 * mlp_w * tokens
    return model, (model + extra) / model


def analytic_cost(cfg: Config, p: dict | None = None, *, peak_flops: float = PEAK_FLOPS["H100"], mfu: float = 0.4) -> float:
    """Seconds per step from `analytic_flops` at `mfu` of `peak_flops` per device (H100 dense bf16 by default),
    plus small penalties that keep the orders of the search monotone: offload's host transfers (2%), one
    kernel launch per U-Pipe stage per layer and pass, and per tile of the tiled loss and MLP."""
    model, factor = analytic_flops(cfg)
    seconds = model * factor / (peak_flops * mfu * cfg.mesh.num_devices)
    if cfg.remat.policy == "offload":
        seconds *= 1.02
    _, _, ring, context = resolve_mesh_shape(cfg.mesh, cfg.mesh.num_devices)
    launch = 20e-6 * cfg.model.layers * 3
    if cfg.attention.impl == "upipe":
        seconds += launch * (cfg.model.heads // (cfg.attention.heads_per_stage or context))
    if cfg.tiling.mlp:
        s_local = cfg.seq_len // (ring * context)
        seconds += launch * (cfg.tiling.mlp_tiles or default_mlp_tiles(s_local, cfg.model.hidden))
    return seconds


analytic_cost.static = True  # known before compiling: the search may prune by it


COST_MODELS = {"estimate": estimated_cost, "analytic": analytic_cost}


# ----------------------------------------------------------------------------------------------
# The search.


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """How `fit` searches: its compile budget, how it ranks, and what it passes to the planner. The defaults are
    those of `python -m jaxlong.memory --fit`.

    Attributes:
      max_compiles: at most this many compiles (cache hits are free, and so are setups the program refuses with
        a ValueError while tracing, before XLA compiles, e.g. a kernel's size limit).
      cost_model: `(cfg, plan) -> seconds per step`; an attribute `static = True` means it ignores the plan,
        so candidates can be ranked (and pruned) before compiling.
      plan_fn: the planner (None: `planner.plan`, looked up when `fit` runs), called
        `plan_fn(cfg, target, headroom=, collective_buffers=)`.
      cache: dict from a candidate's overrides (with the sequence length and target) to its plan, shared between
        calls and filled in place; a hit costs no compile. None: a new dict per call.
      headroom: fragmentation headroom for the planner, a percentage of device memory ("2%") or a size ("1GiB").
      collective_buffers: NCCL buffers per device for the planner, bytes (None: modelled).
      progress: show a progress bar of the compiles on stderr.
    """

    max_compiles: int = 12
    cost_model: Callable[[Config, dict], float] = estimated_cost
    plan_fn: Callable[..., dict] | None = None
    cache: dict | None = None
    headroom: str = "2%"
    collective_buffers: int | None = None
    progress: bool = True


@dataclasses.dataclass
class FitResult:
    """What `fit` found. `rows`: one dict per compiled candidate, in compile order (`overrides`, `fits`,
    `peak`, `total`, `host_per_node` in bytes, `step_seconds`, `tokens_per_s_per_gpu`, `recompute_factor`,
    `cached`, `compile_seconds`, `index`); `pruned`: `{"overrides", "reason", "by"}` for every candidate not
    compiled (`by`: the compiled candidate that settled it); `winner`: the fastest
    fitting row or None; `closest`: the row nearest to fitting when nothing fits."""

    rows: list[dict]
    pruned: list[dict]
    winner: dict | None
    closest: dict | None
    compiles: int
    candidates: int


def with_estimate(plan_fn, cost_model):
    """plan_fn with `estimate=True` when the cost model reads the estimate; checked before any compile."""
    if not getattr(cost_model, "needs_estimate", False):
        return plan_fn
    try:
        params = inspect.signature(plan_fn).parameters
        takes = "estimate" in params or any(q.kind is q.VAR_KEYWORD for q in params.values())
    except (TypeError, ValueError):
        takes = True
    if not takes:
        raise FitError("--cost-model estimate needs plan(..., estimate=True), which this planner does not offer; "
                       "use --cost-model analytic")
    return lambda *a, **k: plan_fn(*a, estimate=True, **k)


def fit(cfg: Config, target=None, *, budget: int, host_budget: int | None = None,
        options: FitOptions = FitOptions()) -> FitResult:
    """The fastest configuration of `cfg` (same model, sequence length and batch) that fits `budget` bytes per
    device and `host_budget` bytes of host memory per node, searched as the module docstring describes.

    Args:
      cfg: the run; its mesh is re-split over `target.devices` (or `cfg.mesh.num_devices` without a target).
      target: `jaxlong.plan.target.Target` or None (the devices present, or the CPU approximation).
      budget, host_budget: bytes per device / per node (`planner.fits`).
      options: the compile budget, cost model, planner, cache and planner settings (`FitOptions`).

    Returns:
      FitResult.

    Raises:
      FitError: no candidate is valid for this model and device count, or the cost model cannot rank.
    """
    plan_fn = with_estimate(options.plan_fn or planner.plan, options.cost_model)
    per_node, nodes = _topology(cfg, target)
    _, cands, pruned = candidate_space(cfg, per_node, nodes, host_budget)
    if not cands:
        reasons = "; ".join(sorted({p["reason"] for p in pruned}))[:600]
        raise FitError(f"no candidate configuration is valid for {cfg.model.name} at seq_len={cfg.seq_len} on "
                       f"{per_node * nodes} devices: {reasons}")
    fingerprint = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)  # the model, length, batch, ...
    tag = (fingerprint, getattr(target, "name", None), per_node, nodes, options.headroom, options.collective_buffers)
    cache = {} if options.cache is None else options.cache
    search = _Search(cfg, target, budget, host_budget, options, plan_fn, cache, tag, list(cands), pruned)
    bar = tqdm(total=min(options.max_compiles, len(cands)), desc="compiles", unit="compile", file=sys.stderr,
               dynamic_ncols=True, disable=not options.progress)
    try:
        search.run(bar)
    finally:
        bar.total = search.compiles  # the search may settle everything before the compile budget
        bar.refresh()
        bar.close()
    closest = _closest(search.rows, budget, host_budget) if search.best is None else None
    return FitResult(search.rows, search.pruned, search.best, closest, search.compiles, len(cands))


def _topology(cfg: Config, target) -> tuple[int, int]:
    """(devices per node, nodes) that the mesh is re-split over: the target's, else `mesh.num_devices` in nodes of
    8; one node of every device where those do not multiply to the device count."""
    per_node, nodes = (target.devices_per_node, target.nodes) if target is not None else \
        (min(cfg.mesh.num_devices, 8), max(cfg.mesh.num_devices // 8, 1))
    if per_node * nodes != (target.devices if target is not None else cfg.mesh.num_devices):
        per_node, nodes = cfg.mesh.num_devices, 1
    return per_node, nodes


def _closest(rows: list[dict], budget: int, host_budget: int | None) -> dict | None:
    """The compiled row nearest to fitting, or None when none was compiled: the least excess, the larger of its
    device total over `budget` and its host bytes per node over `host_budget` (where one is given)."""
    def excess(r):
        return max(r["total"] / budget, r["host_per_node"] / host_budget if host_budget else 0)
    return min(rows, key=excess, default=None)


@dataclasses.dataclass
class _Search:
    """One search's state: the candidates not yet settled (`unresolved`, in expected-speed order, which `rank`
    keeps), the compiled rows, the settled candidates (`pruned`), the compiles spent and the best fitting row."""

    cfg: Config
    target: object
    budget: int
    host_budget: int | None
    options: FitOptions
    plan_fn: Callable[..., dict]
    cache: dict
    tag: tuple
    unresolved: list[Candidate]
    pruned: list[dict]
    rank: dict = dataclasses.field(init=False)
    rows: list[dict] = dataclasses.field(default_factory=list)
    probed: set[int] = dataclasses.field(default_factory=set)
    compiles: int = 0
    best: dict | None = None
    best_rank: int | None = None
    fastest_fit: int | None = None

    def __post_init__(self) -> None:
        self.rank = {c: i for i, c in enumerate(self.unresolved)}

    def run(self, bar) -> None:
        """Compile candidates in `_next`'s order, each result settling what it decides, until none is left
        unresolved or the compile budget is spent (the rest then settled as not compiled)."""
        static = getattr(self.options.cost_model, "static", False)
        while self.unresolved:
            if static and self.best is not None:
                self.prune_slower()
                if not self.unresolved:
                    break
            c = _next(self.unresolved, self.probed, self.rank, self.fastest_fit)
            ck = (self.tag, c.key)
            if ck not in self.cache and self.compiles >= self.options.max_compiles:
                for rest in list(self.unresolved):
                    self.settle(rest, f"not compiled: --max-compiles {self.options.max_compiles} reached")
                break
            self.unresolved.remove(c)
            self.probed.add(c.mesh)
            c_cfg = configure(self.cfg, c.overrides)
            hit = ck in self.cache
            if not hit:
                self.compile(c, c_cfg, ck, bar)
            p = self.cache[ck]
            if "error" in p:
                why = "refused before compiling" if p.get("refused") else "does not compile"
                self.pruned.append({"overrides": c.key, "reason": f"{why}: {p['error']}", "by": None})
                continue
            self.record(c, _row(c, c_cfg, p, self.budget, self.host_budget, self.options.cost_model, hit))

    def faster(self, seconds: float, c: Candidate) -> bool:
        """Faster than the best fitting row; an equal estimate (a roofline does not see tile or stage launches)
        goes to the candidate expected faster (earlier in the expected-speed order)."""
        return self.best is None or (seconds, self.rank[c]) < (self.best["step_seconds"], self.best_rank)

    def settle(self, c: Candidate, reason: str, by: dict | None = None) -> None:
        """Take `c` out of the search without compiling it, for `reason` (`by`: the row that decided it)."""
        self.unresolved.remove(c)
        self.pruned.append({"overrides": c.key, "reason": reason, "by": by["overrides"] if by else None})

    def prune_slower(self) -> None:
        """With a cost model known before compiling: settle every candidate estimated no faster than the best."""
        for c in list(self.unresolved):
            if not self.faster(self.options.cost_model(configure(self.cfg, c.overrides), {}), c):
                self.settle(c, f"estimated no faster than #{self.best['index']}, which fits", self.best)

    def compile(self, c: Candidate, c_cfg: Config, ck: tuple, bar) -> None:
        """Plan `c` (`c_cfg`) into the cache under `ck`, with its compile seconds. A compiler error rules out this
        candidate, not the search: it is cached as an `error`; a ValueError, the program refusing the setup
        while tracing (e.g. a kernel's size limit) before XLA compiles, is `refused` and costs no compile."""
        bar.set_postfix_str(strip_implied(c.key).split("mesh.context=")[-1][:70], refresh=False)
        t0 = time.perf_counter()
        refused = False
        try:
            self.cache[ck] = self.plan_fn(c_cfg, self.target, headroom=self.options.headroom,
                                          collective_buffers=self.options.collective_buffers)
        except Exception as e:  # noqa: BLE001 (a compiler error rules out this candidate, not the search)
            refused = isinstance(e, ValueError)
            self.cache[ck] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                              "refused": refused}
        self.cache[ck] = {**self.cache[ck], "compile_seconds": time.perf_counter() - t0}
        if not refused:
            self.compiles += 1
            bar.update(1)

    def record(self, c: Candidate, row: dict) -> None:
        """Add `c`'s compiled row and settle what it decides: if it fits, every candidate at least as heavy in
        each dimension is dominated; if it exceeds the device budget, every candidate that needs at least its
        device memory (same attention setting) does not fit. Failing only the host budget settles nothing."""
        self.rows.append(row)
        row["index"] = len(self.rows)
        if row["fits"]:
            rank = self.rank[c]
            self.fastest_fit = rank if self.fastest_fit is None else min(self.fastest_fit, rank)
            if self.faster(row["step_seconds"], c):
                self.best, self.best_rank = row, rank
            for o in [o for o in self.unresolved if c.below(o)]:
                self.settle(o, f"dominated by #{row['index']}, which fits and is lighter in every dimension "
                               f"(expected faster)", row)
        elif not row["total"] <= self.budget:
            for o in [o for o in self.unresolved if o.needs_more_memory(c)]:
                self.settle(o, f"needs at least the device memory of #{row['index']} ({fmt_gib(row['total'], 1)} > "
                               f"{fmt_gib(self.budget, 1)} GiB)", row)


def _next(unresolved: list[Candidate], probed: set[int], rank: dict, fastest_fit: int | None) -> Candidate:
    """The next candidate to compile. First the most memory-saving candidate of each mesh split not yet probed
    (whether the split can fit at all). Then a bisection of the candidates expected faster (`rank`, the order of
    `analytic_cost`) than the fastest one known to fit (`fastest_fit`; all of them while none is known): the
    one that settles the most of them whichever way it goes (min of those it would prune if it fits and if it
    does not), ties to the faster. Each fit narrows that set to what could still beat it, so the compiles move
    towards the fast end; when it is empty, the same bisection over every unresolved candidate."""
    fresh = [c for c in unresolved if c.mesh not in probed]
    if fresh:
        mesh = fresh[0].mesh
        return max((c for c in fresh if c.mesh == mesh), key=lambda c: sum(c.levels))
    focus = [c for c in unresolved if fastest_fit is None or rank[c] < fastest_fit] or unresolved

    def score(c: Candidate) -> int:
        up = sum(1 for o in focus if c.below(o))
        down = sum(1 for o in focus if o.needs_more_memory(c))
        return min(up, down)

    return max(focus, key=lambda c: (score(c), -rank[c]))


def _row(c: Candidate, cfg: Config, p: dict, budget, host_budget, cost_model, cached: bool) -> dict:
    seconds = float(cost_model(cfg, p))
    est = p.get("estimate") or {}
    factor = est.get("recompute_factor")
    if factor is None:
        factor = analytic_flops(cfg)[1]
    return {"overrides": c.key, "levels": list(c.levels), "fits": planner.fits(p, budget, host_budget),
            "peak": p["peak"], "total": p["total"], "host_per_node": p["host_per_node"], "step_seconds": seconds,
            "tokens_per_s_per_gpu": est["tokens_per_s_per_gpu"]
            if est.get("step_seconds") == seconds and est.get("tokens_per_s_per_gpu") is not None
            else (cfg.seq_len * cfg.global_batch / seconds / cfg.mesh.num_devices if seconds > 0 else float("inf")),
            "recompute_factor": factor, "source": p.get("source", ""), "cached": cached,
            "compile_seconds": p.get("compile_seconds")}


# ----------------------------------------------------------------------------------------------
# Display of overrides.


_IMPLIED = ("attention.heads_per_stage=0", "tiling.loss_tile=0", "tiling.mlp_tiles=0")


def strip_implied(key: str) -> str:
    """Overrides without those that restate the search's defaults (U = C, derived tile sizes)."""
    return " ".join(o for o in key.split() if o not in _IMPLIED)


__all__ = ["Candidate", "FitError", "FitOptions", "FitResult", "analytic_cost", "analytic_flops", "candidate_space",
           "configure", "estimated_cost", "fit", "parse_setting", "strip_implied", "with_estimate"]
