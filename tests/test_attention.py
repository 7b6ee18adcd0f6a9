"""The shared test base: the same cases against every implementation (xla, cpu, cuda)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _calls
from common import (IMPLEMENTATIONS, assert_accurate, assert_matches_reference, gpu, on_device,
                    random_qkv)

# (B, T, S, N, K, H): tile multiples, ragged lengths, Sq != Sk both ways, length 1, GQA, MQA.
SHAPES = [
    (2, 128, 128, 4, 4, 64),
    (1, 77, 45, 4, 2, 64),
    (1, 45, 77, 6, 2, 128),
    (1, 1, 33, 2, 1, 64),
    (2, 33, 1, 2, 2, 128),
    (1, 130, 200, 4, 1, 64),
]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _supported(impl, dtype, H):
  if impl == "cuda" and (jnp.dtype(dtype).name not in jaxflash._ffi.cuda_dtypes() or
                         H not in jaxflash._ffi.cuda_head_dims()):
    pytest.skip("outside the CUDA kernel's support matrix (tested in test_errors)")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_grads(impl, dtype, is_causal, shape):
  B, T, S, N, K, H = shape
  _supported(impl, dtype, H)
  q, k, v = random_qkv(hash(shape) % 1000, B, T, S, N, K, H, dtype)
  dout = jax.random.normal(jax.random.PRNGKey(7), (B, T, N, H), jnp.float32).astype(dtype)
  dlse = jax.random.normal(jax.random.PRNGKey(8), (B, N, T), jnp.float32)

  assert_matches_reference(impl, q, k, v, dout, dlse, is_causal=is_causal)


# Without return_residual lse gets no cotangent: the backward takes none (no zeros written)
# and must give the gradients of <out, dout> alone.
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_grads_without_lse(impl, dtype, is_causal, shape):
  B, T, S, N, K, H = shape
  _supported(impl, dtype, H)
  q, k, v = random_qkv(hash(shape) % 997, B, T, S, N, K, H, dtype)
  dout = jax.random.normal(jax.random.PRNGKey(9), (B, T, N, H), jnp.float32).astype(dtype)
  assert_matches_reference(impl, q, k, v, dout, None, is_causal=is_causal)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS[1:])
def test_backward_writes_no_lse_cotangent(impl):
  """The compiled backward of attention() without return_residual builds no (B, N, T) zeros
  for lse's cotangent: the kernel call takes an empty one."""
  q, k, v = random_qkv(12, 2, 48, 48, 4, 2, 64, jnp.bfloat16)
  with on_device(impl):
    _, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True,
                                                        implementation=impl), q, k, v)
    hlo = jax.jit(lambda vjp, g: vjp(g)).lower(vjp, jnp.ones_like(q)).compile().as_text()
  assert "custom-call" in hlo
  zeros = [l for l in hlo.splitlines() if "broadcast" in l and "f32[2,4,48]" in l]
  assert not zeros, "lse's zero cotangent is materialised: " + zeros[0]


