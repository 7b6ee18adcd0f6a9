"""Sweep jaxflash against its peers in one run: table, PNG plot, and a RESULTS.md entry.

Shapes follow ANCHORS.md: bf16, B = tokens / S, N = hidden / D, D in {64, 128} (and 256
reported), S in {1k, 4k, 16k}, causal and not; TFLOP/s with fwd = 4*B*N*S^2*D (halved when
causal) and bwd = 2.5 x fwd. Medians of warm runs, taken in rounds that time every
implementation of a point in turn (jaxflash.bench.medians_together). Peers: cuDNN (jax.nn),
flash-attn3-jax when installed, Mosaic GPU (JAX's Pallas Hopper attention: fp16, forward only,
as ANCHORS.md) and XLA.
Only outputs that are right are timed (jaxflash.bench.MAX_OUTPUT_ERROR): a peer whose output or
gradients are wrong at a point shows '-' there, with the error listed under the table.

  python benchmarks/bench.py --out /tmp/bench --commit $(git rev-parse --short HEAD)
  python benchmarks/bench.py --plot-only /tmp/bench/results.json   # re-plot elsewhere
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as pyplatform
import subprocess
import sys

import jax

from jaxflash.bench import (FORWARD_ONLY, MOSAIC_BLOCK_KV, OPTIONS, flops, measure_point, peers,
                            progress)

HERE = os.path.dirname(os.path.abspath(__file__))
XLA_MAX_S = 4096  # XLA materialises (B, N, S, S) logits; 16k does not fit


def environment(commit: str, tokens: int, hidden: int) -> dict:
  env = {"date": datetime.date.today().isoformat(), "commit": commit, "jax": jax.__version__,
         "tokens": tokens, "hidden": hidden,
         "python": pyplatform.python_version(), "device": jax.devices()[0].device_kind}
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
    env["driver"] = smi.splitlines()[0] if smi else "n/a"
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                          timeout=20).stdout
    env["cuda"] = nvcc.strip().splitlines()[-1] if nvcc else "n/a"
  except (OSError, subprocess.SubprocessError):
    env["driver"] = env["cuda"] = "n/a"
  try:
    import flash_attn3_jax
    env["fa3j"] = flash_attn3_jax.__version__
  except ImportError:
    pass
  return env


def sweep(dims, seqlens, causals, tokens, hidden, names, backward) -> list[dict]:
  impls = {n: f for n, f in {**peers(jax.default_backend()), **OPTIONS}.items() if n in names}
  rows = []
  for D, S, causal in progress([(d, s, c) for d in dims for s in seqlens for c in causals],
                               "bench"):
    B, N = max(1, tokens // S), hidden // D
    skipped = {"xla"} if S > XLA_MAX_S else set()
    got = measure_point({n: f for n, f in impls.items() if n not in skipped}, B, S, S, N, N, D,
                        causal, backward=backward)
    for name in impls:
      row = dict(impl=name, D=D, S=S, causal=causal, B=B, N=N, fwd=None, bwd=None)
      rows.append(row)
      if name in skipped:
        row["error"] = "skipped: O(S^2) memory"
        continue
      t_fwd, t_bwd, config, errors = got[name]
      if t_fwd is None:
        row["error"] = "; ".join(errors)
        continue
      row["fwd"] = flops(B, N, S, S, D, causal, "fwd") / t_fwd / 1e12
      row["bwd"] = flops(B, N, S, S, D, causal, "bwd") / t_bwd / 1e12 if t_bwd else None
      row["fwd_ms"], row["bwd_ms"], row["config"] = t_fwd * 1e3, (t_bwd or 0) * 1e3, config
      if backward and name not in FORWARD_ONLY and t_bwd is None:
        row["error"] = "backward not timed: " + "; ".join(errors)
    # each point's row as soon as it is measured: a sweep cut short by a timeout keeps them
    print("\n" + table(rows[-len(impls):]).splitlines()[-1], flush=True)
  return rows


def table(rows) -> str:
  names = list(dict.fromkeys(r["impl"] for r in rows))
  fmt = lambda x: "-" if x is None else f"{x:.0f}"
  lines = ["| D | S | causal | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
  keys = list(dict.fromkeys((r["D"], r["S"], r["causal"]) for r in rows))
  for D, S, causal in keys:
    cells = []
    for n in names:
      r = next((r for r in rows if (r["D"], r["S"], r["causal"], r["impl"]) == (D, S, causal, n)),
               None)
      cells.append("-" if r is None else f"{fmt(r['fwd'])}/{fmt(r['bwd'])}")
    length = f"{S // 1024}k" if S % 1024 == 0 else str(S)
    lines.append(f"| {D} | {length} | {'y' if causal else 'n'} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def pyplot():
  """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return None
  return plt


