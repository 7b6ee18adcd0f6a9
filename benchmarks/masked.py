"""Masked and variant work: does the cost follow the unmasked area, and what do the variants
cost? jaxflash against cuDNN per case.

Cases (bf16, D=128, N=16, B=1, S=T=16k by default; q, k, v are 64 MiB each, the block-sparse
mask (1, 1, S, S) bool 256 MiB, the bias (1, N, S, S) 8 GiB):
  full                      dense attention, the baseline of every speed-up
  causal
  window_causal             local_window_size=(W, 0) with is_causal (W = --window, 1024)
  window_sym                local_window_size=(W/2, W/2) without is_causal
  segments, segments_causal query/key_value_segment_ids of 8 equal documents
  padding                   query_seq_lengths = key_value_seq_lengths = S/2 per batch element
  block_sparse              a boolean `mask` (1, 1, S, S) of 256 x 256 blocks (--mask-block),
                            ~1/8 of them True (the diagonal always), so whole kernel tiles
                            are all False
  bias                      an additive bias (1, N, S, S) of unit normals (relative positions)
  bias_keys                 an additive bias (B, 1, 1, S): 0, or -1e4 at a tenth of the keys
  alibi_causal              alibi_slopes 2^-(n+1)/2 per head, with is_causal
  softcap                   logits_soft_cap=30
  dropout                   dropout_rate=0.1

Per case and implementation: forward and forward+backward (jax.grad of the sum of the
output) times, the speed-up over jaxflash `full`, and effective TFLOP/s counted two ways:
  dense    4*B*N*T*S*H for the forward whatever the mask (the work of dense attention),
  visible  4*N*H*(visible (b, t, s) pairs), the pairs counted exactly with
           jaxflash.reference.visibility, the specification;
forward+backward counts 3.5x the forward (bwd = 2.5x fwd, as benchmarks/bench.py).

With --deterministic a row jaxflash_det times deterministic_backward=True beside it.
cuDNN runs through jax.nn.dot_product_attention(implementation="cudnn") on the cases it
takes; jax.nn has no segment ids, ALiBi, soft cap or dropout, and a case cuDNN rejects (a
symmetric window without is_causal, a bias broadcast over the queries) shows its reason. The
jaxflash backward is the pinned kernel (implementation='cuda' on GPU, 'cpu' on the host):
where it lacks a variant, the forward+backward column shows the error instead of timing a
fallback.

The ratio checks the issue asks for (window >= 5x faster than full, causal ~2x) are printed
as PASS/FAIL lines: a report, not an assertion.

  python benchmarks/masked.py --commit $(git rev-parse --short HEAD)        # GPU, full size
  python benchmarks/masked.py --quick                                        # CPU smoke test
  python benchmarks/masked.py --cases bias softcap --results /tmp/r.md       # some cases, and full
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash.bench import flops, median_seconds, progress
from jaxflash.reference import visibility

from bench import environment, pyplot  # benchmarks/bench.py, next to this script

HERE = os.path.dirname(os.path.abspath(__file__))
BWD_FACTOR = 3.5  # forward + backward, with the backward at 2.5x the forward
WINDOW_MIN_SPEEDUP = 5.0
CAUSAL_MIN_SPEEDUP = 1.8  # "about 2x": the triangle plus its diagonal tiles is just over half


@dataclasses.dataclass
class Case:
  name: str
  static: dict      # keyword arguments that are Python values (is_causal, window)
  operands: dict    # keyword arguments that are arrays (passed to jit, never baked in)


def cases(B, S, N, window, num_docs, block, density, seed=0) -> list[Case]:
  docs = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) // (S // num_docs), (B, S))
  ids = dict(query_segment_ids=docs, key_value_segment_ids=docs)
  half = jnp.full((B,), S // 2, jnp.int32)
  # block-sparse: (block x block) blocks, each True with probability `density`, plus the
  # diagonal so that no query row is empty
  nb = S // block
  rng = np.random.default_rng(seed)
  blocks = (rng.random((nb, nb)) < density) | np.eye(nb, dtype=bool)
  mask = jnp.asarray(blocks.repeat(block, 0).repeat(block, 1)[None, None])
  kb = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
  bias = jax.random.normal(kb[0], (1, N, S, S), jnp.bfloat16)
  bias_keys = jnp.where(jax.random.uniform(kb[1], (B, 1, 1, S)) < 0.9, 0.0, -1e4)
  slopes = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32) / 2
  return [
      Case("full", {}, {}),
      Case("causal", dict(is_causal=True), {}),
      Case("window_causal", dict(is_causal=True, local_window_size=(window, 0)), {}),
      Case("window_sym", dict(local_window_size=(window // 2, window // 2)), {}),
      Case("segments", {}, ids),
      Case("segments_causal", dict(is_causal=True), ids),
      Case("padding", {}, dict(query_seq_lengths=half, key_value_seq_lengths=half)),
      Case("block_sparse", {}, dict(mask=mask)),
      Case("bias", {}, dict(bias=bias)),
      Case("bias_keys", {}, dict(bias=bias_keys.astype(jnp.bfloat16))),
      Case("alibi_causal", dict(is_causal=True), dict(alibi_slopes=slopes)),
      Case("softcap", dict(logits_soft_cap=30.0), {}),
      Case("dropout", dict(dropout_rate=0.1), dict(dropout_rng=kb[2])),
  ]


def visible_pairs(case: Case, B, T, S, N) -> int:
  """Number of visible (b, n, t, s), by the specification's own visibility rule."""
  rules = set(inspect.signature(visibility).parameters)  # the variants that hide pairs
  static = {a: x for a, x in case.static.items() if a in rules}
  ops = {a: x for a, x in case.operands.items() if a in rules}
  count = jax.jit(lambda ops: jnp.sum(visibility(B, T, S, **static, **ops), dtype=jnp.int32))
  heads = ops["mask"].shape[1] if "mask" in ops else 1  # visibility's N axis: the mask's
  return int(count(ops)) * (N // heads)


def implementations(platform, impl, deterministic=False):
  """name -> (attention(q, k, v, **kw), the keyword names it takes or None for all)."""
  out = {"jaxflash": (lambda q, k, v, **kw: jaxflash.attention(q, k, v, implementation=impl,
                                                               **kw), None)}
  if deterministic:
    out["jaxflash_det"] = (lambda q, k, v, **kw: jaxflash.attention(
        q, k, v, implementation=impl, deterministic_backward=True, **kw), None)
  if platform == "gpu":
    params = set(inspect.signature(jax.nn.dot_product_attention).parameters)
    out["cudnn"] = (lambda q, k, v, **kw: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn", **kw), params)
  return out


def _error(e):
  """A row's text for a failed stage: 'n/a' where the implementation rejects the case up
  front (ValueError / NotImplementedError at trace time), else 'error'."""
  kind = "n/a" if isinstance(e, (ValueError, NotImplementedError)) else "error"
  return f"{kind}: {type(e).__name__}: {str(e).strip().splitlines()[0][:150]}"


def time_case(attn, q, k, v, case: Case, warmup, reps):
  """(forward seconds, forward+backward seconds) of one case; a stage that cannot run
  gives its error string instead of a time."""
  call = lambda q, k, v, ops: attn(q, k, v, **case.static, **ops)
  try:
    t_fwd = median_seconds(jax.jit(call), q, k, v, case.operands, warmup=warmup, reps=reps)
  except Exception as e:  # an unsupported case shows its reason in the table
    return _error(e), "-"
  loss = lambda q, k, v, ops: jnp.sum(call(q, k, v, ops).astype(jnp.float32))
  try:
    t_all = median_seconds(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, case.operands,
                           warmup=warmup, reps=reps)
  except Exception as e:
    t_all = _error(e)
  return t_fwd, t_all


def run(args, impl) -> list[dict]:
  B, S, N, H = args.batch, args.seqlen, args.heads, args.head_dim
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (B, S, N, H), jnp.float32).astype(jnp.bfloat16)
             for key in ks)
  all_cases = cases(B, S, N, args.window, args.docs, args.mask_block, args.density)
  if args.cases:  # full stays: it is every speed-up's baseline
    unknown = set(args.cases) - {c.name for c in all_cases}
    if unknown:
      raise ValueError(f"--cases: no case {sorted(unknown)}; cases: "
                       f"{', '.join(c.name for c in all_cases)}")
    all_cases = [c for c in all_cases if c.name == "full" or c.name in args.cases]
  impls = implementations(jax.default_backend(), impl, args.deterministic)
  rows = []
  for case, name in progress([(c, n) for c in all_cases for n in impls], "masked"):
    attn, takes = impls[name]
    row = dict(case=case.name, impl=name, visible=visible_pairs(case, B, S, S, N) / (B * N * S * S))
    missing = [a for a in (*case.static, *case.operands) if takes is not None and a not in takes]
    if missing:
      row["fwd"] = row["fwd_bwd"] = f"n/a: jax.nn has no {', '.join(missing)}"
    else:
      row["fwd"], row["fwd_bwd"] = time_case(attn, q, k, v, case, args.warmup, args.reps)
    rows.append(row)
  dense = flops(B, N, S, S, H, False)
  base = {stage: next(r[stage] for r in rows if r["case"] == "full" and r["impl"] == "jaxflash")
          for stage in ("fwd", "fwd_bwd")}
  for r in rows:
    for stage, factor in (("fwd", 1.0), ("fwd_bwd", BWD_FACTOR)):
      t = r[stage]
      if isinstance(t, float):
        r[f"{stage}_ms"] = t * 1e3
        r[f"{stage}_dense_tflops"] = factor * dense / t / 1e12
        r[f"{stage}_visible_tflops"] = factor * dense * r["visible"] / t / 1e12
        if isinstance(base[stage], float):
          r[f"{stage}_speedup"] = base[stage] / t
  return rows


