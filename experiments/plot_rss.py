"""Plot a process's resident memory over a run, sampled by `experiments/hostmem_1m_run.sh` (rss.csv: unix time,
pid, VmRSS kB, VmHWM kB, CPU seconds; a header line is skipped), beside the host-memory guard's estimate of its peak.

    python experiments/plot_rss.py /tmp/r1m/rss.csv --estimate 11.01 --out rss.png
    python experiments/plot_rss.py OUT/rss.csv --estimate 11.01 --loop 9.50 --chunks OUT/chunks.csv \
        --table chunks_vs_estimate.csv --out rss.png

Prints the sampled peak and the wall and CPU time covered. With `--chunks` (chunks.csv: unix time, chunks of the
prefill done, as the prefill bar last showed them) and `--loop` (the estimate's loop term at the last chunk, GiB),
it also plots the estimate chunk by chunk: chunk j of C (1-based) reads j chunks of the cache, so its loop term is
`loop x j / C` and its estimate `estimate - loop + loop x j / C`. It prints, and writes to `--table`, the peak so far
(VmHWM) at the first rss sample at or after each chunk count was seen, beside that chunk's estimate (with samples
20 s apart, a reading may hold the next chunk's first step: each ratio is uncertain by one chunk).
"""

from __future__ import annotations

import argparse
import csv

import numpy as np

GIB = 1 << 30


def per_chunk(t: np.ndarray, hwm_gib: np.ndarray, chunks_csv: str, estimate: float, loop: float, num_chunks: int):
    """Rows `(chunk, unix time, peak so far GiB, chunk's estimate GiB)` for each chunk seen ended in `chunks_csv`:
    the peak is VmHWM at the first rss sample at or after the chunk-sampler saw it done."""
    tc, done = [], []
    with open(chunks_csv) as f:
        for row in csv.reader(f):
            if row and row[0].isdigit() and len(row) > 1 and row[1].strip().isdigit():
                tc.append(int(row[0]))
                done.append(int(row[1]))
    rows, seen = [], set()
    for when, c in zip(tc, done):
        if c in seen or c < 1:
            continue
        seen.add(c)
        i = int(np.searchsorted(t, when))
        if i >= len(t):
            print(f"chunk {c} and later: seen after the last rss sample, not tabled")
            break
        rows.append((c, when, float(hwm_gib[i]), estimate - loop + loop * c / num_chunks))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--estimate", type=float, default=0.0, help="the guard's estimate of the peak, GiB")
    p.add_argument("--loop", type=float, default=0.0, help="the estimate's loop term at the last chunk, GiB")
    p.add_argument("--chunks", default="", help="chunks.csv: unix time, chunks done")
    p.add_argument("--num-chunks", type=int, default=128, help="chunks in the whole prefill")
    p.add_argument("--table", default="", help="write the per-chunk peak and estimate to this CSV")
    p.add_argument("--out", default="rss.png")
    p.add_argument("--title", default="RULER niah_single_1 at 1M tokens, chunks of 8K, 4 CPU devices")
    args = p.parse_args()
    if bool(args.chunks) != bool(args.loop) or (args.loop and not args.estimate):
        p.error("--chunks needs --loop and --estimate (the estimate's loop term and whole peak, GiB), and --loop "
                "needs --chunks")
    with open(args.csv) as f:
        header = not f.readline()[:1].isdigit()
    t, _, rss, hwm, cpu = np.loadtxt(args.csv, delimiter=",", unpack=True, skiprows=int(header))
    hours = (t - t[0]) / 3600
    peak = hwm.max() * 1024 / GIB
    print(f"{len(t)} samples over {hours[-1]:.2f} h wall, {cpu[-1]:,.0f} CPU-s; peak (VmHWM) {peak:.2f} GiB")
    rows = []
    if args.chunks and args.loop:
        rows = per_chunk(t, hwm * 1024 / GIB, args.chunks, args.estimate, args.loop, args.num_chunks)
        worst = max(rows, key=lambda r: r[2] / r[3]) if rows else None
        for c, _, m, e in rows:
            if c % 8 == 0 or c == rows[-1][0]:
                print(f"chunk {c:4d}/{args.num_chunks}: peak so far {m:6.2f} GiB, estimate {e:6.2f}, ratio {m / e:.3f}")
        if worst:
            print(f"largest ratio: chunk {worst[0]}, {worst[2]:.2f} / {worst[3]:.2f} = {worst[2] / worst[3]:.3f}")
        if args.table:
            with open(args.table, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["chunk", "unix_time", "peak_so_far_gib", "estimate_gib", "ratio"])
                for c, when, m, e in rows:
                    w.writerow([c, when, f"{m:.3f}", f"{e:.3f}", f"{m / e:.4f}"])
            print(f"wrote {args.table}")

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(hours, rss * 1024 / GIB, label="resident set (VmRSS)")
    ax.plot(hours, hwm * 1024 / GIB, "--", label="peak so far (VmHWM)")
    if rows:
        ax.plot([(r[1] - t[0]) / 3600 for r in rows], [r[3] for r in rows], "k:", lw=1,
                label="estimate of the chunk just ended")
    if args.estimate:
        ax.axhline(args.estimate, color="k", lw=0.8, label=f"guard's estimate ({args.estimate:.2f} GiB)")
    ax.set_xlabel("hours since the first sample")
    ax.set_ylabel("GiB")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
