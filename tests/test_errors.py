"""Bad input: clear Python errors before any launch, and ffi::Error (not a crash) in handlers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _calls, _ffi
from common import random_qkv

Q, K, V = random_qkv(0, 2, 16, 16, 4, 2, 64, jnp.float32)


@pytest.mark.parametrize("args, match", [
    ((Q[0, 0], K, V), "query must have rank 3"),
    ((Q, K[0], V), "all be batched or all unbatched|key must have rank"),
    ((Q, K[:1], V[:1]), "same batch size"),
    ((Q, K, V[:, :8]), "key and value must agree"),
    ((Q, K[..., :32], V), "same head dim"),
    ((Q[:, :, :3], K, V), "multiple of key/value heads"),
    ((Q, K.astype(jnp.bfloat16), V), "share one dtype"),
    ((Q.astype(jnp.int32), K.astype(jnp.int32), V.astype(jnp.int32)), "dtype must be"),
])
@pytest.mark.parametrize("impl", [None, "xla", "cpu"])
def test_shape_errors_name_the_argument(args, match, impl):
  with pytest.raises(ValueError, match=match) as e:
    jaxflash.attention(*args, implementation=impl)
  assert "got query" in str(e.value)


def test_unknown_implementation():
  with pytest.raises(ValueError, match="implementation must be one of"):
    jaxflash.attention(Q, K, V, implementation="triton")


def test_cuda_request_without_cuda_says_why():
  if _ffi.cuda_built() and jax.default_backend() == "gpu":
    with pytest.raises(ValueError, match="float16 or bfloat16"):
      jaxflash.attention(Q, K, V, implementation="cuda")
    with pytest.raises(ValueError, match="head dims"):
      jaxflash.attention(*(x[..., :40].astype(jnp.bfloat16) for x in (Q, K, V)),
                         implementation="cuda")
  elif not _ffi.cuda_built():
    with pytest.raises(ValueError, match="built without CUDA"):
      jaxflash.attention(Q.astype(jnp.bfloat16), K.astype(jnp.bfloat16),
                         V.astype(jnp.bfloat16), implementation="cuda")


@pytest.mark.parametrize("outs, match", [
    (lambda q: (jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((2, 4, 15), jnp.float32)), "lse has shape"),
    (lambda q: (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                jax.ShapeDtypeStruct((2, 4, 16), jnp.float32)), "share one dtype"),
    (lambda q: (jax.ShapeDtypeStruct(q.shape[1:], q.dtype),
                jax.ShapeDtypeStruct((4, 16), jnp.float32)), "rank >= 4"),
])
def test_handler_validates_and_returns_an_error(outs, match):
  """Calling the FFI target directly with malformed buffers fails cleanly, no crash."""
  call = jax.ffi.ffi_call("jaxflash_fwd_cpu", outs(Q))
  ops, attrs = _calls._variant_inputs(Q, None, None, False, None, 0.0)
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=match):
    jax.block_until_ready(call(Q, K, V, *ops, scale=np.float32(0.1), is_causal=False, **attrs))


def test_handler_rejects_gqa_mismatch():
  call = jax.ffi.ffi_call("jaxflash_fwd_cpu", (jax.ShapeDtypeStruct((2, 16, 3, 64), Q.dtype),
                                               jax.ShapeDtypeStruct((2, 3, 16), jnp.float32)))
  ops, attrs = _calls._variant_inputs(Q, None, None, False, None, 0.0)
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match="multiple"):
    jax.block_until_ready(call(Q[:, :, :3], K, V, *ops, scale=np.float32(0.1),
                               is_causal=False, **attrs))


@pytest.mark.parametrize("dtypes, match", [
    ((jnp.float32, jnp.bfloat16, jnp.float32), "share one dtype"),
    ((jnp.float16,) * 3, "q's dtype or be float32"),
])
def test_bwd_handler_validates_gradient_dtypes(dtypes, match):
  """dq, dk, dv come all in q's dtype or all in float32 (grads_f32): anything else is an
  error from the handler, no crash."""
  q, k, v = (x.astype(jnp.bfloat16) for x in (Q, K, V))
  ops, attrs = _calls._variant_inputs(q, None, None, False, None, 0.0)
  out, lse = jnp.zeros(q.shape, q.dtype), jnp.zeros((2, 4, 16), jnp.float32)
  grads = tuple(jax.ShapeDtypeStruct(x.shape, d) for x, d in zip((q, k, v), dtypes))
  dead = (jax.ShapeDtypeStruct((0,), q.dtype), jax.ShapeDtypeStruct((0,), jnp.float32))
  call = jax.ffi.ffi_call("jaxflash_bwd_cpu", grads + dead)
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=match):
    jax.block_until_ready(call(q, k, v, out, lse, out, lse, jnp.zeros((0,), jnp.float32), *ops,
                               scale=np.float32(0.1), is_causal=False, **attrs))


@pytest.fixture
def fake_cuda_build(monkeypatch):
  """What a CUDA build with every head dim reports."""
  monkeypatch.setattr(_ffi, "cuda_built", lambda: True)
  monkeypatch.setattr(_ffi, "cuda_head_dims", lambda: (32, 64, 96, 128, 192, 256))
  monkeypatch.setattr(_ffi, "cuda_bwd_head_dims", lambda: (32, 64, 96, 128, 192, 256))
  monkeypatch.setattr(_ffi, "cuda_dtypes", lambda: ("float16", "bfloat16"))


@pytest.mark.parametrize("H, Hv", [(40, 40), (64, 128), (192, 100), (512, 512)])
def test_cuda_rejects_head_dims_it_lacks(fake_cuda_build, H, Hv):
  q, k, v = random_qkv(1, 1, 8, 8, 2, 2, H, jnp.bfloat16, Hv=Hv)
  with pytest.raises(ValueError, match=rf"head dims H and Hv in \(32, 64, 96, 128, 192, 256\) "
                                       rf"with Hv <= H, got H={H}, Hv={Hv}"):
    jaxflash.attention(q, k, v, implementation="cuda")


def test_cuda_rejects_dtypes_the_build_lacks(fake_cuda_build, monkeypatch):
  """A build restricted by JAXFLASH_DTYPES: 'cuda' names the dtype before any launch, None
  takes the reference for it (traced only: no GPU here)."""
  monkeypatch.setattr(_ffi, "cuda_dtypes", lambda: ("bfloat16",))
  q, k, v = random_qkv(1, 1, 8, 8, 2, 2, 64, jnp.float16)
  with pytest.raises(ValueError, match=r"this build's CUDA kernels take bfloat16 "
                                       r"\(JAXFLASH_DTYPES\), got float16"):
    jaxflash.attention(q, k, v, implementation="cuda")
  assert "jaxflash_fwd_cuda" not in str(jax.make_jaxpr(
      lambda q: jaxflash.attention(q, k, v))(q))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  assert "jaxflash_fwd_cuda" in str(jax.make_jaxpr(
      lambda q: jaxflash.attention(q, *bf[1:], implementation="cuda"))(bf[0]))


@pytest.mark.parametrize("H, Hv", [(128, 64), (256, 128), (96, 32), (192, 64)])
def test_grad_at_forward_only_head_dims(fake_cuda_build, H, Hv):
  """Traced only (no GPU here): the CUDA forward takes these head dims; its gradient raises a
  NotImplementedError naming them when pinned to 'cuda', and with implementation=None the
  GPU branch keeps the CUDA backward (whose handler names them) instead of the reference VJP,
  while the CPU branch still differentiates."""
  q, k, v = random_qkv(2, 1, 24, 40, 4, 2, H, jnp.bfloat16, Hv=Hv)
  fwd = lambda impl, **kw: lambda q: jaxflash.attention(q, k, v, implementation=impl, **kw)
  assert "jaxflash_fwd_cuda" in str(jax.make_jaxpr(fwd("cuda"))(q))
  loss = lambda f: lambda q: jnp.sum(f(q).astype(jnp.float32))
  with pytest.raises(NotImplementedError,
                     match=rf"supports head dims \(32, 64, 96, 128, 192, 256\) with Hv == H, "
                           rf"and H=192, Hv=128, got H={H}, Hv={Hv}"):
    jax.make_jaxpr(jax.grad(loss(fwd("cuda"))))(q)
  for kw in ({}, dict(local_window_size=5)):  # a variant would otherwise use the reference VJP
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(fwd(None, **kw))))(q))
    assert "jaxflash_bwd_cuda" in jaxpr and "jaxflash_bwd_cpu" in jaxpr
  with jax.default_device(jax.devices("cpu")[0]):
    got = jax.jit(jax.grad(loss(fwd(None))))(q)
    want = jax.jit(jax.grad(loss(fwd("cpu"))))(q)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("pinned, other", [("cpu", "cuda"), ("cuda", "cpu")])
def test_pinned_kernel_on_another_platform(fake_cuda_build, pinned, other):
  """A pinned kernel lowered for the other platform (lowering_platforms needs no such device
  here) raises a ValueError naming the implementation, forward and gradient, instead of XLA's
  missing FFI handler; on its own platform the same call lowers."""
  q, k, v = random_qkv(1, 1, 16, 16, 2, 2, 64, jnp.bfloat16)
  fwd = lambda q: jaxflash.attention(q, k, v, is_causal=True, implementation=pinned)
  grad = jax.grad(lambda q: jnp.sum(fwd(q).astype(jnp.float32)))
  for fn in (fwd, grad):
    with pytest.raises(ValueError, match=rf"implementation='{pinned}' runs on .* devices only, "
                                         rf"but this computation runs on {other}"):
      jax.jit(fn).trace(q).lower(lowering_platforms=(other,))
    hlo = jax.jit(fn).trace(q).lower(lowering_platforms=(pinned,)).as_text()
    assert f"jaxflash_{'bwd' if fn is grad else 'fwd'}_{pinned}" in hlo
  if jax.default_backend() == {"cuda": "gpu"}.get(other, other):  # eagerly, on the default device
    with pytest.raises(ValueError, match=f"implementation='{pinned}' runs on"):
      fwd(q)
