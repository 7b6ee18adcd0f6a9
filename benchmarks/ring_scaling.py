"""Weak scaling of ring attention: fixed tokens per GPU, 1, 2 and 4 GPUs.

bf16, D=128, causal (zigzag), fwd and fwd+bwd. Prints a table and writes JSON and a plot.
FLOPs: fwd = 4*B*N*T^2*D / 2 (causal), bwd = 2.5 x fwd; TFLOP/s are per GPU.

  python benchmarks/ring_scaling.py --tokens-per-gpu 131072 --out benchmarks/ring_scaling
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflash


def flops_fwd(B, N, T, D, causal=True):
  return 4 * B * N * T * T * D / (2 if causal else 1)


def median_time(fn, args, warmup, iters):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def run(num_gpus, tokens_per_gpu, heads, kv_heads, head_dim, warmup, iters):
  devices = jax.devices()[:num_gpus]
  mesh = jax.make_mesh((num_gpus,), ("sp",), axis_types=(AxisType.Auto,), devices=devices)
  T = tokens_per_gpu * num_gpus
  sh = NamedSharding(mesh, P(None, "sp"))
  make = lambda key, h: jax.jit(lambda: jax.random.normal(key, (1, T, h, head_dim), jnp.bfloat16),
                                out_shardings=sh)()
  ks = jax.random.split(jax.random.key(0), 4)
  # random tokens need no zigzag permutation: the layout only fixes which positions a
  # device holds, and the cost of every step is the same for any content
  q, k, v, do = make(ks[0], heads), make(ks[1], kv_heads), make(ks[2], kv_heads), make(ks[3], heads)
  ring = jax.shard_map(functools.partial(jaxflash.ring_attention, axis_name="sp", is_causal=True),
                       mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  fwd = jax.jit(ring)
  bwd = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum((ring(q, k, v) * do).astype(jnp.float32)),
                         argnums=(0, 1, 2)))
  t_fwd = median_time(fwd, (q, k, v), warmup, iters)
  t_all = median_time(bwd, (q, k, v, do), warmup, iters)
  f = flops_fwd(1, heads, T, head_dim) / num_gpus  # per GPU
  return dict(gpus=num_gpus, tokens_per_gpu=tokens_per_gpu, seq_len=T, fwd_ms=t_fwd * 1e3,
              fwd_bwd_ms=t_all * 1e3, fwd_tflops=f / t_fwd / 1e12,
              fwd_bwd_tflops=3.5 * f / t_all / 1e12)


def check(num_gpus, head_dim):
  """Ring attention (causal zigzag, GQA) on `num_gpus` devices against the float32 reference:
  out, lse, dq, dk, dv under the accuracy rule. Raises if any is off."""
  from jaxflash.check import check_against_reference
  mesh = jax.make_mesh((num_gpus,), ("sp",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:num_gpus])
  def attn(q, k, v, return_residual, is_causal):
    ring = jax.shard_map(
        functools.partial(jaxflash.ring_attention, axis_name="sp", is_causal=is_causal,
                          return_residual=return_residual),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=(P(None, "sp"), P(None, None, "sp")))
    zz = lambda x: jaxflash.zigzag_permute(x, num_gpus)
    out, lse = ring(zz(q), zz(k), zz(v))
    return (jaxflash.zigzag_unpermute(out, num_gpus),
            jaxflash.zigzag_unpermute(lse, num_gpus, axis=2))

  T, N, K = 256 * num_gpus, 8, 2
  ks = jax.random.split(jax.random.key(1), 5)
  rand = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
  q, k, v = rand(ks[0], (1, T, N, head_dim)), rand(ks[1], (1, T, K, head_dim)), rand(
      ks[2], (1, T, K, head_dim))
  dout, dlse = rand(ks[3], (1, T, N, head_dim)), jax.random.normal(ks[4], (1, N, T))
  errors = check_against_reference(attn, q, k, v, dout, dlse, is_causal=True)
  bad = {n: e for n, e in errors.items() if not e[0] <= e[1]}
  print(f"ring attention on {num_gpus} GPU(s) vs reference: " + ", ".join(
      f"{n} {e[0]:.1e} (bound {e[1]:.1e})" for n, e in errors.items()))
  if bad:
    raise AssertionError(f"ring attention on {num_gpus} GPUs is off: {bad}")


def environment():
  dev = jax.devices()[0]
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.split()[0]
  except (OSError, IndexError, subprocess.SubprocessError):
    smi = "n/a"
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=30).stdout.strip() or "n/a"
  except (OSError, subprocess.SubprocessError):
    commit = "n/a"
  return dict(device=dev.device_kind, platform=dev.platform, driver=smi, jax=jax.__version__,
              python=platform.python_version(), commit=commit)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens-per-gpu", type=int, default=131072)
  ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--out", default="ring_scaling", help="path prefix for .json and .png")
  args = ap.parse_args()

  gpus = [g for g in args.gpus if g <= jax.device_count()]
  for g in gpus:
    check(g, args.head_dim)
  rows = [run(g, args.tokens_per_gpu, args.heads, args.kv_heads, args.head_dim, args.warmup,
              args.iters) for g in gpus]
  for r in rows:
    r["fwd_eff"] = r["fwd_tflops"] / rows[0]["fwd_tflops"]
    r["fwd_bwd_eff"] = r["fwd_bwd_tflops"] / rows[0]["fwd_bwd_tflops"]
  env = environment()
  print(f"ring attention weak scaling: bf16, causal zigzag, H={args.heads}, K={args.kv_heads}, "
        f"D={args.head_dim}, {args.tokens_per_gpu} tokens/GPU; {env}")
  print("| GPUs | seq | fwd ms | fwd TFLOP/s/GPU | eff | fwd+bwd ms | fwd+bwd TFLOP/s/GPU | eff |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['gpus']} | {r['seq_len']} | {r['fwd_ms']:.1f} | {r['fwd_tflops']:.0f} | "
          f"{r['fwd_eff']:.0%} | {r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_tflops']:.0f} | "
          f"{r['fwd_bwd_eff']:.0%} |")
  with open(args.out + ".json", "w") as f:
    json.dump(dict(environment=env, config=vars(args), rows=rows), f, indent=2)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for key, label in (("fwd_tflops", "fwd"), ("fwd_bwd_tflops", "fwd+bwd")):
    ax.plot([r["gpus"] for r in rows], [r[key] for r in rows], "o-", label=label)
  ax.set_xlabel("GPUs")
  ax.set_ylabel("TFLOP/s per GPU")
  ax.set_xticks([r["gpus"] for r in rows])
  ax.set_ylim(bottom=0)
  ax.set_title(f"ring attention, {args.tokens_per_gpu} tokens/GPU ({env['device']})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out + ".png", dpi=120)


if __name__ == "__main__":
  main()