def _cell(r, stage):
  if f"{stage}_ms" not in r:
    return str(r[stage]).split(":")[0]  # n/a, error, or '-' (no forward)
  speed = f" ({r[f'{stage}_speedup']:.1f}x)" if f"{stage}_speedup" in r else ""
  return (f"{r[f'{stage}_ms']:.3g}{speed} {r[f'{stage}_dense_tflops']:.3g}/"
          f"{r[f'{stage}_visible_tflops']:.3g}")


def table(rows) -> str:
  names = list(dict.fromkeys(r["impl"] for r in rows))
  head = "| case | visible | " + " | ".join(f"{n} fwd | {n} fwd+bwd" for n in names) + " |"
  lines = [head, "|---|---|" + "---|---|" * len(names)]
  for case in dict.fromkeys(r["case"] for r in rows):
    mine = {r["impl"]: r for r in rows if r["case"] == case}
    cells = [f"{_cell(mine[n], s)}" for n in names for s in ("fwd", "fwd_bwd")]
    lines.append(f"| {case} | {mine[names[0]]['visible']:.3f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def errors(rows) -> list[str]:
  return [f"  {r['impl']} {r['case']} {stage}: {r[stage]}" for r in rows
          for stage in ("fwd", "fwd_bwd") if isinstance(r[stage], str) and r[stage] != "-"]


def ratio_checks(rows) -> list[str]:
  """The issue's ratios for jaxflash, per stage that ran: PASS/FAIL lines."""
  lines = []
  mine = {r["case"]: r for r in rows if r["impl"] == "jaxflash"}
  for stage in ("fwd", "fwd_bwd"):
    speed = {c: r.get(f"{stage}_speedup") for c, r in mine.items()}
    for case in ("window_causal", "window_sym"):
      s = speed.get(case)
      verdict = "n/a" if s is None else ("PASS" if s >= WINDOW_MIN_SPEEDUP else "FAIL")
      lines.append(f"{verdict}: {stage} {case} vs full: "
                   f"{'-' if s is None else f'{s:.2f}x'} (want >= {WINDOW_MIN_SPEEDUP:.0f}x)")
    s = speed.get("causal")
    verdict = "n/a" if s is None else ("PASS" if s >= CAUSAL_MIN_SPEEDUP else "FAIL")
    lines.append(f"{verdict}: {stage} causal vs full: {'-' if s is None else f'{s:.2f}x'} "
                 f"(want about 2x: >= {CAUSAL_MIN_SPEEDUP}x)")
  return lines


def plot(rows, path) -> bool:
  plt = pyplot()
  if plt is None:
    return False
  names = list(dict.fromkeys(r["impl"] for r in rows))
  case_names = list(dict.fromkeys(r["case"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  width = 0.8 / len(names)
  for ax, stage in zip(axes, ("fwd", "fwd_bwd")):
    for i, n in enumerate(names):
      ms = [next((r.get(f"{stage}_ms", 0.0) for r in rows if r["case"] == c and r["impl"] == n),
                 0.0) for c in case_names]
      ax.bar(np.arange(len(case_names)) + i * width, ms, width, label=n)
    vis = [next(r["visible"] for r in rows if r["case"] == c) for c in case_names]
    ax.set_xticks(np.arange(len(case_names)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{c} ({v:.2f})" for c, v in zip(case_names, vis)], fontsize=7,
                       rotation=30, ha="right")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"{stage.replace('_', '+')}: time per case (x label: visible fraction)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def append_results(rows, env, shape, path, plot_name, note):
  text = (f"\n## {env['date']} {env['device']} masked and variant work (commit {env['commit']})\n\n"
          f"jax {env['jax']}, driver {env.get('driver')}, {env.get('cuda')}. "
          f"`benchmarks/masked.py`: {shape}. Cells: median ms (speed-up over jaxflash full) "
          "TFLOP/s dense/visible. Plot: "
          f"[plots/{plot_name}](plots/{plot_name}).\n")
  if note:
    text += f"\n{note}\n"
  text += "\n" + table(rows) + "\n\n" + "\n".join(f"    {l}" for l in ratio_checks(rows)) + "\n"
  with open(path, "a") as f:
    f.write(text)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seqlen", type=int, default=16384)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--window", type=int, default=1024, help="window size W (see the cases)")
  p.add_argument("--docs", type=int, default=8, help="documents per sequence (segment ids)")
  p.add_argument("--mask-block", type=int, default=256, help="block-sparse: block size")
  p.add_argument("--density", type=float, default=0.125, help="block-sparse: True block share")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--cases", nargs="+", metavar="CASE",
                 help="time only these cases (and full); default: all of them")
  p.add_argument("--deterministic", action="store_true",
                 help="also time jaxflash with deterministic_backward=True (row jaxflash_det)")
  p.add_argument("--quick", action="store_true",
                 help="a tiny shape (S=1024, N=2, W=64, mask blocks of 128) for a CPU smoke test")
  p.add_argument("--implementation", choices=["cuda", "cpu"],
                 help="jaxflash's kernel (default: cuda on GPU, cpu otherwise)")
  p.add_argument("--out", default=os.path.join(HERE, "plots"), help="folder for the PNG")
  p.add_argument("--json", help="also write the rows and the environment here")
  p.add_argument("--commit", default="unknown")
  p.add_argument("--note", default="", help="a line recorded with the RESULTS.md entry")
  p.add_argument("--results", help="RESULTS.md to append to (default benchmarks/RESULTS.md; "
                 "--quick appends only when given)")
  args = p.parse_args(argv)
  if args.quick:
    args.seqlen, args.heads, args.window, args.mask_block = 1024, 2, 64, 128
    args.warmup, args.reps = 1, 3
  results = args.results or (None if args.quick else os.path.join(HERE, "RESULTS.md"))
  if args.seqlen % args.mask_block or args.seqlen % args.docs:
    p.error("--seqlen must be a multiple of --mask-block and of --docs")
  impl = args.implementation or ("cuda" if jax.default_backend() == "gpu" else "cpu")

  env = environment(args.commit, args.batch * args.seqlen, args.heads * args.head_dim)
  shape = (f"bf16, B={args.batch}, S=T={args.seqlen}, N={args.heads}, D={args.head_dim}, "
           f"W={args.window}, {args.docs} documents, block-sparse {args.mask_block}-blocks "
           f"at density {args.density}, "
           f"jaxflash implementation='{impl}'")
  print(json.dumps(env))
  print(shape)
  rows = run(args, impl)
  print(table(rows))
  for line in errors(rows):
    print(line)
  print("\n".join(ratio_checks(rows)))
  os.makedirs(args.out, exist_ok=True)
  device = env["device"].replace(" ", "_").replace("/", "_").lower()
  plot_name = f"masked_{device}_{args.commit}.png"
  if plot(rows, os.path.join(args.out, plot_name)):
    print(f"plot: {os.path.join(args.out, plot_name)}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"env": env, "shape": shape, "rows": rows}, f, indent=1)
  if results:
    append_results(rows, env, shape, results, plot_name, args.note)
  return 0


if __name__ == "__main__":
  sys.exit(main())
