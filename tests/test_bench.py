"""The benchmark helpers: rounds that interleave the implementations, and the output check
that decides which peers are timed."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import bench

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
