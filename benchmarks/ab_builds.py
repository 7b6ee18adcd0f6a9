"""Times two or more builds of the extension in one process, in the same interleaved rounds
(jaxflash.bench.medians_together), with optional peers as a yardstick.

A build-level change (a header every kernel includes, a compiler flag) cannot be switched per
call, and timings from separate processes spread by up to 3% (NOTES.md, twenty-fifth
session): here each extra build is imported as a package of its own and its FFI targets are
registered under a prefix of their own, so every build runs in the same rounds.

  python benchmarks/ab_builds.py --build new=/path/_jaxflash_ext.so [--build ...] \
      --points 128:4096:c 64:1024:c --peers fa3j

The installed jaxflash is the build named 'base'. Each point checks every build's outputs
against base's (max abs difference) before timing. --sustained also times each implementation
alone, sustained, at the clock its own power draw allows (bench.sustained).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import bench

_TARGET = "jaxflash_"


def load_build(name: str, path: str, workdir: str) -> None:
  """Imports the extension at `path` as package `jfab_<name>` and registers its targets as
  jfab_<name>_fwd_cuda, ...; `renamed(name)` makes jaxflash's calls traced inside it use them."""
  pkg = f"jfab_{name}"
  os.makedirs(os.path.join(workdir, pkg), exist_ok=True)
  open(os.path.join(workdir, pkg, "__init__.py"), "w").close()
  shutil.copy(path, os.path.join(workdir, pkg, os.path.basename(path)))
  if workdir not in sys.path:
    sys.path.insert(0, workdir)
  ext = importlib.import_module(f"{pkg}._jaxflash_ext")
  for platform, targets in ext.registrations().items():
    for target, capsule in targets.items():
      jax.ffi.register_ffi_target(target.replace(_TARGET, f"{pkg}_"), capsule, platform=platform)


@contextlib.contextmanager
def renamed(name: str):
  """jax.ffi.ffi_call of jaxflash's targets goes to build `name`'s while tracing inside."""
  if name == "base":
    yield
    return
  real = jax.ffi.ffi_call

  def call(target, *args, **kwargs):
    return real(target.replace(_TARGET, f"jfab_{name}_"), *args, **kwargs)

  jax.ffi.ffi_call = call
  try:
    yield
  finally:
    jax.ffi.ffi_call = real


def _jaxflash(q, k, v, c):
  return jaxflash.attention(q, k, v, is_causal=c)


def in_build(name: str, fn):
  """fn run with build `name`'s targets: jit traces a call (and a custom_vjp's backward rule)
  when it first runs it, so every run goes through renamed()."""
  def run(*args):
    with renamed(name):
      return fn(*args)
  return run


def build_calls(name, attn, *point, backward):
  with renamed(name):
    calls = bench.attention_calls(attn, *point, backward=backward)
  return tuple(None if c is None else (in_build(name, c[0]), c[1]) for c in calls)


