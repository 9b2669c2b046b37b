"""Summarizes ncu's per-instruction source page (CSV, --print-source sass): stall samples by opcode and the hottest
instructions. python3 dev/wmma/sass_stalls.py wmma_sass.csv (written by dev/wmma/ncu_sass.sh)."""

from __future__ import annotations

import collections
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str) -> None:
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("no rows")
        return
    columns = list(rows[0].keys())
    print("columns:", columns)
    sample_col = next((c for c in columns if "Warp Stall Sampling (All" in c), None)
    if sample_col is None:
        return
    by_opcode: collections.Counter[str] = collections.Counter()
    total = 0.0
    for r in rows:
        op = (r.get("Source") or "").strip().split(" ")
        opcode = next((w for w in op if w and not w.startswith("@")), "?").split(".")[0]
        n = number(r[sample_col])
        by_opcode[opcode] += n
        total += n
    print(f"\nstall samples {total:.0f}, by opcode:")
    for opcode, n in by_opcode.most_common(15):
        print(f"  {opcode:12s} {n:8.0f} {100 * n / total:5.1f}%")
    print("\nhottest instructions:")
    for r in sorted(rows, key=lambda r: -number(r[sample_col]))[:25]:
        extra = {c: r[c] for c in columns if "stall" in c.lower() and number(r[c]) > 0 and c != sample_col}
        print(f"  {number(r[sample_col]):7.0f}  {r.get('Address', '')} {r.get('Source', '').strip()[:70]}  {extra}")


if __name__ == "__main__":
    main(sys.argv[1])
