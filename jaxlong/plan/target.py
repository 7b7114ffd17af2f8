"""GPU targets for planning without a GPU: XLA's GPU compiler run for a described device topology.

XLA can compile for an NVIDIA GPU topology on a machine with no GPU and no driver: the CUDA PJRT plugin
(`pip install "jax[cuda12]"`) takes a `GpuTargetConfigProto` text that describes the device (memory size,
compute capability, core geometry, cuDNN version) and returns compile-only devices; a mesh over them lowers
and compiles the real train step, with the GPU compiler's fusion, scheduling, rematerialization and buffer
assignment. `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT,
topology="1x<nodes>x<devices per node>")`.

Shipped targets (`specs/*.txtpb`, each file names its source):

  h100   NVIDIA H100 80GB HBM3 (SXM), 84,942,979,072 bytes, sm_90a, 989 TFLOP/s dense bf16, 3.35 TB/s, NVLink 450 GB/s
  h200   NVIDIA H200 141GB HBM3e,     151,397,597,184 bytes, sm_90a, 989 TFLOP/s dense bf16, 4.8 TB/s,  NVLink 450 GB/s
  a100   NVIDIA A100-SXM4-80GB,       85,100,068,864 bytes, sm_80,  312 TFLOP/s dense bf16, 2.04 TB/s, NVLink 300 GB/s
  (NVLink per direction per GPU; between nodes 50 GB/s per H100/H200, 25 GB/s per A100: one NIC per GPU.)

The protos are XLA's own (openxla/xla `xla/backends/gpu/target_config/specs/`), with the one field jaxlib 0.10's
proto rejects (`collective_memory_granularity`) removed; it is also dropped from user-given files. Peak FLOP/s
are NVIDIA's datasheet numbers for dense bf16 (the proto carries no FLOP/s figure we rely on).

Facts learned the hard way (jax 0.10.2):
- The proto needs the full `gpu_device_info` geometry: with only memory size and compute capability the
  compiler dies with SIGFPE (a crash, not an error), so `load_spec` checks the fields first.
- `JAX_PLATFORMS` must not make jax initialize the CUDA backend: without a driver the plugin's `cuInit` fails
  and the plugin never registers. `compile_only_devices` therefore requires `JAX_PLATFORMS=cpu` when no GPU
  is present (`jaxlong.memory` sets it).
- Compile-only devices have no memories: a `NamedSharding(memory_kind="pinned_host")` silently becomes device
  memory, while remat-policy offload (memory-space annotations) works and is reported as
  `host_temp_size_in_bytes`.
- XLA's GPU rematerialization pass plans against the proto's `device_memory_size`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from jaxlong.core.errors import ConfigError
from jaxlong.core.units import GiB
from jaxlong.training.metrics import PEAK_FLOPS

SPEC_DIR = Path(__file__).parent / "specs"

# name -> (spec file, dense bf16 peak FLOP/s per device (`jaxlong.training.metrics.PEAK_FLOPS`), HBM bandwidth
# bytes/s, NVLink bytes/s per direction per device, inter-node network bytes/s per device). Sources: NVIDIA H100
# datasheet (SXM5: 3.35 TB/s HBM3, NVLink 900 GB/s bidirectional); H200 datasheet (SXM: 4.8 TB/s HBM3e,
# NVLink 900 GB/s); A100 datasheet (SXM4 80GB: 2,039 GB/s, NVLink 600 GB/s);
# inter-node: one NDR InfiniBand NIC (400 Gb/s) per H100/H200 as in DGX H100/H200, one HDR NIC (200 Gb/s) per
# A100 as in DGX A100.
TARGETS = {
    "h100": ("h100_sxm_80gb.txtpb", PEAK_FLOPS["H100"], 3.35e12, 450e9, 50e9),
    "h200": ("h200_141gb.txtpb", PEAK_FLOPS["H200"], 4.8e12, 450e9, 50e9),
    "a100": ("a100_sxm_80gb.txtpb", PEAK_FLOPS["A100"], 2.04e12, 300e9, 25e9),
}

# gpu_device_info fields without which XLA's GPU compiler crashes or plans wrongly (present in every XLA spec).
REQUIRED_FIELDS = (
    "threads_per_block_limit", "threads_per_warp", "shared_memory_per_block", "shared_memory_per_core",
    "threads_per_core_limit", "core_count", "fpus_per_core", "block_dim_limit_x", "block_dim_limit_y",
    "block_dim_limit_z", "memory_bandwidth", "l2_cache_size", "clock_rate_ghz", "device_memory_size",
    "shared_memory_per_block_optin", "cuda_compute_capability", "registers_per_core_limit",
    "registers_per_block_limit", "thread_dim_limit_x", "thread_dim_limit_y", "thread_dim_limit_z",
)
UNSUPPORTED_FIELDS = ("collective_memory_granularity",)  # jaxlib 0.10's GpuTargetConfigProto rejects it


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU cluster to plan for: `nodes` nodes of `devices_per_node` identical GPUs.

    Attributes:
      name: the target's short name (`h100`) or the spec file's path.
      spec: the `GpuTargetConfigProto` text (checked by `load_spec`).
      devices_per_node, nodes: the topology; `devices` = their product.
      device_memory: bytes of memory per GPU (`device_memory_size` of the spec).
      device_name: the GPU's name from the spec.
      peak_flops: dense bf16 FLOP/s per GPU (None when unknown, e.g. a user's spec file).
      hbm_bandwidth: bytes/s per GPU.
      link_bandwidth: NVLink bytes/s per direction per GPU, inside a node (None when unknown).
      network_bandwidth: inter-node bytes/s per direction per GPU (None when unknown).
      pcie_bandwidth: host <-> GPU bytes/s (the spec's `pcie_bandwidth`; None when absent).
    """

    name: str
    spec: str
    devices_per_node: int
    nodes: int
    device_memory: int
    device_name: str
    peak_flops: float | None = None
    hbm_bandwidth: float | None = None
    link_bandwidth: float | None = None
    network_bandwidth: float | None = None
    pcie_bandwidth: float | None = None

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def topology(self) -> str:
        """The topology string of `get_topology_desc`: `1x<nodes>x<devices per node>`."""
        return f"1x{self.nodes}x{self.devices_per_node}"

    def describe(self) -> str:
        where = f"{self.nodes} nodes x {self.devices_per_node}" if self.nodes > 1 else f"{self.devices_per_node}"
        return f"{where} x {self.device_name} ({self.device_memory / GiB:.1f} GiB each)"