def plot(rows, path) -> bool:
  plt = pyplot()
  if plt is None:
    print("re-plot elsewhere with --plot-only results.json")
    return False
  dims = sorted({r["D"] for r in rows})
  colors = {n: f"C{i}" for i, n in enumerate(dict.fromkeys(r["impl"] for r in rows))}  # one per impl
  fig, axes = plt.subplots(len(dims), 2, figsize=(11, 4 * len(dims)), squeeze=False)
  for i, D in enumerate(dims):
    for j, direction in enumerate(("fwd", "bwd")):
      ax = axes[i][j]
      for name, color in colors.items():
        for causal, style in ((False, "-"), (True, "--")):
          pts = sorted((r["S"], r[direction]) for r in rows if r["impl"] == name and
                       r["D"] == D and r["causal"] == causal and r[direction] is not None)
          if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                    label=f"{name}{' causal' if causal else ''}")
      ax.set_xscale("log", base=2)
      ax.set_title(f"D={D} {direction}")
      ax.set_xlabel("sequence length")
      ax.set_ylabel("TFLOP/s")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def append_results(rows, env, path, note):
  mosaic = (" (mosaic: fp16, forward only, the fastest block_kv of "
            f"{'/'.join(map(str, MOSAIC_BLOCK_KV))} whose output is right)"
            if any(r["impl"] == "mosaic" for r in rows) else "")
  header = (f"\n## {env['date']} {env['device']} (commit {env['commit']})\n\n"
            f"jax {env['jax']}, driver {env.get('driver')}, {env.get('cuda')}"
            f"{', flash-attn3-jax ' + env['fa3j'] if 'fa3j' in env else ''}. "
            f"bf16{mosaic}, {env['tokens']} tokens per batch, hidden {env['hidden']}; TFLOP/s fwd/bwd "
            "(medians).\n")
  if note:
    header += f"\n{note}\n"
  untimed = [f"- {r['impl']} D={r['D']} S={r['S']} {'causal' if r['causal'] else 'plain'}: "
             f"{r['error']}" for r in rows if "error" in r and not r["error"].startswith("skipped")]
  with open(path, "a") as f:
    f.write(header + "\n" + table(rows) + "\n" +
            ("\nNot timed ('-'):\n" + "\n".join(untimed) + "\n" if untimed else ""))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--peers", nargs="+", default=["jaxflash", "cudnn", "fa3j", "mosaic", "xla"])
  p.add_argument("--no-bwd", action="store_true")
  p.add_argument("--out", default=".", help="folder for results.json and bench.png")
  p.add_argument("--commit", default="unknown")
  p.add_argument("--note", default="", help="a line recorded with the RESULTS.md entry")
  p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  p.add_argument("--plot-only", metavar="JSON")
  args = p.parse_args(argv)

  if args.plot_only:
    with open(args.plot_only) as f:
      rows = json.load(f)["rows"]
    plot(rows, os.path.join(args.out, "bench.png"))
    return 0
  causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
  env = environment(args.commit, args.tokens, args.hidden)
  rows = sweep(args.dims, args.seqlens, causals, args.tokens, args.hidden, args.peers,
               not args.no_bwd)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"env": env, "rows": rows}, f, indent=1)
  print(json.dumps(env))
  print(table(rows))
  for r in rows:
    if "error" in r:
      print(f"  {r['impl']} D={r['D']} S={r['S']} causal={r['causal']}: {r['error']}")
  append_results(rows, env, args.results, args.note)  # before the plot, which is slow to import
  plot(rows, os.path.join(args.out, "bench.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