def parse_point(s: str):
  D, S, kind = s.split(":")
  return int(D), int(S), kind == "c"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--build", action="append", default=[], help="NAME=path to an extension .so")
  p.add_argument("--points", nargs="+", required=True, help="D:S:c (causal) or D:S:n")
  p.add_argument("--peers", nargs="*", default=[], help="peers from jaxflash.bench.peers()")
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--repeats", type=int, default=1, help="time each point this many times")
  p.add_argument("--no-bwd", action="store_true")
  p.add_argument("--sustained", action="store_true",
                 help="also time each implementation alone, sustained (bench.sustained)")
  args = p.parse_args(argv)

  workdir = tempfile.mkdtemp(prefix="jfab")
  names = ["base"]
  for spec in args.build:
    name, path = spec.split("=", 1)
    load_build(name, path, workdir)
    names.append(name)
  others = {n: impl for n, impl in bench.peers("gpu").items() if n in args.peers}
  for n, impl in others.items():
    if isinstance(impl, dict):
      p.error(f"--peers: {n} is tuned over configs; peers of one config only (cudnn, fa3j)")
  backward = not args.no_bwd
  print(f"devices {jax.devices()}; builds {names}; peers {list(others)}", flush=True)
  header = "| D | S | causal | " + " | ".join(names + list(others)) + " | " + " | ".join(
      f"{n}/base" for n in names[1:]) + " |"
  rows = []
  for D, S, causal in map(parse_point, args.points):
    N = args.hidden // D
    B = max(1, args.tokens // S)
    impls = {n: _jaxflash for n in names}
    impls.update(others)
    build_of = {n: n if n in names else "base" for n in impls}  # peers run outside renamed()
    q, k, v, dout = bench.bench_inputs(B, S, S, N, N, D)
    base_out = bench.attention_outputs(_jaxflash, q, k, v, dout, causal, backward)
    diffs = {}
    for n, attn in list(impls.items())[1:]:
      try:
        with renamed(build_of[n]):
          got = bench.attention_outputs(attn, q, k, v, dout, causal,
                                        backward and n not in bench.FORWARD_ONLY)
        diffs[n] = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, base_out)]
      except Exception as e:  # a peer without this shape (FA3 past D = 128): a '-' column
        if n in names:
          raise
        print(f"  {n}: {str(e).splitlines()[0][:160]}", flush=True)
        del impls[n]
    del base_out, q, k, v, dout
    print(f"D={D} S={S} causal={causal}: max |x - base| (out, dq, dk, dv) " +
          "; ".join(f"{n} " + ", ".join(f"{d:.3g}" for d in ds) for n, ds in diffs.items()),
          flush=True)
    calls, failed = bench.prepare({n: functools.partial(
        build_calls, build_of[n], a, B, S, S, N, N, D, causal,
        backward=backward and n not in bench.FORWARD_ONLY) for n, a in impls.items()})
    for n, e in failed.items():
      print(f"  {n}: {e}")
    tf = lambda t, d: bench.flops(B, N, S, S, D, causal, d) / t / 1e12
    for rep in range(args.repeats):
      f_mhz, b_mhz = {}, {}
      fwd = bench.medians_together({n: c[0] for n, c in calls.items()}, reps=args.reps,
                                   clocks=f_mhz)
      bwd = bench.medians_together({n: c[1] for n, c in calls.items() if c[1] is not None},
                                   reps=args.reps, clocks=b_mhz) if backward else {}
      cells = [f"{tf(fwd[n], 'fwd'):.0f}/" + (f"{tf(bwd[n], 'bwd'):.0f}" if n in bwd else "-")
               if n in fwd else "-" for n in names + list(others)]
      ratios = [f"{fwd['base'] / fwd[n]:.3f}/" + (f"{bwd['base'] / bwd[n]:.3f}" if n in bwd
                                                   else "-") for n in names[1:]]
      row = f"| {D} | {S} | {'y' if causal else 'n'} | " + " | ".join(cells + ratios) + " |"
      rows.append(row)
      print(row, flush=True)
      if f_mhz:  # the kernels' own clocks: the machines' power states differ
        print("  SM MHz at the batches' ends fwd/bwd: " + ", ".join(
            f"{n} {f_mhz[n]:.0f}/" + (f"{b_mhz[n]:.0f}" if n in b_mhz else "-")
            for n in names + list(others) if n in f_mhz), flush=True)
    for i, d in enumerate(("fwd", "bwd") if args.sustained else ()):
      alone = bench.sustained({n: c[i] for n, c in calls.items() if c[i] is not None})
      print(f"  sustained {d}, each alone: " + ", ".join(
          f"{n} {tf(sec, d):.0f}" + (f" at {mhz:.0f} MHz" if mhz else "")
          for n, (sec, mhz) in alone.items()), flush=True)
    del calls
  print("\nTFLOP/s fwd/bwd (medians of interleaved rounds); build/base > 1 means faster")
  print(header)
  print("|" + "---|" * (3 + len(names) + len(others) + len(names) - 1))
  print("\n".join(rows))


if __name__ == "__main__":
  main()
