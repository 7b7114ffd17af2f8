"""The device mesh and how parameters, optimizer state and activations are laid out on it.

Mesh axes (in this order): `data` (pure data parallelism), `fsdp` (ZeRO-3 parameter sharding; the batch is
also split over it), `ring` (ring attention, `jaxlong.parallel.ring`: the across-node part of context parallelism) and
`context` (Ulysses context parallelism: attention re-splits heads over it with an all-to-all). The sequence
axis of activations is split over `ring` x `context` (`SEQ_AXES`, ring-major); with ring > 1 the sequence is
in the zigzag layout (`jaxlong.core.batch.zigzag_order`), so ring rank r's `S/R` tokens are chunks r and 2R-1-r.

FSDP (ZeRO-3, arXiv 1910.02054, §5): every parameter, its gradient and its optimizer state are sharded over all
devices of `fsdp` x `ring` x `context` together (`FSDP_AXES`). The rule is per leaf: the most major dimension
divisible by that device count is split (for stacked decoder weights the leading layer dimension is never
split, so a `lax.scan` over layers sees a sharded slice and gathers one layer at a time). Splitting the most
major dimension makes each layer's all-gather and reduce-scatter act on contiguous blocks: with a minor
dimension split, XLA's GPU compiler keeps a transposed copy of the whole stacked weight for the gathers, alive
for the whole step (two `[layers, 4096, 14336/8]` float32 copies, 1.75 GiB per device, for Llama-3-8B's MLP).
A leaf with no divisible
dimension stays replicated; `describe_param_sharding` lists those.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError

AXES = ("data", "fsdp", "ring", "context")
FSDP_AXES = ("fsdp", "ring", "context")  # parameters are sharded over these (ZeRO-3 over the model-parallel group)
BATCH_AXES = ("data", "fsdp")  # the batch dimension of activations
RING_AXIS = "ring"  # ring attention (across nodes)
CONTEXT_AXIS = "context"  # Ulysses all-to-alls (inside a node)
SEQ_AXES = (RING_AXIS, CONTEXT_AXIS)  # the sequence dimension of activations


@dataclass
class MeshConfig:
    """Device mesh `data x fsdp x ring x context`. -1 on one axis means "all remaining devices".

    The sequence is split over `ring` x `context`: Ulysses all-to-alls over `context` (inside a node), ring
    attention over `ring` (across nodes; `jaxlong.parallel.ring`). With ring > 1 both `attention.impl`s run as hybrids.

    `num_devices` is the number of simulated devices when the platform is the CPU (the entry point sets
    `--xla_force_host_platform_device_count` before importing jax); on GPUs the real device count is used.
    """

    data: int = 1
    fsdp: int = -1
    ring: int = 1
    context: int = 4
    num_devices: int = 8


def check_mesh(m: MeshConfig) -> None:
    """The mesh section's own rule: a positive device count. That the axes multiply to it is `resolve_mesh_shape`'s.

    Raises:
      ConfigError: `mesh.num_devices` not positive.
    """
    if m.num_devices <= 0:
        raise ConfigError(f"mesh.num_devices={m.num_devices} must be a positive device count")


def seq_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the sequence is split over: `SEQ_AXES`, or only those the mesh has (e.g. a
    `data x fsdp x context` mesh built by hand)."""
    return tuple(a for a in SEQ_AXES if a in mesh.axis_names)


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis `name`, 1 if the mesh has no such axis."""
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


def seq_shards(mesh) -> int:
    """Devices the sequence is split over: ring x context."""
    return axis_size(mesh, RING_AXIS) * axis_size(mesh, CONTEXT_AXIS)


def resolve_mesh_shape(mesh, num_devices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, ring, context) of `mesh` (a `MeshConfig`) with a -1 axis filled so the product is `num_devices`.

    Raises:
      ConfigError: the axes do not multiply to the device count, or more than one axis is -1.
    """
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "ring": mesh.ring, "context": mesh.context}
    free = [k for k, v in sizes.items() if v == -1]
    axes = tuple(f"mesh.{k}" for k in ("context", "ring", "fsdp", "data"))  # the usual order of a fix
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise ConfigError(f"mesh.{k}={v}: an axis size must be a positive integer or -1 (fill)", key=f"mesh.{k}",
                              value=v)
    if len(free) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + k for k in free)}",
                          key=f"mesh.{free[-1]}", value=-1, keys=tuple(f"mesh.{k}" for k in free[:-1]))
    fixed = int(np.prod([v for v in sizes.values() if v != -1]))
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh: {num_devices} devices are not divisible by the fixed axes' product {fixed} "
                f"(data={mesh.data}, fsdp={mesh.fsdp}, ring={mesh.ring}, context={mesh.context})",
                key="mesh.num_devices", value=num_devices, keys=axes)
        sizes[free[0]] = num_devices // fixed
    total = sizes["data"] * sizes["fsdp"] * sizes["ring"] * sizes["context"]
    if total != num_devices:
        raise ConfigError(
            f"mesh: data*fsdp*ring*context = {sizes['data']}*{sizes['fsdp']}*{sizes['ring']}*{sizes['context']} "
            f"= {total}, but there are {num_devices} devices (-1 on one axis fills)", key="mesh.num_devices",
            value=num_devices, keys=axes)
    return sizes["data"], sizes["fsdp"], sizes["ring"], sizes["context"]


def run_devices(cfg) -> list:
    """The devices a run's mesh spans (`cfg` a `jaxlong.core.mesh.MeshConfig`): on the CPU in one process, the first
    `mesh.num_devices` simulated devices (XLA_FLAGS may have asked for more, e.g. in a test process, and a
    `mesh.num_devices` override means what it says); on GPUs, and in a launch of several processes (where
    `mesh.num_devices` sets each process's share), every device."""
    devices = jax.devices()
    if jax.default_backend() == "cpu" and jax.process_count() == 1 and 0 < cfg.num_devices < len(devices):
        return devices[:cfg.num_devices]
    return devices


