"""The benchmark helpers: rounds that interleave the implementations, the output check that
decides which peers are timed, and benchmarks/ab_builds.py's second build of the extension."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash import _ffi, bench
from common import on_host

POINT = (1, 96, 96, 2, 2, 32)  # B, T, S, N, K, H


def test_medians_together_rotates_the_order_each_round():
  order = []

  def call(name):
    def fn(x):
      order.append(name)
      return x + 1
    return fn, (jnp.ones(4),)

  got = bench.medians_together({"a": call("a"), "b": call("b"), "c": call("c")}, warmup=1,
                               reps=3)
  assert set(got) == {"a", "b", "c"} and all(t > 0 for t in got.values())
  # runs of one name: each call's warm-up and batch-size probe, then the rounds' batches
  runs = [name for name, _ in itertools.groupby(order)]
  assert runs == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
  assert bench.medians_together({}) == {}


def test_medians_together_reads_the_clock_after_each_batch():
  ticks = iter(range(100, 200))
  clocks = {}
  call = (lambda x: x + 1, (jnp.ones(4),))
  bench.medians_together({"a": call, "b": call}, warmup=1, reps=3, clocks=clocks,
                         clock=lambda: next(ticks))
  # rounds a b, b a, a b: a reads 100, 103, 104 and b 101, 102, 105
  assert clocks == {"a": 103, "b": 102}
  none = {}
  bench.medians_together({"a": call}, warmup=1, reps=2, clocks=none, clock=lambda: None)
  assert none == {}


def test_sustained_times_each_call_alone_past_its_settling():
  """Per-call seconds of a call that takes 2 ms, the clock read only after the settling time,
  and the two runs (in order, then reversed) averaged."""
  order, reads = [], []

  def call(name):
    def fn(x):
      time.sleep(0.002)
      if not order or order[-1] != name:
        order.append(name)
      return x
    return fn, (jnp.ones(4),)

  def clock():
    reads.append(order[-1])
    return 1000 + 10 * len(reads)
  got = bench.sustained({"a": call("a"), "b": call("b")}, idle=0, settle=0.03, measure=0.06,
                        clock=clock)
  assert order == ["a", "b", "a"]  # a, b, then b, a
  for seconds, mhz in got.values():
    assert 0.002 <= seconds < 0.005, seconds
    assert mhz > 1000
  # ~10-call batches of 2 ms: about 3 clock reads a run past 30 ms of settling, none before
  assert 6 <= len(reads) <= 20, reads
  none = bench.sustained({"a": call("a")}, idle=0, settle=0, measure=0.01, clock=lambda: None)
  assert none["a"][1] is None


def test_measure_point_times_only_right_outputs():
  right = lambda q, k, v, c: jaxflash.attention(q, k, v, is_causal=c, implementation="xla")
  wrong_out = lambda q, k, v, c: right(q, k, v, c) + 1.0
  # the output right, the gradient of k cut
  wrong_grads = lambda q, k, v, c: right(q, jax.lax.stop_gradient(k), v, c)

  def fails(q, k, v, c):
    raise NotImplementedError("no such shape")

  impls = {"jaxflash": lambda q, k, v, c: jaxflash.attention(q, k, v, is_causal=c),
           "wrong_out": wrong_out, "wrong_grads": wrong_grads, "fails": fails,
           "tuned": {"x": wrong_out, "y": right}}
  got = bench.measure_point(impls, *POINT, True, jnp.float32)
  t_fwd, t_bwd, _, errors = got["jaxflash"]
  assert t_fwd > 0 and t_bwd > 0 and errors == []
  assert got["wrong_out"][:2] == (None, None) and "wrong output" in got["wrong_out"][3][0]
  t_fwd, t_bwd, _, errors = got["wrong_grads"]
  assert t_fwd > 0 and t_bwd is None and "wrong gradients" in errors[0]
  assert got["fails"][:2] == (None, None)
  assert got["fails"][3] == ["NotImplementedError: no such shape"]
  t_fwd, t_bwd, config, errors = got["tuned"]
  assert t_fwd > 0 and t_bwd > 0 and config == "y" and errors[0].startswith("x: wrong output")


BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name):
  """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


@pytest.mark.skipif(not _ffi.cpu_built(), reason="needs the compiled extension")
@on_host
def test_ab_builds_runs_a_second_build_under_its_own_targets(tmp_path):
  """A second copy of the extension, loaded by ab_builds, serves every call traced inside
  renamed() (the custom_vjp's backward too) and gives the installed build's results."""
  ab = _script("ab_builds")
  ab.load_build("twin", _ffi._ext.__file__, str(tmp_path))
  q, k, v, dout = bench.bench_inputs(1, 96, 80, 4, 2, 32, jnp.float32)
  attn = lambda q, k, v, c: jaxflash.attention(q, k, v, is_causal=c, implementation="cpu")
  text = {name: jax.jit(ab.in_build(name, lambda q, k, v: attn(q, k, v, True)))
          .lower(q, k, v).as_text() for name in ("base", "twin")}
  assert "jfab_twin_fwd_cpu" in text["twin"] and "jfab_twin" not in text["base"]
  got = {}
  for name in ("base", "twin"):
    with ab.renamed(name):
      _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, True), q, k, v)
      got[name] = jax.jit(lambda vjp, dout: vjp(dout)).lower(vjp, dout).as_text()
  assert "jfab_twin_bwd_cpu" in got["twin"] and "jfab_twin" not in got["base"]
  base_out = bench.attention_outputs(attn, q, k, v, dout, True)
  with ab.renamed("twin"):
    twin_out = bench.attention_outputs(attn, q, k, v, dout, True)
  for a, b in zip(base_out, twin_out):
    assert jnp.array_equal(a, b)


@pytest.mark.skipif(not _ffi.cpu_built(), reason="needs the compiled extension")
@on_host
def test_masked_times_every_case_and_counts_what_it_hides(monkeypatch):
  """benchmarks/masked.py on a small shape: every case, the variants that hide nothing
  included, runs forward and forward+backward through jaxflash's CPU kernel, and the visible
  share follows the specification's rules only."""
  monkeypatch.syspath_prepend(str(BENCHMARKS))  # masked.py imports bench.py beside it
  masked = _script("masked")
  args = masked.argparse.Namespace(batch=1, seqlen=256, heads=2, head_dim=32, window=32, docs=4,
                                   mask_block=64, density=0.25, warmup=1, reps=1,
                                   deterministic=False, cases=None)
  rows = {r["case"]: r for r in masked.run(args, "cpu") if r["impl"] == "jaxflash"}
  assert {"bias", "bias_keys", "alibi_causal", "softcap", "dropout"} <= set(rows)
  for case, r in rows.items():
    assert isinstance(r["fwd"], float) and isinstance(r["fwd_bwd"], float), (case, r)
  for case in ("full", "bias", "bias_keys", "softcap", "dropout"):
    assert rows[case]["visible"] == 1.0
  assert rows["alibi_causal"]["visible"] == rows["causal"]["visible"] == (256 * 257 / 2) / 256**2
  assert rows["padding"]["visible"] == 0.25
  args.cases = ["softcap"]
  assert [r["case"] for r in masked.run(args, "cpu")] == ["full", "softcap"]
  args.cases = ["softcapp"]
  with pytest.raises(ValueError, match="softcapp"):
    masked.run(args, "cpu")
