"""Plot a process's resident memory over a run, sampled by `experiments/hostmem_1m_run.sh` (rss.csv: unix time,
pid, VmRSS kB, VmHWM kB, CPU seconds; a header line is skipped), beside the host-memory guard's estimate of its peak.

    python experiments/plot_rss.py /tmp/r1m/rss.csv --estimate 11.01 --out rss.png

Prints the sampled peak and the wall and CPU time covered.
"""

from __future__ import annotations

import argparse

import numpy as np

GIB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--estimate", type=float, default=0.0, help="the guard's estimate of the peak, GiB")
    p.add_argument("--out", default="rss.png")
    p.add_argument("--title", default="RULER niah_single_1 at 1M tokens, chunks of 8K, 4 CPU devices")
    args = p.parse_args()
    with open(args.csv) as f:
        header = not f.readline()[:1].isdigit()
    t, _, rss, hwm, cpu = np.loadtxt(args.csv, delimiter=",", unpack=True, skiprows=int(header))
    hours = (t - t[0]) / 3600
    peak = hwm.max() * 1024 / GIB
    print(f"{len(t)} samples over {hours[-1]:.2f} h wall, {cpu[-1]:,.0f} CPU-s; peak (VmHWM) {peak:.2f} GiB")

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(hours, rss * 1024 / GIB, label="resident set (VmRSS)")
    ax.plot(hours, hwm * 1024 / GIB, "--", label="peak so far (VmHWM)")
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