# Row maxima that jump as the key tiles are visited (the sm90 forwards go from the last key
# tile to the first and keep a lazy running max at H = 128): keys below 64 carry logits ~40x
# the others', past any exp2 range (the max moves by hundreds of log2 units), keys below 320
# 3x (it moves by a few). The forwards are persistent but at T = 4200 causal (a CTA a tile) and
# at H = 256 (a CTA a tile, 80-key tiles).
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 300, 700, 4, 2, 128), (1, 4200, 800, 2, 1, 128),
                                   (1, 300, 700, 4, 2, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_logits_jumping_along_keys(impl, dtype, is_causal, shape):
  B, T, S, N, K, H = shape
  _supported(impl, dtype, H)
  q, k, v = random_qkv(11, B, T, S, N, K, H, dtype)
  key = jnp.arange(S)[None, :, None, None]
  k = (k.astype(jnp.float32) * jnp.where(key < 64, 40.0, jnp.where(key < 320, 3.0, 1.0)))
  k = k.astype(dtype)
  dout = jax.random.normal(jax.random.PRNGKey(5), (B, T, N, H), jnp.float32).astype(dtype)
  dlse = jax.random.normal(jax.random.PRNGKey(6), (B, N, T), jnp.float32)
  assert_matches_reference(impl, q, k, v, dout, dlse, is_causal=is_causal)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_scale(impl):
  q, k, v = random_qkv(3, 1, 40, 50, 2, 2, 64, jnp.bfloat16)
  with on_device(impl):
    out = jaxflash.attention(q, k, v, scale=0.3, implementation=impl)
    default = jaxflash.attention(q, k, v, implementation=impl)
  ref, _ = jaxflash.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), scale=0.3)
  lo, _ = jaxflash.attention_reference(q, k, v, scale=0.3)
  assert_accurate("out", out, ref, lo, jnp.bfloat16)
  assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - default.astype(jnp.float32)))) > 1e-2


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_unbatched(impl):
  q, k, v = random_qkv(4, 1, 20, 30, 4, 2, 64, jnp.float16)
  with on_device(impl):
    out, lse = jaxflash.attention(q[0], k[0], v[0], is_causal=True, implementation=impl,
                                  return_residual=True)
  ref, _ = jaxflash.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                        is_causal=True)
  lo, _ = jaxflash.attention_reference(q, k, v, is_causal=True)
  assert out.shape == (20, 4, 64) and lse.shape == (4, 20)
  assert_accurate("out", out, ref[0], lo[0], jnp.float16)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_matches_jax_nn(impl):
  """Drop-in: same arguments, same result as jax.nn.dot_product_attention (GQA, causal)."""
  dtype = jnp.bfloat16 if impl == "cuda" else jnp.float32
  q, k, v = random_qkv(5, 2, 64, 64, 8, 2, 64, dtype)
  with on_device(impl):
    out = jaxflash.attention(q, k, v, is_causal=True, scale=0.2, implementation=impl)
  nn = lambda *xs: jax.nn.dot_product_attention(*xs, is_causal=True, scale=0.2)
  with jax.default_matmul_precision("highest"):  # on GPUs XLA's default rounds to TF32
    ref32, ref_lo = nn(*(x.astype(jnp.float32) for x in (q, k, v))), nn(q, k, v)
  assert_accurate("out", out, ref32, ref_lo, dtype)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_nan_propagates(impl):
  q, k, v = random_qkv(6, 1, 16, 16, 2, 2, 64, jnp.bfloat16)
  q = q.at[0, 3, 1, 5].set(jnp.nan)
  with on_device(impl):
    out = jaxflash.attention(q, k, v, implementation=impl)
  out = np.asarray(out, np.float32)
  assert np.isnan(out[0, 3, 1]).all()
  assert not np.isnan(np.delete(out[0], 3, axis=0)).any()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS[1:])  # a kernel option: cpu, cuda
@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"softcap": 20.0}],
                         ids=["plain", "causal", "softcap"])  # on H100: sm90, sm90, sm80 kernels
