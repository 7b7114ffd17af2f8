"""What holds the device-memory peak of a compiled GPU program, from XLA's dump (`--xla_dump_to=DIR`).

XLA's GPU compiler writes, per module, `*-buffer-assignment.txt` (every value with its allocation, offset,
size and memory space) and `*-live-range.txt` (the instruction sequence and each buffer's live range in
it). The dump's own "peak" counts every memory space together, so with host offload it is the host buffer.
`device_peak` joins the two files, keeps device memory (color 0) only, and returns the instruction where the
most device bytes are live and the buffers live there (a while loop's carried buffers included; values
that share an allocation slice counted once), with the source line (`op_name` metadata) of each
from `*after_optimizations.txt` when it was dumped (`--xla_dump_hlo_as_text`).

    python -m jaxlong.memory --target h100 --dump /tmp/d ...     # then
    python -m jaxlong.plan.peak /tmp/d [--top 25]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

from jaxlong.core.units import GiB

# A value of the buffer assignment; "(phi)" marks a while loop's carried buffer (its parameter and its output).
_VALUE = re.compile(r"value: <\d+ ([^ >]+?)(?:\{([\d,]*)\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"^\s+(\S+?)\{([\d,]*)\}:(\d+)-(\d+)$")
_OPNAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*op_name=\"([^\"]+)\"")


def _one(pattern: str) -> str:
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no file matches {pattern}: compile with --xla_dump_to (GPU target) first")
    return max(files, key=os.path.getsize)  # the train step is the largest module


def device_peak(dump_dir: str, top: int = 25) -> dict:
    """The device-memory peak of the largest module in `dump_dir`.

    Returns:
      {'bytes': live device bytes at the peak, 'at': instruction index, 'instruction': its name,
       'buffers': [(bytes, name, shape, op_name), ...] largest first (at most `top`)}.

    Raises:
      FileNotFoundError: the dump has no GPU buffer assignment or live-range file.
    """
    assignment = _one(os.path.join(dump_dir, "*gpu_after_optimizations-buffer-assignment.txt"))
    live = assignment.replace("-buffer-assignment.txt", "-live-range.txt")
    size, shape, slot, device = {}, {}, {}, set()
    color, allocation = 0, ""
    with open(assignment) as f:
        for line in f:
            if line.startswith("allocation"):
                m = re.search(r"color (\d+)", line)
                color = int(m.group(1)) if m else 0
                allocation = line.split(":", 1)[0]
                continue
            m = _VALUE.search(line)
            if m:
                key = (m.group(1), m.group(2) or "")
                size[key], shape[key] = int(m.group(3)), m.group(5)
                slot[key] = (allocation, int(m.group(4)), size[key])
                if color == 0:
                    device.add(key)
    sequence, ranges = [], []
    with open(live) as f:
        section = None
        for line in f:
            if line.strip() in ("InstructionSequence:", "BufferLiveRange:"):
                section = line.strip()
                continue
            if line.startswith("  Live ranges at"):
                break
            if section == "InstructionSequence:":
                sequence.append(line.strip().split(":", 1)[-1])
            elif section == "BufferLiveRange:":
                m = _RANGE.match(line)
                if m and (m.group(1), m.group(2)) in device:
                    ranges.append(((m.group(1), m.group(2)), int(m.group(3)), int(m.group(4))))
    # Values of one buffer (an in-place update and its operand, a loop's carried buffer and the values written
    # into it) meet at an instruction: bytes count once per allocation slice, not once per value.
    n = max((end for _, _, end in ranges), default=0) + 2
    starts, ends = [[] for _ in range(n + 1)], [[] for _ in range(n + 1)]
    for key, start, end in ranges:
        starts[start].append(slot[key])
        ends[end + 1].append(slot[key])
    users, best, at, running = {}, -1, 0, 0
    for i in range(n):
        for sl in ends[i]:
            users[sl] -= 1
            running -= sl[2] if users[sl] == 0 else 0
        for sl in starts[i]:
            users[sl] = users.get(sl, 0) + 1
            running += sl[2] if users[sl] == 1 else 0
        if running > best:
            best, at = running, i
    ops = _op_names(assignment)
    live_at, seen = [], set()
    for k, s_, e in sorted(ranges, key=lambda r: -size[r[0]]):
        if s_ <= at <= e and slot[k] not in seen:
            seen.add(slot[k])
            live_at.append((size[k], k))
    buffers = [(b, k[0] + (f"{{{k[1]}}}" if k[1] else ""), shape[k], ops.get(k[0], "")) for b, k in live_at[:top]]
    return {"bytes": best, "at": at, "instruction": sequence[at] if at < len(sequence) else "", "buffers": buffers}


def _op_names(assignment: str) -> dict:
    hlo = assignment.replace("-buffer-assignment.txt", ".txt")
    out = {}
    if os.path.exists(hlo):
        with open(hlo) as f:
            for line in f:
                m = _OPNAME.match(line)
                if m:
                    out[m.group(1)] = m.group(2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxlong.plan.peak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump_dir")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    try:
        p = device_peak(args.dump_dir, args.top)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"device peak {p['bytes'] / GiB:.2f} GiB at instruction {p['at']} ({p['instruction']}); largest live:")
    for b, name, shp, op in p["buffers"]:
        print(f"  {b / GiB:8.3f} GiB  {shp:32s} {name:40s} {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
