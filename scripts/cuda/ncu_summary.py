#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw --print-units base` report by kernel name: launches, device
time and DRAM bytes read, with the implied bandwidth. Used by device-bench.sh's `ncu` stage.

Usage: ncu_summary.py REPORT.csv [TOP]
"""
import csv
import sys
from collections import defaultdict


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.DictReader(lines)
    for r in reader:
        try:
            t = float(r["gpu__time_duration.sum"].replace(",", ""))
        except (KeyError, ValueError):
            continue  # the units row
        b = float((r.get("dram__bytes_read.sum") or "0").replace(",", ""))
        rows.append((r["Kernel Name"].split("(")[0], t, b))
    agg = defaultdict(lambda: [0, 0.0, 0.0])
    for name, t, b in rows:
        a = agg[name]
        a[0] += 1
        a[1] += t
        a[2] += b
    total_t = sum(a[1] for a in agg.values())
    total_b = sum(a[2] for a in agg.values())
    print(f"{len(rows)} kernels, {total_t / 1e6:.3f} ms device time, "
          f"{total_b / 1e9:.3f} GB read ({total_b / max(total_t, 1):.0f} GB/s overall)")
    print(f"{'kernel':40} {'n':>5} {'ms':>8} {'share':>6} {'MB read':>9} {'GB/s':>6} {'us/launch':>9}")
    for name, (n, t, b) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name[:40]:40} {n:5d} {t / 1e6:8.3f} {t / total_t:6.1%} {b / 1e6:9.1f} "
              f"{b / max(t, 1):6.0f} {t / n / 1e3:9.1f}")


if __name__ == "__main__":
    main()