def build_mesh(cfg, devices: list | None = None) -> jax.sharding.Mesh:
    """A `data x fsdp x ring x context` mesh over `devices` (default: `run_devices(cfg)`), with Auto axis types;
    `cfg` is a `jaxlong.core.mesh.MeshConfig`.

    Raises:
      ConfigError: the axis sizes do not multiply to the device count.
    """
    devices = list(run_devices(cfg) if devices is None else devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def mesh_processes(mesh: jax.sharding.Mesh) -> np.ndarray:
    """The process index of each device of `mesh`, an int array of the mesh's shape (`[data, fsdp, ring, context]`)."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def process_layout_error(processes: np.ndarray, names=AXES) -> str | None:
    """Why a mesh cannot be split over the processes of a launch, or None when it can.

    Args:
      processes: int array of the mesh's shape, the process of each device (`mesh_processes`, or a simulated layout
        in tests).
      names: the mesh's axis names, major to minor.

    Every process must hold the same number of devices, and they must form a block of the mesh (a range of each
    axis): then each process feeds its devices from the rows and sequence slices it builds
    (`jaxlong.core.batch.process_rows`), and an axis either stays inside processes (context: Ulysses inside a
    node) or spans them in equal parts (ring across nodes). Devices are taken process by process, so a block needs
    the devices per process to fill whole minor axes and an equal part of the next one; the message names the axis
    they cut unevenly.
    """
    procs, counts = np.unique(processes, return_counts=True)
    if procs.size == 1:
        return None
    sizes = dict(zip(names, processes.shape))
    mesh_text = " ".join(f"mesh.{k}={v}" for k, v in sizes.items())
    if len(set(counts.tolist())) > 1:
        held = ", ".join(f"process {p}: {c}" for p, c in zip(procs, counts))
        return (f"the {procs.size} processes of this launch hold different numbers of the mesh's devices ({held}); "
                f"every process must drive as many devices (one process per node, or one per GPU)")
    per = int(counts[0])
    left = per
    for name in reversed(names):  # minor to major: the devices of one process fill whole minor axes first
        size = sizes[name]
        if left % size == 0:
            left //= size
            continue
        if size % left:
            return (f"{mesh_text} cannot be split over the {procs.size} processes of this launch ({per} devices "
                    f"each): mesh.{name}={size} would be cut unevenly between processes; choose the axes so that "
                    f"each process's {per} devices fill whole minor axes (context, then ring, fsdp, data) and an "
                    f"equal part of the next, e.g. mesh.context={per} mesh.ring={procs.size} on one process per node")
        break
    shape = None
    for p in procs:
        where = np.argwhere(processes == p)
        block = tuple((where.max(0) - where.min(0) + 1).tolist())
        if int(np.prod(block)) != len(where) or (shape is not None and block != shape):
            return (f"{mesh_text}: the devices of process {p} do not form a block of the mesh (the device order "
                    f"interleaves processes); launch one process per node or per GPU with the devices in order")
        shape = block
    return None


def check_process_layout(mesh: jax.sharding.Mesh) -> None:
    """`process_layout_error` of a built mesh.

    Raises:
      ConfigError: the mesh cannot be split over the processes of this launch (the message says why)."""
    error = process_layout_error(mesh_processes(mesh), mesh.axis_names)
    if error:
        raise ConfigError(error)


def batch_spec() -> P:
    """`[batch, seq]` token arrays and `[batch, seq, ...]` activations: batch over data x fsdp, seq over
    ring x context."""
    return P(BATCH_AXES, SEQ_AXES)


def activation_spec() -> P:
    """`[batch, seq, hidden]` activations."""
    return P(BATCH_AXES, SEQ_AXES, None)


def param_spec(shape: tuple[int, ...], n_shards: int, stacked: bool) -> P:
    """ZeRO-3 spec of one leaf: the most major dimension divisible by `n_shards` is split over `FSDP_AXES`.

    `stacked`: the leaf has a leading layer dimension (never split). Scalars and leaves with no divisible
    dimension are replicated (`P()`).
    """
    spec: list = [None] * len(shape)
    if n_shards == 1 or not shape:
        return P(*spec)
    first = 1 if stacked else 0
    best = next((i for i in range(first, len(shape)) if shape[i] % n_shards == 0), None)
    if best is not None:
        spec[best] = FSDP_AXES
    return P(*spec)


def _is_stacked(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == "layers" for k in path)


def tree_shardings(mesh: jax.sharding.Mesh, tree) -> object:
    """`NamedSharding`s for a parameter-like tree (params, gradients, optimizer state), leaf by leaf.

    Works on optimizer state too: optax's moment trees contain the parameter paths (with `layers` for the
    stacked decoder weights), and counters are scalars (replicated).
    """
    n = int(np.prod([axis_size(mesh, a) for a in FSDP_AXES]))  # the devices each leaf is split over

    def one(path, leaf):
        return NamedSharding(mesh, param_spec(tuple(np.shape(leaf)), n, _is_stacked(path)))

    return jax.tree_util.tree_map_with_path(one, tree)


def describe_param_sharding(mesh: jax.sharding.Mesh, params) -> list[str]:
    """Human-readable lines `path shape -> spec`, replicated leaves marked, for logs and docs."""
    shardings = jax.tree.leaves(tree_shardings(mesh, params))
    return [f"{jax.tree_util.keystr(path)} {tuple(np.shape(leaf))} -> {sh.spec}"
            + ("  (replicated: too small to split)" if all(s is None for s in sh.spec) else "")
            for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0], shardings)]


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
