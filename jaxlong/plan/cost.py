"""Cost of a compiled train step, counted from its HLO text, and a roofline estimate of its time.

    cost = hlo_cost(compiled.as_text(), devices)   # FLOPs, HBM bytes, collective bytes, attention calls per step
    est = roofline(cost, peak_flops=..., hbm_bandwidth=..., link_bandwidth=..., network_bandwidth=...,
                   model_flops=..., tokens=..., devices=...)   # estimated step seconds, tokens/s per GPU, MFU
    jaxlong.plan.plan(cfg, target, estimate=True)["estimate"]   # both, for a config and a GPU target

Why count from the text: a deviceless GPU compile (`jaxlong.plan.target`) has no `cost_analysis()` (it returns
None), and XLA's CPU `cost_analysis()` does not see cuDNN attention. So the compiled HLO module
(`compiled.as_text()`, the program after XLA's optimization passes, including its rematerialization) is walked:

  FLOPs (per device, per step)
    `dot`: 2 x output elements x contracted size; `convolution`: 2 x output elements x (kernel elements / output
    features); cuBLAS GEMM custom calls (`__cublas$gemm`, `__cublas$lt$matmul*`): as `dot`, from the
    dimension numbers of their backend config. cuDNN fused attention (`__cudnn$fmha*`): forward
    4 x B x H x Sq x Sk x D (two matmuls, QK^T and PV), halved when the backend config's `mask_type` is causal;
    backward 2.5 x the forward (five matmuls: QK^T recomputed, dV, dP, dQ, dK; FlashAttention-2 §3.2).
    B, H, Sq, Sk are read from the config's `intermediate_tensor_shape`, D is the query's last dimension.
    The Pallas attention kernels (`jaxlong.kernels.pallas_gpu`, Triton custom calls named by their op_name
    `jaxlong_flash_{fwd,bwd_dkdv,bwd_dq}[_causal][_kvhm]`): 2 x B x H x Sq x Sk x D per matmul, halved when
    causal, with 2 matmuls forward, 4 for dK/dV (QK^T recomputed, dV, dP, dK) and 3 for dQ (QK^T, dP, dQ); B, Sq,
    H, D from the query operand, Sk from the key operand (its dim 2 for `_kvhm`, a head-major KV cache). With
    segment ids (packed documents) or `kv_starts` the kernels skip tiles, so this is the dense work: an upper
    bound.
    The blockwise kernel (`jaxlong.kernels.blockwise`, pure JAX: its matmuls are `dot`s in loops): its tile loops
    have bounds that are data (the causal diagonal, a sliding window, documents), so XLA knows no trip count. Such
    a loop is a `while` without `known_trip_count` whose op traces, by the module's stack-frame tables, to
    `jaxlong/kernels/blockwise.py`, or to an op of KERNEL_CALLERS (the frame of their `custom_vjp`'s call site, see
    there) with a tile's 2 or 5 matmuls in its body. It is counted one iteration (one score tile) per entry and
    recorded by direction in `tile_loop_flops`, `tile_loop_bytes` and `tile_loop_entries` ("forward": 2 matmuls
    per tile, QK^T and PV; "backward": 5, QK^T, dV, dP, dK, dQ), and by direction and one tile's FLOPs (the call's
    shape: its tiles and batch x heads) in `tile_loop_groups` and `tile_loop_group_bytes`. The loop does not tell
    the layer kind (causal or windowed) or the call's path, so `jaxlong.plan.tiles.blockwise_attention_cost`
    replaces these counts by the kernel's tiles per layer kind and path (docs/windows.md; the rule, remat
    recomputation included, is in `jaxlong.plan.tiles`). Without the stack-frame tables such loops fall back to
    the rule for loops below.
    Elementwise work is not counted (it is memory bound; the HBM bytes carry it).
  HBM bytes (per device, per step) -- an approximation
    the operand + output bytes of every top-level op (fusions, custom calls, copies, collectives) of the entry
    computation and of loop bodies, i.e. each kernel reads its inputs from and writes its outputs to HBM once.
    Slicing fusions count the slice, in-place dynamic-update-slice fusions the update, not the whole buffer
    (also where the slice reads the operand through a `bitcast`, e.g. one layer's slice of a stacked buffer, and
    where one fusion reads a tile of a buffer and writes it back in place, an accumulator's tile).
    Caches and re-reads inside a kernel are not modelled. Copies to or from host memory (offloaded residuals,
    layouts in memory space S(5)) count half as HBM bytes, half as `host_transfer_bytes`.
  Collective bytes (per device, per step), by kind
    the larger of the input and output buffer of each all-to-all, all-gather, reduce-scatter, all-reduce and
    collective-permute (`bytes`), and the bytes a device sends over its links for a ring/pairwise algorithm
    over a group of n (`wire_bytes`: (n-1)/n of the larger buffer; all-reduce 2(n-1)/n; permute 1x).
  Attention calls (per step)
    executions of the cuDNN forward and backward custom calls (`attention_calls`), and the same weighted by the
    batch x heads of each call (`attention_head_calls`: the attention work, comparable across head chunkings).

Everything inside a `while` loop counts `known_trip_count` times (XLA writes it in the loop's backend config;
else the constant bound of the loop condition's compare; else once, listed in `warnings`), called computations
(fusions, calls, async wrappers) count once per call, and a `conditional` counts its most expensive branch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
               "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
               "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
# Ops that move no data of their own (views, tuples, control) or are containers whose bodies are counted.
NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
              "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain",
              "async-start", "async-update", "async-done", "copy-done", "send-done", "recv-done"}

BLOCKWISE_SOURCE = "jaxlong/kernels/blockwise.py"  # the blockwise kernel's ops trace to this file
# Ops that call the blockwise kernel inside a `custom_vjp` (the halo exchange, ring attention, U-Pipe's stage
# scans): JAX traces a custom_vjp's rules with the op's call site as their traceback, so every op of the rules, the
# kernel's tile loops included, carries the call site's stack frame, in one of these files, and none of the
# kernel's own (the kernel's `blockwise_attention` is itself such an op: its loops' frame is its call in
# BLOCKWISE_SOURCE).
KERNEL_CALLERS = ("jaxlong/parallel/halo.py", "jaxlong/parallel/ring.py", "jaxlong/parallel/upipe.py")
HOST_SPACE = ":S(5)"  # XLA's memory-space annotation of host memory in a layout
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Array shapes in a (possibly tuple) HLO shape string: [(dtype, dims), ...]."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(text)
            if d in DTYPE_BYTES]


def _bytes(shapes) -> float:
    return sum(DTYPE_BYTES[d] * math.prod(dims) for d, dims in shapes)


def _matching(text: str, i: int) -> int:
    """Index just past the bracket that closes the one opening at text[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(text)):
        c = text[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    return len(text)


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the output shape text
    op: str
    operands: list[str]
    attrs: str
    args: str = ""  # the raw argument text, e.g. the number of a parameter or the value of a constant
    root: bool = False

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    def backend_config(self) -> dict:
        i = self.attrs.find("backend_config=")
        if i < 0:
            return {}
        j = i + len("backend_config=")
        if self.attrs[j:j + 1] != "{":
            return {}
        try:
            return json.loads(self.attrs[j:_matching(self.attrs, j)])
        except ValueError:
            return {}


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    end = _matching(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    m2 = re.match(r"([\w\-]+)\(", rest)
    if not m2:
        return None
    close = _matching(rest, m2.end() - 1)
    args = rest[m2.end():close - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instr(m.group(1), shape, m2.group(1), operands, rest[close:], args, line.lstrip().startswith("ROOT"))


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """HLO module text -> ({computation name: instructions}, entry computation name)."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m and not line.startswith(("HloModule", " ")):
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[cur].append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def source_frames(text: str, path_suffix, *, callers: bool = False) -> frozenset[int]:
    """Ids of the stack frames (an op's `stack_frame_id=` metadata) whose own source location lies in a file whose
    path ends with `path_suffix` (a string or a tuple of them, e.g. "jaxlong/kernels/blockwise.py"), read from the
    module's `FileNames`, `FileLocations` and `StackFrames` tables: the ops a function of that file traced. With
    `callers`, also the frames one of whose parents (`parent_frame_id`, the calling frames) lies in such a file:
    the ops traced by anything a function of that file called. Empty when the text has no such tables (an HLO
    text printed without source locations)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"(\d+) (.*)$", line)):
            current[int(m.group(1))] = m.group(2)
        elif current is not None:
            current = None
            if len(tables) == 4:
                break
    files = {k for k, v in tables.get("FileNames", {}).items() if v.strip('"').endswith(path_suffix)}
    locations = {k for k, v in tables.get("FileLocations", {}).items()
                 if (m := re.search(r"file_name_id=(\d+)", v)) and int(m.group(1)) in files}
    frames = tables.get("StackFrames", {})
    own = frozenset(k for k, v in frames.items()
                    if (m := re.search(r"file_location_id=(\d+)", v)) and int(m.group(1)) in locations)
    if not callers:
        return own
    parent = {k: int(m.group(1)) for k, v in frames.items() if (m := re.search(r"parent_frame_id=(\d+)", v))}
    found = set(own)
    for k in frames:
        chain, f = [], k
        while f in frames and f not in found and f not in chain:  # a root frame is its own parent
            chain.append(f)
            f = parent.get(f, 0)
        if f in found:
            found.update(chain)
    return frozenset(found)


@dataclasses.dataclass
class Cost:
    """Per-device cost of one step. FLOPs and bytes are per device; counts are kernel executions."""

    flops: float = 0.0  # matmul + attention FLOPs
    attention_flops: float = 0.0  # the attention kernels' part of `flops` (cuDNN, Pallas; blockwise: jaxlong.plan.tiles)
    hbm_bytes: float = 0.0  # approximation, see the module docstring
    host_transfer_bytes: float = 0.0  # bytes copied between device and host memory (offload), one way each
    collective_bytes: dict = dataclasses.field(default_factory=dict)  # kind -> bytes (larger buffer)
    collective_wire_bytes: dict = dataclasses.field(default_factory=dict)  # kind -> bytes sent per device
    network_wire_bytes: dict = dataclasses.field(default_factory=dict)  # the part over groups wider than a node
    attention_calls: dict = dataclasses.field(default_factory=dict)  # "forward"/"backward" -> executions
    attention_head_calls: dict = dataclasses.field(default_factory=dict)  # executions x (batch x heads) per call
    # The blockwise kernel's tile loops (bounds are data: counted one iteration per entry), by "forward"/"backward":
    tile_loop_flops: dict = dataclasses.field(default_factory=dict)  # FLOPs of one iteration x entries
    tile_loop_bytes: dict = dataclasses.field(default_factory=dict)  # HBM bytes of one iteration x entries
    tile_loop_entries: dict = dataclasses.field(default_factory=dict)  # times the loop is entered per step
    # The same entries and HBM bytes by "<direction> <FLOPs of one tile over the call's batch x heads>": calls of
    # different shapes (heads per call, tiles) apart, e.g. a local layer's halo call and a global layer's
    tile_loop_groups: dict = dataclasses.field(default_factory=dict)
    tile_loop_group_bytes: dict = dataclasses.field(default_factory=dict)
    # The same over every branch of a conditional too (the counted one and the others): each group's bytes per
    # entry, for calls of a shape a conditional's dearest branch hides (e.g. the global layers' beside the local)
    tile_loop_seen_entries: dict = dataclasses.field(default_factory=dict)
    tile_loop_seen_bytes: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)

    def add(self, other: "Cost", times: float = 1.0) -> None:
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                _accumulate(mine, theirs, times)
            elif not isinstance(mine, list):
                setattr(self, f.name, mine + theirs * times)
        self.warnings += [w for w in other.warnings if w not in self.warnings]


def _accumulate(mine: dict, theirs: dict, times: float = 1.0) -> None:
    for k, v in theirs.items():
        mine[k] = mine.get(k, 0) + v * times


def _group_size(ins: Instr, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", ins.attrs)
    if m:
        return max(len(m.group(1).split(",")), 1)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", ins.attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", ins.attrs)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", m.group(2)))
    return default


class _Walker:
    def __init__(self, comps: dict[str, list[Instr]], devices: int, node_size: int | None,
                 tile_frames: frozenset[int] = frozenset(), caller_frames: frozenset[int] = frozenset()):
        self.comps, self.devices, self.node_size, self.memo = comps, devices, node_size or devices, {}
        self.by_name = {c: {i.name: i for i in body} for c, body in comps.items()}
        self.tile_frames = tile_frames  # stack frames of the blockwise kernel (`source_frames`)
        self.caller_frames = caller_frames  # frames of KERNEL_CALLERS' ops and what they call

    def is_tile_loop(self, ins: Instr) -> bool:
        """A loop of the blockwise kernel whose bounds are data (no trip count known to XLA): traced by the kernel
        (its frame in BLOCKWISE_SOURCE), or by an op of KERNEL_CALLERS (its frame there or below it) with a tile's
        matmuls in its body (2: forward, 5: backward). A tile loop may have one constant bound (the backward's last
        query tile without a window), never both."""
        frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
        if frame is None or "known_trip_count" in ins.backend_config():
            return False
        if int(frame.group(1)) in self.tile_frames:
            return True
        return int(frame.group(1)) in self.caller_frames and self.matmuls(ins.attr("body")) in (2, 5)

    def matmuls(self, comp: str) -> int:
        """Matmul ops in a computation and the fusions and calls it makes (not in its loops)."""
        n = 0
        for ins in self.comps.get(comp, []):
            if ins.op in ("fusion", "call", "async-start"):
                n += self.matmuls(ins.attr("calls") or ins.attr("to_apply"))
            elif ins.op != "while" and self.instr_flops(comp, ins, Cost()) > 0:
                n += 1
        return n

    def tile_loop(self, ins: Instr, top: bool, c: Cost) -> None:
        """One iteration per entry of a tile loop of the blockwise kernel, recorded by direction: FlashAttention-2's
        forward does 2 matmuls per tile (QK^T, PV), its backward 5 (QK^T, dV, dP, dK, dQ)."""
        body = self.cost(ins.attr("body"), top)
        c.add(body)
        kind = {2: "forward", 5: "backward"}.get(self.matmuls(ins.attr("body")))
        if kind is None:
            c.warnings.append(f"while {ins.name}: a blockwise kernel loop of data-dependent length, counted once")
            return
        group = f"{kind} {body.flops:.0f}"  # the direction and one tile's FLOPs: the kernel call's shape
        for field, key, v in ((c.tile_loop_flops, kind, body.flops), (c.tile_loop_bytes, kind, body.hbm_bytes),
                              (c.tile_loop_entries, kind, 1), (c.tile_loop_groups, group, 1),
                              (c.tile_loop_group_bytes, group, body.hbm_bytes),
                              (c.tile_loop_seen_entries, group, 1), (c.tile_loop_seen_bytes, group, body.hbm_bytes)):
            field[key] = field.get(key, 0) + v

    def shape_of(self, comp: str, name: str) -> list:
        ins = self.by_name[comp].get(name)
        return _shapes(ins.shape) if ins is not None else []

    def trip_count(self, comp: str, ins: Instr, cost: Cost) -> int:
        n = ins.backend_config().get("known_trip_count", {}).get("n")
        if n is not None:
            return int(n)
        n = self.constant_bound(ins)
        if n is not None:
            return n
        cost.warnings.append(f"while {ins.name}: no known trip count, counted once")
        return 1

    def constant_bound(self, ins: Instr) -> int | None:
        """The loop bound: the largest integer constant in the condition or a computation it calls, or None."""
        consts, todo, seen = [], [ins.attr("condition")], set()
        while todo:
            name = todo.pop()
            seen.add(name)
            for i in self.comps.get(name, []):
                if i.op == "constant" and re.fullmatch(r"s(32|64)\[\]", i.shape) and re.fullmatch(r"-?\d+", i.args):
                    consts.append(int(i.args))
                todo += [n for n in (i.attr("calls"), i.attr("to_apply")) if n and n not in seen]
        return max(consts) if consts else None

    def fused_traffic(self, comp: str, ins: Instr) -> float:
        """Bytes a fusion reads and writes: slices of sliced operands, updates of in-place updates."""
        body = self.comps.get(ins.attr("calls"), [])
        body_names = {i.name: i for i in body}
        params = {int(i.args): i.name for i in body if i.op == "parameter" and i.args.strip().isdigit()}
        users: dict[str, list[tuple[Instr, int]]] = {p: [] for p in params.values()}
        view: dict[str, str] = {}  # a bitcast (not the root) of a parameter -> the parameter: its users read it
        for i in body:
            if i.op == "bitcast" and not i.root and i.operands and view.get(i.operands[0], i.operands[0]) in users:
                view[i.name] = view.get(i.operands[0], i.operands[0])
                continue
            for k, o in enumerate(i.operands):
                if view.get(o, o) in users:
                    users[view.get(o, o)].append((i, k))
        total = 0.0
        for k, operand in enumerate(ins.operands):
            full = _bytes(self.shape_of(comp, operand))
            uses = users.get(params.get(k), [])
            if uses and all(u.op in ("dynamic-slice", "slice", "dynamic-update-slice") and j == 0 for u, j in uses):
                # slices read, an in-place update (counted as the output) not read: e.g. an accumulator's tile
                total += min(full, sum(_bytes(_shapes(u.shape)) for u, _ in uses if u.op != "dynamic-update-slice"))
            else:
                total += full
        root = next((i for i in body if i.root), body[-1] if body else None)
        roots = [root] if root is not None and root.op != "tuple" else \
            [body_names.get(o) for o in (root.operands if root else [])]
        out = 0.0
        for r in roots:
            if r is not None and r.op == "dynamic-update-slice":
                upd = body_names.get(r.operands[1])
                out += _bytes(_shapes(upd.shape)) if upd is not None else 0
            elif r is not None:
                out += _bytes(_shapes(r.shape))
        return total + (out if roots else _bytes(_shapes(ins.shape)))

    def cost(self, comp: str, top: bool = True) -> Cost:
        key = (comp, top)
        if key in self.memo:
            return self.memo[key]
        c = Cost()
        for ins in self.comps.get(comp, []):
            op = ins.op
            if op == "while" and self.is_tile_loop(ins):
                self.tile_loop(ins, top, c)
                continue
            if op == "while":
                n = self.trip_count(comp, ins, c)
                c.add(self.cost(ins.attr("body"), top), n)
                continue
            if op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                names = re.findall(r"%([\w.\-]+)", m.group(1)) if m else []
                names += [n for n in (ins.attr("true_computation"), ins.attr("false_computation")) if n]
                branches = [self.cost(b, top) for b in names]
                if branches:
                    dearest = max(branches, key=lambda b: b.flops + b.hbm_bytes)
                    c.add(dearest)
                    for b in branches:  # the other branches' tile loops: their shapes' bytes per entry
                        if b is not dearest:
                            _accumulate(c.tile_loop_seen_entries, b.tile_loop_seen_entries)
                            _accumulate(c.tile_loop_seen_bytes, b.tile_loop_seen_bytes)
                continue
            if op in ("call", "async-start"):
                c.add(self.cost(ins.attr("to_apply") or ins.attr("calls"), top))
                continue
            if op in ("fusion", "fusion-start"):
                c.add(self.cost(ins.attr("calls"), top=False))  # FLOPs (matmuls in GEMM fusions), no bytes
                if top and HOST_SPACE in ins.shape:  # a slice to / an update from host memory: half each way
                    traffic = self.fused_traffic(comp, ins)
                    c.hbm_bytes += traffic / 2
                    c.host_transfer_bytes += traffic / 2
                elif top:
                    c.hbm_bytes += self.fused_traffic(comp, ins)
                continue
            c.flops += self.instr_flops(comp, ins, c)
            kind = next((k for k in COLLECTIVES if op in (k, k + "-start")), None)
            if kind is not None:
                size = self.collective_size(comp, ins)
                n = _group_size(ins, self.devices)
                factor = 1.0 if kind == "collective-permute" else (n - 1) / n * (2 if kind == "all-reduce" else 1)
                c.collective_bytes[kind] = c.collective_bytes.get(kind, 0) + size
                c.collective_wire_bytes[kind] = c.collective_wire_bytes.get(kind, 0) + size * factor
                if n > self.node_size:
                    c.network_wire_bytes[kind] = c.network_wire_bytes.get(kind, 0) + size * factor
            if top and op == "copy-start" and HOST_SPACE in ins.shape:
                c.host_transfer_bytes += sum(_bytes(self.shape_of(comp, o)) for o in ins.operands)
            if top and op not in NO_TRAFFIC and not op.endswith("-done"):
                if op in ("dynamic-slice", "slice"):
                    c.hbm_bytes += 2 * _bytes(_shapes(ins.shape))
                elif op == "dynamic-update-slice" and len(ins.operands) > 1:
                    c.hbm_bytes += 2 * _bytes(self.shape_of(comp, ins.operands[1]))
                else:
                    c.hbm_bytes += _bytes(_shapes(ins.shape)) + sum(_bytes(self.shape_of(comp, o))
                                                                   for o in ins.operands)
        self.memo[key] = c
        return c

    def collective_size(self, comp: str, ins: Instr) -> float:
        inp = sum(_bytes(self.shape_of(comp, o)) for o in ins.operands)
        out = _bytes(_shapes(ins.shape))
        if ins.op.endswith("-start") and ins.shape.startswith("(("):
            out = max(out - inp, 0)  # ((inputs), (outputs)): the output part
        elif ins.op.endswith("-start") and ins.shape.startswith("("):
            out = max(out - inp, inp)
        return max(inp, out)

    def instr_flops(self, comp: str, ins: Instr, c: Cost) -> float:
        op = ins.op
        if op == "dot":
            lhs = self.shape_of(comp, ins.operands[0])
            dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
            k = math.prod(lhs[0][1][int(d)] for d in dims.group(1).split(",") if d) if lhs and dims else 1
            return 2.0 * math.prod(_shapes(ins.shape)[0][1]) * k
        if op == "convolution":
            kernel = self.shape_of(comp, ins.operands[1])
            labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
            if not kernel or not labels:
                return 0.0
            kdims = kernel[0][1]
            o = kdims[labels.group(1).index("o")]
            return 2.0 * math.prod(_shapes(ins.shape)[0][1]) * math.prod(kdims) / max(o, 1)
        if op != "custom-call":
            return 0.0
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        target = target.group(1) if target else ""
        if target.startswith("__cublas"):
            dims = ins.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            lhs = self.shape_of(comp, ins.operands[0])
            k = math.prod(lhs[0][1][int(d)] for d in dims.get("lhs_contracting_dimensions", [])) if lhs else 1
            return 2.0 * math.prod(_shapes(ins.shape)[0][1]) * k
        if target.startswith("__cudnn$fmha"):
            cfg = ins.backend_config().get("cudnn_fmha_backend_config", {})
            inter = [int(x) for x in cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])]
            q = self.shape_of(comp, ins.operands[0])
            d = q[0][1][-1] if q else 0  # head_dim: the query's minor dimension ([B, S, H, D] or [B, H, S, D])
            if len(inter) != 4:
                c.warnings.append(f"{ins.name}: no intermediate_tensor_shape, attention FLOPs not counted")
                return 0.0
            fwd = 4.0 * math.prod(inter) * d * (0.5 if "CAUSAL" in str(cfg.get("mask_type", "")) else 1.0)
            kind = "backward" if "Backward" in target else "forward"
            c.attention_calls[kind] = c.attention_calls.get(kind, 0) + 1
            c.attention_head_calls[kind] = c.attention_head_calls.get(kind, 0) + inter[0] * inter[1]
            flops = fwd * (2.5 if kind == "backward" else 1.0)
            c.attention_flops += flops
            return flops
        kernel = re.search(r"jaxlong_flash_(fwd|bwd_dkdv|bwd_dq)(_causal)?(_kvhm)?/", ins.attrs)
        if target == "__gpu$xla.gpu.triton" and kernel:  # the Pallas attention kernels (jaxlong.kernels.pallas_gpu)
            q, k = self.shape_of(comp, ins.operands[0]), self.shape_of(comp, ins.operands[1])
            if not q or not k or len(q[0][1]) != 4:
                c.warnings.append(f"{ins.name}: Pallas attention operands unreadable, attention FLOPs not counted")
                return 0.0
            (b, sq, h, d), sk = q[0][1], k[0][1][2 if kernel.group(3) else 1]  # _kvhm: k [b, kv, seq, d]
            matmuls = {"fwd": 2, "bwd_dkdv": 4, "bwd_dq": 3}[kernel.group(1)]  # FlashAttention-2 Algorithms 1, 2
            flops = 2.0 * matmuls * b * h * sq * sk * d * (0.5 if kernel.group(2) else 1.0)
            if kernel.group(1) != "bwd_dq":  # one call per direction, as cuDNN's
                kind = "forward" if kernel.group(1) == "fwd" else "backward"
                c.attention_calls[kind] = c.attention_calls.get(kind, 0) + 1
                c.attention_head_calls[kind] = c.attention_head_calls.get(kind, 0) + b * h
            c.attention_flops += flops
            return flops
        return 0.0