def _field(text: str, name: str) -> str | None:
    m = re.search(rf"^\s*{name}\s*[:{{]\s*(\"[^\"]*\"|[^\s}}]*)", text, re.MULTILINE)
    return None if m is None else m.group(1).strip('"')


def load_spec(text: str, source: str = "target spec") -> str:
    """Check a `GpuTargetConfigProto` text and return it without the fields jaxlib 0.10 rejects.

    Raises:
      ConfigError: a required `gpu_device_info` field is missing (named), or the platform is not CUDA.
    """
    text = "\n".join(line for line in text.splitlines()
                     if not any(line.strip().startswith(f) for f in UNSUPPORTED_FIELDS))
    if "gpu_device_info" not in text:
        raise ConfigError(f"{source}: not a GpuTargetConfigProto text: it has no gpu_device_info block")
    missing = [f for f in REQUIRED_FIELDS if _field(text, f) is None]
    if missing:
        raise ConfigError(
            f"{source}: gpu_device_info lacks {', '.join(missing)}; XLA's GPU compiler needs the full device "
            f"geometry (copy the missing fields from a spec in {SPEC_DIR} or XLA's target_config/specs)"
        )
    platform = _field(text, "platform_name")
    if platform is not None and platform.upper() != "CUDA":
        raise ConfigError(f"{source}: platform_name is {platform!r}; only CUDA targets can be planned")
    return text


def parse_target(text: str) -> Target:
    """`h100`, `h100:8`, `h100:8x2` (devices per node, nodes), or `PATH.txtpb[:8][x2]` -> `Target`.

    Raises:
      ConfigError: unknown name, malformed counts, unreadable or incomplete spec file.
    """
    m = re.fullmatch(r"(.+?)(?::(\d+))?(?:x(\d+))?", text.strip())
    if m is None or not m.group(1):
        raise ConfigError(f"--target {text!r}: expected NAME[:DEVICES_PER_NODE][xNODES], e.g. h100:8x2")
    name, per_node, nodes = m.group(1), int(m.group(2) or 8), int(m.group(3) or 1)
    if per_node < 1 or nodes < 1:
        raise ConfigError(f"--target {text!r}: devices per node and nodes must be positive")
    if name.lower() in TARGETS:
        file, flops, bandwidth, link, network = TARGETS[name.lower()]
        path = SPEC_DIR / file
        name = name.lower()
    elif name.endswith((".txtpb", ".pbtxt", ".txt")):
        path, flops, bandwidth, link, network = Path(name), None, None, None, None
        if not path.is_file():
            raise ConfigError(f"--target {text!r}: spec file {path} does not exist")
    else:
        raise ConfigError(f"--target {text!r}: unknown GPU; choose one of {', '.join(TARGETS)} or give a "
                          f"GpuTargetConfigProto .txtpb file")
    spec = load_spec(path.read_text(), str(path))
    memory = int(_field(spec, "device_memory_size"))
    device_name = _field(spec, "device_description_str") or _field(spec, "name") or name
    if bandwidth is None:
        bandwidth = float(_field(spec, "memory_bandwidth"))
    pcie = _field(spec, "pcie_bandwidth")
    return Target(name, spec, per_node, nodes, memory, device_name, flops, bandwidth, link, network,
                  float(pcie) if pcie else None)


def cuda_plugin_available() -> bool:
    """Whether the CUDA PJRT plugin (`jax[cuda12]`) is installed, without importing jax."""
    import importlib.util  # noqa: PLC0415

    return any(importlib.util.find_spec(m) is not None for m in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"))


def compile_only_devices(target: Target) -> list:
    """Compile-only devices of `target` (nothing is allocated; no GPU needed).

    Raises:
      ConfigError: the CUDA plugin is missing, or jax was started so that the plugin could not register.
    """
    if not cuda_plugin_available():
        raise ConfigError(f"--target {target.name}: planning for a GPU without one needs the CUDA plugin: "
                          f"pip install 'jax[cuda12]' (about 3 GB), then run again")
    from jax.experimental import topologies  # noqa: PLC0415

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.spec, topology=target.topology)
    except Exception as e:  # noqa: BLE001 (the plugin reports registration problems as several types)
        hint = "" if os.environ.get("JAX_PLATFORMS") == "cpu" else " (set JAX_PLATFORMS=cpu before jax creates a backend)"
        raise ConfigError(f"--target {target.name}: the CUDA plugin could not describe the topology{hint}: {e}") from e
    return list(topo.devices)
