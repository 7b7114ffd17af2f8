"""Reading compiled memory: per-device bytes from `Compiled.memory_analysis()`, and device memory in use."""

from __future__ import annotations

import jax

from jaxlong.core.units import fmt_bytes


def compiled_bytes(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program: arguments, outputs, temporaries, aliased (donated) bytes,
    host-side counterparts, and `peak` = argument + output + temp - alias (XLA's own estimate; best-effort)."""
    m = compiled.memory_analysis()
    out = {k: getattr(m, f"{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias")}
    out |= {f"host_{k}": getattr(m, f"host_{k}_size_in_bytes", 0) for k in ("argument", "output", "temp")}
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def format_compiled(compiled, title: str = "train step") -> str:
    b = compiled_bytes(compiled)
    return (
        f"{title}, per device (compiled memory_analysis): arguments {fmt_bytes(b['argument'])}, "
        f"outputs {fmt_bytes(b['output'])} (donated/aliased {fmt_bytes(b['alias'])}), "
        f"temporaries {fmt_bytes(b['temp'])}, peak ≈ {fmt_bytes(b['peak'])}"
    )


def device_memory() -> dict[str, int]:
    """`bytes_in_use` and `peak_bytes_in_use` of the first local device; empty where the backend has no stats
    (the CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


def free_per_device(devices) -> int | None:
    """Bytes free on each of `devices` (the least of them) for one more buffer per device: `bytes_limit -
    bytes_in_use` where the backend reports them (GPUs); for CPU devices, which share this host's memory, the
    host's available memory (`MemAvailable`, or the cgroup's room when less) divided among them. None where
    neither is known."""
    cpus = [d for d in devices if d.platform == "cpu"]
    if cpus:
        room = _host_available()
        return room // len(cpus) if room is not None else None
    free = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free) if free else None


def _host_available() -> int | None:
    """The host memory a new allocation can still take (Linux: `MemAvailable`, capped by the room the container's
    cgroup v2 leaves, `memory.max - memory.current` plus its reclaimable page cache, `inactive_file`); None
    elsewhere."""
    meminfo = _read("/proc/meminfo")
    if meminfo is None:
        return None
    avail = next((1024 * int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:")),
                 None)
    limit, used, stat = (_read(f"/sys/fs/cgroup/memory.{k}") for k in ("max", "current", "stat"))
    if avail is not None and limit and limit.strip().isdigit() and used:
        cache = next((int(line.split()[1]) for line in (stat or "").splitlines() if line.startswith("inactive_file ")),
                     0)
        avail = min(avail, int(limit) - int(used) + cache)
    return avail


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
