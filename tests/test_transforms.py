"""Transformations through the custom call: jit, vmap patterns, grad, vjp, remat, pmap, eval_shape."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from common import IMPLEMENTATIONS, on_device, random_qkv

KERNELS = [i for i in IMPLEMENTATIONS if i != "xla"]


def _attn(impl, **kw):
  return functools.partial(jaxflash.attention, implementation=impl, **kw)


def _ref(q, k, v, **kw):
  return jaxflash.attention_reference(q, k, v, **kw)[0]


def _dtype(impl):
  """The CUDA kernels take half precision; the other implementations are checked in float32."""
  return jnp.bfloat16 if impl == "cuda" else jnp.float32


def _inputs(impl, seed, *shape):
  """Inputs in the implementation's dtype, and their float32 copies for the reference."""
  q, k, v = random_qkv(seed, *shape, _dtype(impl))
  return (q, k, v), tuple(x.astype(jnp.float32) for x in (q, k, v))


def _close(got, want, impl):
  """Loose elementwise check: these tests are about transformations; accuracy is tested
  with the accuracy rule in test_attention.py."""
  tol = 3e-2 if _dtype(impl) == jnp.bfloat16 else 5e-5
  np.testing.assert_allclose(np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(want),
                             atol=tol, rtol=tol)


def _hlo_has_target(fn, *args, name):
  return name in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("impl", KERNELS)
def test_runs_the_custom_call(impl):
  (q, k, v), _ = _inputs(impl, 0, 1, 8, 8, 2, 2, 64)
  with on_device(impl):
    assert _hlo_has_target(_attn(impl), q, k, v, name=f"jaxflash_fwd_{impl}")
    grad = jax.grad(lambda q: _attn(impl)(q, k, v).astype(jnp.float32).sum())
    assert _hlo_has_target(grad, q, name=f"jaxflash_bwd_{impl}")


def test_default_implementation_is_the_kernel_on_cpu():
  q, k, v = random_qkv(0, 1, 8, 8, 2, 2, 64, jnp.float32)
  with jax.default_device(jax.devices("cpu")[0]):
    text = jax.jit(jaxflash.attention).lower(q, k, v).as_text()
  assert "jaxflash_fwd_cpu" in text


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 1, 1), (1, 0, None)],
                         ids=str)
def test_vmap_patterns(impl, in_axes):
  qkv, _ = _inputs(impl, 1, 2, 16, 24, 4, 2, 64)
  stack = lambda x, ax: x if ax is None else jnp.stack([x, x * 0.5 + 0.1, -x], axis=ax)
  args = [stack(x, ax) for x, ax in zip(qkv, in_axes)]
  with on_device(impl):
    got = jax.vmap(_attn(impl, is_causal=True), in_axes=in_axes)(*args)
    # no per-element loop: the batched call is one custom call on broadcast operands
    text = jax.jit(jax.vmap(_attn(impl, is_causal=True), in_axes=in_axes)).lower(*args).as_text()
  want = jax.vmap(functools.partial(_ref, is_causal=True), in_axes=in_axes)(
      *(x.astype(jnp.float32) for x in args))
  _close(got, want, impl)
  assert text.count(f"jaxflash_fwd_{impl}") == 1 and "while" not in text


@pytest.mark.parametrize("impl", KERNELS)
def test_nested_vmap_and_vmap_of_grad(impl):
  (q, k, v), (q32, k32, v32) = _inputs(impl, 2, 3, 8, 8, 2, 1, 64)
  stack = lambda x: jnp.stack([x, x * 2])  # (2, 3, T, N, H): two nested mapped dims
  f = lambda impl: lambda q, k, v: jnp.sum(
      _attn(impl)(q[None], k[None], v[None]).astype(jnp.float32) ** 2)
  g_impl = lambda impl: jax.vmap(jax.vmap(jax.grad(f(impl), argnums=(0, 1, 2)),
                                          in_axes=(0, 0, 0)), in_axes=(0, None, None))
  with on_device(impl):
    got = g_impl(impl)(stack(q), k, v)
  want = g_impl("xla")(stack(q32), k32, v32)
  for a, b in zip(got, want):
    assert a.shape == b.shape
    _close(a, b, impl)


@pytest.mark.parametrize("impl", KERNELS)
def test_vjp_remat_and_jit_grad(impl):
  (q, k, v), qkv32 = _inputs(impl, 3, 2, 20, 20, 2, 2, 64)
  def loss(attn):
    return lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v, is_causal=True).astype(jnp.float32)))
  with on_device(impl):
    out, vjp = jax.vjp(_attn(impl, is_causal=True), q, k, v)
    ct = vjp(jnp.ones_like(out))
    g_remat = jax.jit(jax.grad(jax.checkpoint(loss(_attn(impl))), argnums=(0, 1, 2)))(q, k, v)
  out32, vjp_ref = jax.vjp(functools.partial(_ref, is_causal=True), *qkv32)
  ct_ref = vjp_ref(jnp.ones_like(out32))
  g_ref = jax.grad(loss(lambda *a, **kw: _ref(*a, **kw)), argnums=(0, 1, 2))(*qkv32)
  for a, b in zip(ct + g_remat, ct_ref + g_ref):
    _close(a, b, impl)


def test_pmap_over_cpu_devices():
  devs = jax.devices("cpu")
  assert len(devs) >= 4, "conftest sets 8 fake CPU devices"
  q, k, v = random_qkv(4, 4, 16, 16, 2, 2, 64, jnp.float32)
  f = jax.pmap(lambda q, k, v: _attn("cpu", is_causal=True)(q[None], k[None], v[None])[0],
               devices=devs[:4])
  g = jax.pmap(jax.grad(lambda q, k, v: jnp.sum(_attn("cpu")(q[None], k[None], v[None]) ** 2)),
               devices=devs[:4])
  _close(f(q, k, v), jax.vmap(functools.partial(_ref, is_causal=True))(
      q[:, None], k[:, None], v[:, None])[:, 0], "cpu")
  _close(g(q, k, v), jax.vmap(jax.grad(lambda q, k, v: jnp.sum(_ref(
      q[None], k[None], v[None]) ** 2)))(q, k, v), "cpu")


def test_eval_shape_and_lowering_run_no_kernel():
  q = jax.ShapeDtypeStruct((2, 4096, 16, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 8192, 4, 128), jnp.bfloat16)
  out, lse = jax.eval_shape(functools.partial(jaxflash.attention, return_residual=True), q, kv, kv)
  assert out.shape == (2, 4096, 16, 128) and out.dtype == jnp.bfloat16
  assert lse.shape == (2, 16, 4096) and lse.dtype == jnp.float32
  grads = jax.eval_shape(jax.grad(lambda q, k, v: jaxflash.attention(q, k, v).astype(
      jnp.float32).sum(), argnums=(0, 1, 2)), q, kv, kv)
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
  with jax.default_device(jax.devices("cpu")[0]):
    jax.jit(_attn("cpu")).lower(q, kv, kv).compile()


@pytest.mark.parametrize("impl", KERNELS)
def test_forward_mode_is_a_clear_error(impl):
  (q, k, v), _ = _inputs(impl, 5, 1, 8, 8, 2, 2, 64)
  with on_device(impl), pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(_attn(impl), (q, k, v), (q, k, v))