def hlo_cost(text: str, devices: int = 1, node_size: int | None = None) -> Cost:
    """Per-device cost of one execution of the compiled HLO module `text` (`compiled.as_text()`).

    Args:
      text: the optimized HLO module text.
      devices: the default collective group size, for collectives whose replica groups are not written out.
      node_size: devices per node; collectives over wider groups are counted in `network_wire_bytes`
        (default: one node of `devices`).

    Returns:
      `Cost`: FLOPs, attention FLOPs, HBM bytes (approximation), collective bytes and wire bytes by kind,
      attention kernel executions by kind ("forward", "backward") and the same weighted by the (batch x heads)
      of each call, and warnings (uncounted loops).

    Raises:
      ValueError: the text has no ENTRY computation.
    """
    comps, entry = parse_module(text)
    return _Walker(comps, devices, node_size, source_frames(text, BLOCKWISE_SOURCE),
                   source_frames(text, KERNEL_CALLERS, callers=True)).cost(entry)


EFFICIENCY = 0.6  # fraction of peak FLOP/s that matmuls and flash attention sustain at long sequences
EXPOSED = ("all-to-all",)  # on the critical path: attention waits for its operands
RING = ("collective-permute",)  # ring attention's K/V and dK/dV sends: each issued before the block it overlaps
OVERLAPPED = ("all-gather", "reduce-scatter", "all-reduce")  # FSDP: asynchronous, prefetched across layers


