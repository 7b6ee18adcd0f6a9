"""Where a kernel's warps wait: ncu's per-instruction stall sampling, summarised.

  ncu --kernel-name regex:flash_fwd_sm90 --launch-skip 1 --launch-count 1 \
      --section SourceCounters --section WarpStateStats -o src \
      python benchmarks/profile_kernels.py --D 128 --S 4096
  ncu --import src.ncu-rep --page source --csv --print-source sass > src.csv
  python benchmarks/stall_sites.py src.csv --top 20 --context 8

Prints the stall reasons' shares of all warp samples, then the SASS instructions holding the
most samples (share, address, instruction, its two main reasons), each with the instructions
before it (--context) so that a wait can be matched to what it waits for. Shares are of all
warps' samples, producer warps included.
"""

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
  p.add_argument("--top", type=int, default=20, help="instructions to list")
  p.add_argument("--context", type=int, default=0, help="instructions shown before each")
  a = p.parse_args()

  rows = list(csv.reader(open(a.csv)))
  header_at = next(i for i, r in enumerate(rows) if SAMPLES in r)
  header = rows[header_at]
  col = {h: i for i, h in enumerate(header)}
  reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
  sass = [r for r in rows[header_at + 1:] if len(r) >= len(header)]
  total = sum(number(r[col[SAMPLES]]) for r in sass)
  if total == 0:
    raise SystemExit(f"{a.csv}: no stall samples (was SourceCounters collected?)")

  by_reason = Counter()
  for r in sass:
    for h in reasons:
      by_reason[h] += number(r[col[h]])
  print(f"{a.csv}: {total:.0f} samples")
  for h, v in by_reason.most_common():
    if v / total >= 0.005:
      print(f"  {h[len('stall_'):]:20s} {100 * v / total:5.1f}%")

  share = lambda r: 100 * number(r[col[SAMPLES]]) / total
  ranked = sorted(range(len(sass)), key=lambda i: -share(sass[i]))[:a.top]
  for i in ranked:
    r = sass[i]
    main_reasons = sorted(reasons, key=lambda h: -number(r[col[h]]))[:2]
    why = " ".join(f"{h[len('stall_'):]}={100 * number(r[col[h]]) / total:.1f}"
                   for h in main_reasons if number(r[col[h]]) > 0)
    if a.context:
      print()
      for c in sass[max(0, i - a.context):i]:
        print(f"        {c[0][-5:]}  {c[1]}")
    print(f"{share(r):6.2f}% {r[0][-5:]}  {r[1]}   [{why}]")


if __name__ == "__main__":
  main()