@pytest.mark.parametrize("H", [64, 128])
def test_grads_f32(impl, options, H):
  """grads_f32 (ring attention's per-step partials): dq, dk, dv as the kernel accumulates them,
  in float32, which round to exactly the default call's gradients (dq up to its atomics'
  order on CUDA) and are not themselves rounded to bf16."""
  B, T, S, N, K = 2, 200, 333, 4, 2
  q, k, v = random_qkv(9, B, T, S, N, K, H, jnp.bfloat16)
  dout = jax.random.normal(jax.random.PRNGKey(10), (B, T, N, H), jnp.float32).astype(q.dtype)
  dlse = jax.random.normal(jax.random.PRNGKey(11), (B, N, T), jnp.float32)
  kw = dict(scale=H ** -0.5, is_causal=options.get("is_causal", False), platform=impl,
            softcap=options.get("softcap"))
  with on_device(impl):
    out, lse = _calls.fwd(q, k, v, **kw)
    low = _calls.bwd(q, k, v, out, lse, dout, dlse, **kw)
    wide = _calls.bwd(q, k, v, out, lse, dout, dlse, **kw, grads_f32=True)
  for name, lo, hi in zip(("dq", "dk", "dv"), low, wide):
    lo, hi = np.asarray(lo.astype(jnp.float32)), np.asarray(hi)
    assert hi.dtype == np.float32, name
    rounded = np.asarray(jnp.asarray(hi).astype(jnp.bfloat16).astype(jnp.float32))
    assert (rounded != hi)[hi != 0].mean() > 0.9, f"{name}: the float32 gradients look rounded"
    if name == "dq" and impl == "cuda":
      np.testing.assert_allclose(rounded, lo, rtol=2 ** -7, atol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(rounded, lo, err_msg=name)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 16, 16, 128), (1, 2049, 1999, 8, 2, 64),
                                   (4, 513, 4096, 4, 4, 128), (1, 4133, 4133, 4, 2, 128),
                                   (1, 4133, 3001, 4, 2, 64), (2, 640, 1999, 8, 4, 64),
                                   (2, 4133, 1000, 8, 2, 64), (1, 1100, 2001, 4, 2, 256),
                                   (1, 2049, 700, 8, 2, 256), (3, 2500, 2500, 4, 2, 128),
                                   (5, 1500, 1500, 4, 2, 128), (2, 1500, 700, 4, 2, 128),
                                   (2, 1100, 700, 8, 2, 64), (1, 2304, 2304, 4, 2, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cuda_long_sequences(dtype, is_causal, shape):
  """Many tiles in both directions, with ragged tails; the small SHAPES cover the edges. At
  T = 1k the sm90 forwards run persistent CTAs, past T = 4k causal ones one CTA a query tile
  (plain ones stay persistent). At H = 64 the forward runs 3 consumer warpgroups (192-row
  tiles) at T = 2049 and 4133 (causal too), CTAs of several tiles at 4133 x 1000; at T = 640
  two, with 192-key tiles at S = 1999 (the small SHAPES run the 128-key ones). At H = 256 the
  sm90 forward's 80-key tiles end 1 key into the last one, and the sm90 backward (64-key tiles,
  dK and dV split by columns, dQ in two rounds) runs T < S and T > S with GQA. Causal at
  T > S = 700 both warpgroups of the last query tiles see 60 keys of the last key tile (its
  S at half width), at T = S only warpgroup 0 of each diagonal tile. Causal past S = 2048 keys
  (4096, 4133, 3001, 2500, and 2304 at H = 256) the sm90 backward's CTAs walk their query
  tiles last to first, and at H = 128 the second consumer warpgroup leaves the walk's last
  (diagonal) step to the first (with GQA only the last query head's)."""
  test_forward_and_grads("cuda", dtype, is_causal, shape)


# (H, Hv) the CUDA forward runs besides 64 and 128: the other head dims, the MLA shape and a
# value head dim below H (V zero-padded to the kernel's). The backward is checked too where the
# CUDA backward runs the pair (all but 128/64, where test_gpu checks that a gradient says so).
CUDA_FWD_HEAD_DIMS = [(32, 32), (96, 96), (192, 192), (256, 256), (192, 128), (128, 64)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dims", CUDA_FWD_HEAD_DIMS, ids=lambda d: "%dx%d" % d)
# (B, T, S, N, K): ragged lengths over several query and key tiles with GQA, Sq > Sk, length 1
@pytest.mark.parametrize("shape", [(2, 300, 517, 8, 2), (1, 77, 45, 4, 4), (1, 1, 33, 2, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cuda_head_dims(dtype, is_causal, head_dims, shape):
  (H, Hv), (B, T, S, N, K) = head_dims, shape
  if H not in jaxflash._ffi.cuda_head_dims() or Hv not in jaxflash._ffi.cuda_head_dims():
    pytest.skip("head dim not in this build (JAXFLASH_HEAD_DIMS)")
  q, k, v = random_qkv(H + Hv + T, B, T, S, N, K, H, dtype, Hv=Hv)
  if _calls.cuda_bwd_head_dims_error(H, Hv) is None:  # forward, lse and gradients
    dout = jax.random.normal(jax.random.PRNGKey(T), (B, T, N, Hv), jnp.float32).astype(dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(S), (B, N, T), jnp.float32)
    assert_matches_reference("cuda", q, k, v, dout, dlse, is_causal=is_causal)
    return
  run = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, is_causal=is_causal,
                                                   implementation="cuda", return_residual=True))
  with on_device("cuda"):
    out, lse = run(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref, ref_lse = jaxflash.attention_reference(*f32, is_causal=is_causal)
  lo, lo_lse = jaxflash.attention_reference(q, k, v, is_causal=is_causal)
  assert out.shape == (B, T, N, Hv) and out.dtype == dtype
  assert_accurate("out", out, ref, lo, dtype)
  assert_accurate("lse", lse, ref_lse, lo_lse, dtype)