def roofline(cost: Cost, *, peak_flops: float, hbm_bandwidth: float, link_bandwidth: float,
             network_bandwidth: float | None, model_flops: float, tokens: int, devices: int,
             efficiency: float = EFFICIENCY, pcie_bandwidth: float | None = None) -> dict:
    """Roofline estimate of one step's time from its compiled cost (all per device). An estimate, not a
    measurement: the assumptions are returned with it.

    time = max(FLOPs / (peak_flops x efficiency), HBM bytes / hbm_bandwidth)
           + all-to-all wire bytes / link bandwidth                               (exposed: not overlapped)
           + max(0, collective-permute time - attention FLOPs / (peak x efficiency))  (ring: overlapped)
           + max(0, FSDP all-gather/reduce-scatter/all-reduce time - the compute time above)   (overlapped)
           + max(0, host offload transfer bytes / pcie_bandwidth - the compute time above)      (overlapped)

    Each collective's wire bytes go at the link bandwidth inside a node and at `network_bandwidth` over groups
    wider than a node (`Cost.network_wire_bytes`). Ring attention (`jaxlong.parallel.ring`) sends the next K/V
    block (and, backward, the dK/dV accumulator) before it runs the current block's attention, so its
    collective-permutes overlap the attention kernels and only their excess is exposed.

    Args:
      cost: `hlo_cost` of the compiled step (per device).
      peak_flops: dense bf16 FLOP/s per device. hbm_bandwidth: bytes/s per device.
      link_bandwidth: NVLink bytes/s per direction per device; network_bandwidth: inter-node bytes/s per device
        (collectives over groups wider than a node; None: the link bandwidth).
      model_flops: the step's model FLOPs per device (`jaxlong.training.metrics.flops_per_token` x tokens / devices).
      tokens: tokens per step (global batch x sequence length). devices: devices of the step.
      efficiency: the fraction of `peak_flops` sustained (default `EFFICIENCY`).
      pcie_bandwidth: host <-> device bytes/s per device for offloaded residuals (None: not timed).

    Returns:
      dict: `flops`, `attention_flops`, `model_flops` (FLOPs per device per step), `recompute_factor` (compiled
      / model FLOPs), `hbm_bytes`, `collective_bytes` (bytes per device per step, all kinds; by kind in
      `collective_bytes_by_kind`), `link_wire_bytes` and `network_wire_bytes` (wire bytes inside a node and
      between nodes), `ring_seconds` and `ring_exposed_seconds` (collective-permutes: all, and not hidden behind
      attention), `attention_calls`, `attention_head_calls` (per step), `compute_seconds`,
      `memory_seconds`, `host_seconds` (offload transfers), `exposed_seconds` (collectives and transfers not
      hidden), `step_seconds`, `tokens_per_s_per_gpu`, `mfu` (model
      FLOPs / step time / peak), `bound` ("compute" or "memory"), `assumptions` (text), `warnings`.

    Raises:
      ValueError: a bandwidth or peak is missing or not positive.
    """
    if not (peak_flops and hbm_bandwidth and link_bandwidth and peak_flops > 0 and efficiency > 0):
        raise ValueError("the estimate needs the target's peak FLOP/s, HBM and link bandwidth")
    network = network_bandwidth or link_bandwidth

    def seconds(kinds):
        return sum((cost.collective_wire_bytes.get(k, 0) - cost.network_wire_bytes.get(k, 0)) / link_bandwidth
                   + cost.network_wire_bytes.get(k, 0) / network for k in kinds)

    compute = cost.flops / (peak_flops * efficiency)
    memory = cost.hbm_bytes / hbm_bandwidth
    busy = max(compute, memory)
    attention = cost.attention_flops / (peak_flops * efficiency)
    ring = seconds(RING)
    exposed = seconds(EXPOSED) + max(0.0, ring - attention) + max(0.0, seconds(OVERLAPPED) - busy)
    host = cost.host_transfer_bytes / pcie_bandwidth if pcie_bandwidth else 0.0
    exposed += max(0.0, host - busy)
    step = busy + exposed
    return {
        "flops": cost.flops, "attention_flops": cost.attention_flops, "model_flops": model_flops,
        "recompute_factor": cost.flops / model_flops if model_flops else float("nan"),
        "hbm_bytes": cost.hbm_bytes, "host_transfer_bytes": cost.host_transfer_bytes,
        "collective_bytes": sum(cost.collective_bytes.values()),
        "collective_bytes_by_kind": dict(cost.collective_bytes),
        "network_wire_bytes": sum(cost.network_wire_bytes.values()),
        "link_wire_bytes": sum(cost.collective_wire_bytes.values()) - sum(cost.network_wire_bytes.values()),
        "ring_seconds": ring, "ring_exposed_seconds": max(0.0, ring - attention),
        "attention_calls": dict(cost.attention_calls), "attention_head_calls": dict(cost.attention_head_calls),
        "compute_seconds": compute, "memory_seconds": memory, "host_seconds": host, "exposed_seconds": exposed,
        "step_seconds": step, "tokens_per_s_per_gpu": tokens / step / devices,
        "mfu": model_flops / step / peak_flops, "bound": "compute" if compute >= memory else "memory",
        "assumptions": assumptions(peak_flops, hbm_bandwidth, link_bandwidth, network_bandwidth, efficiency,
                                   pcie_bandwidth),
        "warnings": list(cost.warnings),
    }


