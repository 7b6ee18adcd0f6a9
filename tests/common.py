"""Shared helpers: implementations under test, random inputs, the accuracy rule."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash import _ffi
from jaxflash.check import accuracy, check_against_reference


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


gpu = pytest.mark.skipif(not (has_gpu() and _ffi.cuda_built()),
                         reason="needs a CUDA GPU and jaxflash built with CUDA kernels")

# Every test in the shared base runs once per implementation; 'cuda' only where it can.
IMPLEMENTATIONS = ["xla", "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


def device_for(impl):
  """The device an implementation runs on: 'cpu' always on the host, others on the default."""
  if impl == "cpu":
    return jax.devices("cpu")[0]
  if impl == "cuda":
    return jax.devices("gpu")[0]
  return jax.devices()[0]


@contextlib.contextmanager
def on_device(impl):
  with jax.default_device(device_for(impl)):
    yield


def on_host(test):
  """Runs `test` with the CPU as the default device, for tests pinned to implementation='cpu'
  (which runs on CPU devices only) that must pass on GPU machines too."""
  @functools.wraps(test)
  def wrapped(*args, **kwargs):
    with on_device("cpu"):
      return test(*args, **kwargs)
  return wrapped


def random_qkv(seed, B, T, S, N, K, H, dtype, Hv=None):
  """Fresh normal inputs (never zeros), generated in fp32 and rounded to dtype."""
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, Hv or H), jnp.float32).astype(dtype)
  return q, k, v


def assert_accurate(name, got, ref32, ref_lo, dtype):
  """The accuracy rule (jaxflash.check) as a test assertion."""
  assert got.shape == ref32.shape, (name, got.shape, ref32.shape)
  err, bound = accuracy(got, ref32, ref_lo, dtype)
  assert err <= bound, f"{name}: max error {err:.3e} exceeds bound {bound:.3e}"


def assert_matches_reference(impl, q, k, v, dout, dlse, **kw):
  """Forward, lse and grads of `impl` against the reference under the accuracy rule."""
  with on_device(impl):
    errors = check_against_reference(
        functools.partial(jaxflash.attention, implementation=impl), q, k, v, dout, dlse, **kw)
  bad = {n: e for n, e in errors.items() if not e[0] <= e[1]}
  assert not bad, "errors (max error, bound) over the bound: " + ", ".join(
      f"{n}: {e[0]:.3e} > {e[1]:.3e}" for n, e in bad.items())
