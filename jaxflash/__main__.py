"""`python -m jaxflash`: environment, built kernels, self-check against the reference, and a
small benchmark against XLA (and cuDNN on a GPU)."""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import _ffi
from jaxflash.bench import flops, measure_point, peers, progress
from jaxflash.check import check_against_reference

# (B, T, S, N, K, H, is_causal): a ragged GQA case, a causal case, Sq != Sk.
CHECK_SHAPES = [(2, 77, 45, 4, 2, 64, False), (1, 130, 130, 4, 4, 128, True),
                (1, 33, 200, 2, 1, 64, True)]


def environment() -> str:
  platform = jax.default_backend()
  lines = [f"jaxflash {jaxflash.__version__}  jax {jax.__version__}  platform {platform}",
           f"devices: {', '.join(d.device_kind for d in jax.devices())}",
           f"CPU kernel: {'built' if _ffi.cpu_built() else 'MISSING: ' + _ffi.missing_reason()}"]
  if _ffi.cuda_built():
    info = _ffi.BUILD_INFO
    lines.append(f"CUDA kernels: built for archs {info['cuda_archs']}, head dims "
                 f"{info['cuda_head_dims']} (backward {info.get('cuda_bwd_head_dims', '')}), "
                 f"{'/'.join(_ffi.cuda_dtypes())}")
  else:
    lines.append("CUDA kernels: not built")
  return "\n".join(lines)


def self_check() -> bool:
  impls = ["cpu"] + (["cuda"] if _ffi.cuda_built() and jax.default_backend() == "gpu" else [])
  cuda_dtypes = [getattr(jnp, d) for d in _ffi.cuda_dtypes()][-1:]  # bfloat16 when built
  cases = [(impl, dtype, shape) for impl in impls
           for dtype in ((jnp.float32, jnp.bfloat16) if impl == "cpu" else cuda_dtypes)
           for shape in CHECK_SHAPES]
  failures = []
  for impl, dtype, (B, T, S, N, K, H, causal) in progress(cases, "self-check"):
    if impl == "cuda" and H not in _ffi.cuda_head_dims():
      continue
    keys = jax.random.split(jax.random.PRNGKey(T + S + H), 5)
    q = jax.random.normal(keys[0], (B, T, N, H)).astype(dtype)
    k = jax.random.normal(keys[1], (B, S, K, H)).astype(dtype)
    v = jax.random.normal(keys[2], (B, S, K, H)).astype(dtype)
    dout = jax.random.normal(keys[3], (B, T, N, H)).astype(dtype)
    dlse = jax.random.normal(keys[4], (B, N, T))
    device = jax.devices("cpu" if impl == "cpu" else "gpu")[0]
    with jax.default_device(device):
      errors = check_against_reference(functools.partial(jaxflash.attention, implementation=impl),
                                       q, k, v, dout, dlse, is_causal=causal)
    for name, (err, bound) in errors.items():
      if not err <= bound:
        failures.append(f"{impl} {jnp.dtype(dtype).name} {(B, T, S, N, K, H)} causal={causal} "
                        f"{name}: error {err:.2e} > bound {bound:.2e}")
  print(f"self-check: {len(cases) - len(failures)} of {len(cases)} cases within the accuracy "
        "rule (forward, lse, dq, dk, dv against the float32 reference)")
  for f in failures:
    print("  FAIL", f)
  return not failures


def benchmark() -> None:
  platform = jax.default_backend()
  if platform == "gpu":
    shapes, dtype = [(4, 4096, 4096, 16, 16, 128, c) for c in (False, True)], jnp.bfloat16
  else:
    shapes, dtype = [(1, 512, 512, 8, 8, 64, c) for c in (False, True)], jnp.float32
  impls = {n: f for n, f in peers(platform).items() if callable(f)}  # no tuning sweeps here
  rows = []
  for B, T, S, N, K, H, causal in progress(shapes, "benchmark"):
    got = measure_point(impls, B, T, S, N, K, H, causal, dtype)
    tf = lambda t, d: "-" if t is None else f"{flops(B, N, T, S, H, causal, d) / t / 1e12:8.3g}"
    for name, (t_fwd, t_bwd, _, errors) in got.items():
      rows.append((name, causal, tf(t_fwd, "fwd"), tf(t_bwd, "bwd"), "; ".join(errors)))
  print(f"\nbenchmark: {jnp.dtype(dtype).name}, B={shapes[0][0]} T=S={shapes[0][1]} "
        f"N={shapes[0][3]} H={shapes[0][5]}, TFLOP/s (median)")
  print(f"{'impl':10s} {'causal':6s} {'fwd':>8s} {'bwd':>8s}")
  for name, causal, f, b, why in rows:
    print(f"{name:10s} {str(causal):6s} {f:>8s} {b:>8s}" + (f"  ('-': {why})" if why else ""))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxflash", description=__doc__)
  parser.add_argument("--no-bench", action="store_true", help="skip the benchmark")
  args = parser.parse_args(argv)
  print(environment())
  ok = self_check()
  if not args.no_bench:
    benchmark()
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