def assumptions(peak_flops, hbm_bandwidth, link_bandwidth, network_bandwidth, efficiency,
                pcie_bandwidth=None) -> str:
    """The estimate's assumptions, one per line, for printing under its table."""
    net = f"{network_bandwidth / 1e9:.0f} GB/s between nodes" if network_bandwidth else "one node"
    return "\n".join([
        "Estimate, not a measurement: roofline of the compiled step (XLA's GPU compile, its HLO counted).",
        f"Compute: matmul + attention FLOPs at {efficiency:.0%} of {peak_flops / 1e12:.0f} TFLOP/s dense bf16 "
        "(cuDNN: backward = 2.5x forward; Pallas, for packed documents: forward 2, backward 7 matmuls, counted as "
        "dense causal, an upper bound; causal = half; blockwise: the score tiles it computes per layer kind, causal "
        "or windowed, backward = 2.5x forward, jaxlong.plan.tiles); elementwise work is left to the memory term.",
        f"Memory: operand + output bytes of each top-level kernel at {hbm_bandwidth / 1e12:.2f} TB/s (approximation: "
        "no cache reuse); step = max(compute, memory) + exposed collectives.",
        f"Collectives: ring/pairwise wire bytes at {link_bandwidth / 1e9:.0f} GB/s NVLink per direction inside a node, "
        f"{net}; all-to-all exposed (attention waits for it); ring attention's collective-permutes hidden behind "
        "the attention kernels (each is sent before the block it overlaps; only their excess counts); FSDP "
        "all-gather/reduce-scatter/all-reduce hidden behind compute (only their excess counts).",
        (f"Offload: residual copies to/from host memory at {pcie_bandwidth / 1e9:.0f} GB/s (PCIe) hidden behind "
         "compute (only their excess counts)." if pcie_bandwidth else "Offload transfers: not timed."),
        "Not modelled: kernel launch gaps, load imbalance, the data pipeline.",
        "Model FLOPs: jaxlong.training.metrics.flops_per_token (6 x matmul params + causal attention 6 x layers x S x heads x "
        "head_dim; a sliding-window layer's attention over its window, jaxlong.plan.tiles) x tokens; MFU = model FLOPs "
        "/ step time / peak.",
    ])


def significant(x: float) -> str:
    """Three significant digits below 100, whole numbers with thousands separators above."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def format_estimate_table(rows: list[dict]) -> str:
    """Markdown table of the `estimate` of each row (a plan with `name`, `seq_len` and `estimate`), per device
    and per step; the assumptions of the first row under it."""
    head = ("| rung | seq_len | step FLOPs (T) | model FLOPs (T) | recompute | HBM bytes (GB) | collective bytes (GB) "
            "| wire NVLink / network (GB) | ring exposed (s) | attention calls fwd / bwd | est. step (s) "
            "| est. tokens/s per GPU | est. MFU |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        e = r.get("estimate")
        if not e:
            continue
        calls = e["attention_calls"]
        lines.append(
            f"| {r['name']} | {r.get('seq_len', 0):,} | {significant(e['flops'] / 1e12)} | {significant(e['model_flops'] / 1e12)} | "
            f"{e['recompute_factor']:.2f} | {significant(e['hbm_bytes'] / 1e9)} | {significant(e['collective_bytes'] / 1e9)} | "
            f"{significant(e.get('link_wire_bytes', 0) / 1e9)} / {significant(e.get('network_wire_bytes', 0) / 1e9)} | "
            f"{significant(e.get('ring_exposed_seconds', 0))} | "
            f"{calls.get('forward', 0):.0f} / {calls.get('backward', 0):.0f} | {significant(e['step_seconds'])} | "
            f"{significant(e['tokens_per_s_per_gpu'])} | {e['mfu']:.1%} |")
    first = next((r["estimate"] for r in rows if r.get("estimate")), None)
    notes = "" if first is None else "\n\nEstimate, per device per step. Assumptions:\n" + "\n".join(
        f"- {line}" for line in first["assumptions"].splitlines())
    warn = sorted({w for r in rows if r.get("estimate") for w in r["estimate"]["warnings"]})
    return "\n".join(lines) + notes + ("\n- warnings: " + "; ".join(warn) if warn else "")
