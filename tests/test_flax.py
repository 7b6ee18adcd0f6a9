"""jaxflash.flax: attention_fn adapter, linen/nnx modules, decode, block, training curve.

Accuracy rule: the f32 reference is the computation on float32 copies; the implementation's
error against it must be <= 2x the error of the reference run in the input dtype, + atol.
"""

import functools
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxflash
import jaxflash.flax as jf
from common import on_host

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def assert_accurate(impl, ref_lowp, ref_f32, atol):
  """Leaf-wise accuracy rule on pytrees of arrays."""
  assert jax.tree.structure(impl) == jax.tree.structure(ref_f32)
  for (path, a), r, r32 in zip(jax.tree_util.tree_leaves_with_path(impl),
                               jax.tree.leaves(ref_lowp), jax.tree.leaves(ref_f32)):
    name, a = jax.tree_util.keystr(path), np.asarray(a, np.float32)
    err = np.max(np.abs(a - np.asarray(r32, np.float32)))
    bar = np.max(np.abs(np.asarray(r, np.float32) - np.asarray(r32, np.float32)))
    assert err <= 2 * bar + atol, f"{name}: error {err} > 2 * {bar} + {atol}"


ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  """Flax's modules are the references here. On GPUs XLA rounds their float32 products to TF32
  by default (~1e-3 off), while jaxflash's float32 path multiplies in full (HIGHEST), so the
  comparisons hold both to full float32 products, as on CPUs."""
  with jax.default_matmul_precision("highest"):
    yield


# ---------------------------------------------------------------- the attention_fn adapter

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", ["gqa_causal", "mask", "bias"])
def test_adapter_matches_reference(dtype, variant):
  B, T, N, K, H = 2, 24, 4, (2 if variant == "gqa_causal" else 4), 16
  q, k, v = rand(0, (B, T, N, H), dtype), rand(1, (B, T, K, H), dtype), rand(2, (B, T, K, H),
                                                                              dtype)
  extra = {}
  if variant == "mask":  # a Flax-style float padding mask, (B, 1, T, S)
    lengths = jnp.array([T, T // 2])
    extra["mask"] = nn.make_attention_mask(jnp.ones((B, T)), jnp.arange(T) < lengths[:, None])
  if variant == "bias":
    extra["bias"] = rand(3, (1, N, T, T))
  is_causal = variant in ("causal", "gqa_causal")

  def ours(q, k, v):
    return jf.dot_product_attention(q, k, v, is_causal=is_causal, **extra)

  def ref(q, k, v):
    return jaxflash.attention_reference(q, k, v, is_causal=is_causal, **extra)[0]

  dout = rand(4, (B, T, N, H), dtype)
  both = lambda f: jax.jit(lambda *a: jax.vjp(f, *a)[0:1] + (
      jax.vjp(f, *a)[1](dout.astype(a[0].dtype)),))
  assert_accurate(both(ours)(q, k, v), both(ref)(q, k, v), both(ref)(*f32((q, k, v))),
                  ATOL[dtype])


def test_adapter_batch_dims_and_dtype():
  # two batch dims, a mask broadcast over one of them, and `dtype` casting float32 inputs
  q, k, v = rand(0, (2, 3, 8, 2, 16)), rand(1, (2, 3, 8, 2, 16)), rand(2, (2, 3, 8, 2, 16))
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (3, 1, 8, 8)).at[..., 0].set(True)
  out = jax.jit(functools.partial(jf.dot_product_attention, dtype=jnp.bfloat16))(
      q, k, v, mask=mask)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  ref = jax.jit(jax.vmap(jax.vmap(lambda q, k, v, m: jaxflash.attention_reference(
      q[None], k[None], v[None], mask=m[None])[0][0]), in_axes=(0, 0, 0, None)))
  ref_lowp = ref(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask)
  assert_accurate(out, ref_lowp, ref(q, k, v, mask), ATOL[jnp.bfloat16])
  # unbatched [T, N, H]
  out = jf.dot_product_attention(q[0, 0], k[0, 0], v[0, 0], is_causal=True)
  ref = jaxflash.attention_reference(q[0, :1], k[0, :1], v[0, :1], is_causal=True)[0][0]
  np.testing.assert_allclose(out, ref, atol=2e-5)


def test_adapter_refuses_what_it_cannot_honour():
  q = rand(0, (1, 8, 2, 16))
  with pytest.raises(NotImplementedError, match="broadcast_dropout"):  # Flax's default
    jf.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=False,
                             dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match="dropout_rng"):
    jf.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=False,
                             broadcast_dropout=False)
  with pytest.raises(NotImplementedError, match="precision"):
    jf.dot_product_attention(q, q, q, precision=jax.lax.Precision.HIGHEST)
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum"):
    jf.dot_product_attention(q, q, q, qk_attn_weights_einsum=jnp.einsum,
                             attn_weights_value_einsum=jnp.einsum)
  # honoured: no dropout when deterministic, HIGHEST is exact for 16-bit inputs
  base = jf.dot_product_attention(q, q, q)
  np.testing.assert_array_equal(
      jf.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=True), base)
  qb = q.astype(jnp.bfloat16)
  np.testing.assert_array_equal(jf.dot_product_attention(qb, qb, qb, precision="highest"),
                                jf.dot_product_attention(qb, qb, qb))


def test_adapter_dropout():
  """broadcast_dropout=False runs jaxflash's dropout: reproducible, and the same masks as
  jaxflash.attention on the folded batch, in the forward and the backward."""
  q, k, v = rand(0, (2, 3, 16, 4, 16)), rand(1, (2, 3, 16, 2, 16)), rand(2, (2, 3, 16, 2, 16))
  mask = jax.random.bernoulli(jax.random.key(3), 0.8, (3, 1, 16, 16))
  rng = jax.random.key(4)
  fold = lambda x: x.reshape((6,) + x.shape[2:])
  drop = dict(dropout_rate=0.3, deterministic=False, broadcast_dropout=False)

  @functools.partial(jax.jit, static_argnames="impl")
  def ours(q, k, v, rng, impl=None):
    f = lambda q, k, v: jf.dot_product_attention(q, k, v, mask=mask, dropout_rng=rng,
                                                 implementation=impl, **drop)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(rand(5, out.shape))

  @jax.jit
  def direct(q, k, v, rng):
    m = jnp.broadcast_to(mask, (2, 3, 1, 16, 16)).reshape(6, 1, 16, 16)
    f = lambda q, k, v: jaxflash.attention(q, k, v, mask=m, dropout_rate=0.3, dropout_rng=rng)
    out, vjp = jax.vjp(f, *map(fold, (q, k, v)))
    return out, vjp(fold(rand(5, q.shape)))

  out, grads = ours(q, k, v, rng)
  jax.tree.map(np.testing.assert_array_equal, (out, grads), ours(q, k, v, rng))
  ref_out, ref_grads = direct(q, k, v, rng)
  np.testing.assert_array_equal(fold(out), ref_out)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(fold(a), b), grads, ref_grads)
  # the reference draws the same masks
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), (out, grads),
               ours(q, k, v, rng, "xla"))
  # dropout happened, and a new key draws new masks
  base = jf.dot_product_attention(q, k, v, mask=mask)
  assert not np.allclose(out, base, atol=1e-3)
  assert not np.allclose(out, ours(q, k, v, jax.random.key(5))[0], atol=1e-3)


def test_modules_dropout():
  """Flax's dropout plumbing (rngs 'dropout', deterministic) reaches the kernel."""
  x = rand(0, (2, 8, 16))
  linen = lambda **kw: jf.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5, **kw)
  params = linen().init(jax.random.key(1), x, deterministic=True)
  with pytest.raises(NotImplementedError, match="broadcast_dropout"):
    linen().apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  m = linen(broadcast_dropout=False)
  run = lambda seed: m.apply(params, x, deterministic=False,
                             rngs={"dropout": jax.random.key(seed)})
  np.testing.assert_array_equal(run(2), run(2))
  assert not np.allclose(run(2), run(3), atol=1e-3)
  np.testing.assert_array_equal(m.apply(params, x, deterministic=True),
                                linen().apply(params, x, deterministic=True))

  nnx_mha = lambda seed: jf.MultiHeadAttention(2, 16, dropout_rate=0.5, broadcast_dropout=False,
                                               decode=False, rngs=nnx.Rngs(0, dropout=seed))
  a, b = nnx_mha(2), nnx_mha(2)
  np.testing.assert_array_equal(a(x, deterministic=False), b(x, deterministic=False))
  # the module's dropout stream advances: the next call draws new masks
  assert not np.allclose(a(x, deterministic=False), b(x, deterministic=True), atol=1e-3)
  assert not np.allclose(a(x, deterministic=False), a(x, deterministic=False), atol=1e-3)


def test_lazy_flax_attribute():
  """`jaxflash.flax` after a plain `import jaxflash`, which itself does not import flax."""
  code = ("import sys, jaxflash; assert 'flax' not in sys.modules; "
          "assert jaxflash.flax.dot_product_attention is not None; assert 'flax' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True,
                 env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})


# ------------------------------------------------- Flax's own modules with attention_fn

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_flax_module_with_adapter(dtype):
  x = rand(0, (2, 16, 32))
  mask = nn.make_causal_mask(jnp.ones((2, 16)))
  module = lambda **kw: nn.MultiHeadDotProductAttention(num_heads=4, **kw)
  params = jax.jit(module().init)(jax.random.key(1), x)["params"]

  def loss(m, params, x):
    return jnp.sum(m.apply({"params": params}, x, mask=mask).astype(jnp.float32) ** 2)

  ours = module(dtype=dtype, attention_fn=jf.dot_product_attention)
  run = jax.jit(lambda m, p, x: (m.apply({"params": p}, x, mask=mask),
                                 jax.grad(loss, 1)(m, p, x)), static_argnums=0)
  assert_accurate(run(ours, params, x.astype(dtype)),
                  run(module(dtype=dtype), params, x.astype(dtype)),
                  run(module(), params, x), 10 * ATOL[dtype])


def test_nnx_flax_module_with_adapter():
  x = rand(0, (2, 16, 32))
  make = lambda **kw: nnx.MultiHeadAttention(4, 32, num_kv_heads=2, decode=False,
                                             rngs=nnx.Rngs(0), **kw)
  ours, theirs = make(attention_fn=jf.dot_product_attention), make()
  np.testing.assert_allclose(ours(x, is_causal=True), theirs(x, is_causal=True), atol=2e-5)
  mask = jnp.arange(16) < jnp.array([16, 5])[:, None]
  mask = nnx.make_attention_mask(jnp.ones((2, 16)), mask)
  np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), atol=2e-5)


# -------------------------------------------------------------- jaxflash's own modules

LINEN_CONFIGS = [
    dict(num_heads=4),
    dict(num_heads=2, qkv_features=48, out_features=24, use_bias=False),
    dict(num_heads=4, normalize_qk=True, param_dtype=jnp.bfloat16),
]


def tree_signature(tree):
  return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


@pytest.mark.parametrize("config", LINEN_CONFIGS)
def test_linen_same_parameter_tree(config):
  x = rand(0, (2, 8, 32))
  theirs = jax.jit(nn.MultiHeadDotProductAttention(**config).init)(jax.random.key(1), x)
  ours = jax.jit(jf.MultiHeadDotProductAttention(**config, is_causal=True).init)(
      jax.random.key(1), x)
  assert tree_signature(ours) == tree_signature(theirs)
  # names seed the initialisers, so the same key gives the same values
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)


@pytest.mark.parametrize("config", [dict(), dict(num_kv_heads=2, use_bias=False),
                                    dict(normalize_qk=True, qkv_features=16)])
def test_nnx_same_parameter_tree(config):
  theirs = nnx.state(nnx.MultiHeadAttention(4, 32, **config, rngs=nnx.Rngs(0)), nnx.Param)
  ours = nnx.state(jf.MultiHeadAttention(4, 32, **config, rngs=nnx.Rngs(0)), nnx.Param)
  assert tree_signature(ours) == tree_signature(theirs)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)


@pytest.mark.parametrize("init_with,dtype", [("flax", jnp.bfloat16), ("jaxflash", jnp.float32)])
def test_linen_weights_load_both_ways(init_with, dtype):
  """Params from either module: jaxflash (is_causal) == Flax (dense causal mask)."""
  x = rand(0, (2, 16, 32))
  init_cls = nn.MultiHeadDotProductAttention if init_with == "flax" else functools.partial(
      jf.MultiHeadDotProductAttention, is_causal=True)
  params = jax.jit(init_cls(num_heads=4).init)(jax.random.key(7), x)["params"]
  mask = nn.make_causal_mask(jnp.ones((2, 16)))

  @functools.partial(jax.jit, static_argnums=0)
  def run(module, x, mask=None):
    out, vjp = jax.vjp(lambda p: module.apply({"params": p}, x, mask=mask), params)
    return out, vjp(rand(5, out.shape, out.dtype))

  ours = jf.MultiHeadDotProductAttention(num_heads=4, dtype=dtype, is_causal=True)
  theirs = lambda dt: nn.MultiHeadDotProductAttention(num_heads=4, dtype=dt)
  assert_accurate(run(ours, x.astype(dtype)), run(theirs(dtype), x.astype(dtype), mask=mask),
                  run(theirs(jnp.float32), x, mask=mask), 10 * ATOL[dtype])


@pytest.mark.parametrize("init_with", ["flax", "jaxflash"])
def test_nnx_weights_load_both_ways(init_with):
  x = rand(0, (2, 16, 32))
  make = lambda cls, seed: cls(4, 32, num_kv_heads=2, decode=False, rngs=nnx.Rngs(seed))
  theirs, ours = make(nnx.MultiHeadAttention, 1), make(jf.MultiHeadAttention, 2)
  src, dst = (theirs, ours) if init_with == "flax" else (ours, theirs)
  nnx.update(dst, nnx.state(src, nnx.Param))

  @nnx.jit
  def run(module):
    out, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(module)
    return out, nnx.state(grads, nnx.Param)

  out, grads = run(ours)
  ref_out, ref_grads = run(theirs)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads,
               ref_grads)


def test_is_causal_with_a_mask_only_attention_fn():
  """An attention_fn without `is_causal` gets the dense causal mask instead."""
  x = rand(0, (2, 12, 16))
  theirs = nn.MultiHeadDotProductAttention(num_heads=2)
  params = theirs.init(jax.random.key(1), x)
  ours = jf.MultiHeadDotProductAttention(num_heads=2, is_causal=True,
                                         attention_fn=nn.dot_product_attention)
  expected = theirs.apply(params, x, mask=nn.make_causal_mask(jnp.ones((2, 12))))
  np.testing.assert_allclose(ours.apply(params, x), expected, atol=1e-6)
  with pytest.raises(ValueError, match="implementation"):
    jf.MultiHeadDotProductAttention(num_heads=2, implementation="xla",
                                    attention_fn=nn.dot_product_attention).init(
                                        jax.random.key(0), x)


@on_host
def test_implementation_is_passed_through():
  x = rand(0, (1, 8, 16))
  with pytest.raises(ValueError, match="implementation='cuda'"):  # float32: never CUDA
    jf.MultiHeadAttention(2, 16, implementation="cuda", decode=False, rngs=nnx.Rngs(0))(x)
  r = nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
  m = jf.MultiHeadAttention(2, 16, implementation="xla", decode=False, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(m(x, is_causal=True), r(x, is_causal=True), atol=1e-5)
  mask = jax.random.bernoulli(jax.random.key(1), 0.7, (1, 1, 8, 8)).at[..., 0].set(True)
  m = jf.MultiHeadAttention(2, 16, implementation="cpu", decode=False, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(m(x, mask=mask), r(x, mask=mask), atol=1e-5)


def test_sow_weights():
  x = rand(0, (2, 8, 16))
  mask = nn.make_causal_mask(jnp.ones((2, 8)))
  theirs = nn.MultiHeadDotProductAttention(num_heads=2)
  params = theirs.init(jax.random.key(1), x)
  sown = lambda m, **kw: m.apply(params, x, sow_weights=True, mutable=["intermediates"],
                                 **kw)[1]["intermediates"]["attention_weights"][0]
  ours = sown(jf.MultiHeadDotProductAttention(num_heads=2, is_causal=True))
  np.testing.assert_allclose(ours, sown(theirs, mask=mask), atol=1e-6)

  make = lambda cls: cls(2, 16, num_kv_heads=1, decode=False, rngs=nnx.Rngs(0))
  weights = []
  for cls in (nnx.MultiHeadAttention, jf.MultiHeadAttention):
    m = make(cls)
    m(x, is_causal=True, sow_weights=True)
    weights.append(m.attention_weights.get_value()[0])
  np.testing.assert_allclose(weights[1], weights[0], atol=1e-6)


# --------------------------------------------------------------------------- decoding

def test_linen_decode_matches_flax():
  B, L, D = 2, 10, 32
  x = rand(0, (B, L, D))
  theirs = nn.MultiHeadDotProductAttention(num_heads=4, decode=True)
  ours = jf.MultiHeadDotProductAttention(num_heads=4, decode=True, is_causal=True)
  variables = theirs.init(jax.random.key(1), x)  # shapes the cache: (B, L, N, H)
  params = {"params": variables["params"]}
  caches = [variables["cache"], variables["cache"]]
  for t in range(L):
    outs = []
    for i, m in enumerate((theirs, ours)):
      out, upd = m.apply({**params, "cache": caches[i]}, x[:, t:t + 1], mutable=["cache"])
      caches[i] = upd["cache"]
      outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, err_msg=f"token {t}")
  # one causal pass over the whole sequence gives the same rows
  full = jf.MultiHeadDotProductAttention(num_heads=4, is_causal=True).apply(params, x)
  np.testing.assert_allclose(outs[1][:, 0], full[:, -1], atol=2e-5)


def test_nnx_decode_matches_flax():
  B, L, D = 2, 10, 32
  x = rand(0, (B, L, D))
  make = lambda cls: cls(4, D, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0))
  theirs, ours = make(nnx.MultiHeadAttention), make(jf.MultiHeadAttention)
  ours.is_causal = True  # must not disturb decoding
  for m in (theirs, ours):
    m.init_cache((B, L, D))
  for t in range(L):
    np.testing.assert_allclose(ours(x[:, t:t + 1]), theirs(x[:, t:t + 1]), atol=2e-5,
                               err_msg=f"token {t}")


# --------------------------------------------------------------- block and training

def test_rope_is_relative():
  q, k = rand(0, (1, 6, 2, 8)), rand(1, (1, 6, 2, 8))
  pos = jnp.arange(6)
  logits = lambda shift: jnp.einsum("btnh,bsnh->bnts", jf.apply_rope(q, pos + shift),
                                    jf.apply_rope(k, pos + shift))
  np.testing.assert_allclose(logits(0), logits(11), atol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(jf.apply_rope(q, pos), axis=-1),
                             jnp.linalg.norm(q, axis=-1), rtol=1e-5)
  assert not np.allclose(jf.apply_rope(q, pos), q)


def test_transformer_block_gqa_rope():
  x = rand(0, (2, 16, 32))
  make = lambda fn: jf.TransformerBlock(32, 4, num_kv_heads=2, attention_fn=fn,
                                        rngs=nnx.Rngs(0))
  ours, theirs = make(jf.dot_product_attention), make(nnx.dot_product_attention)
  assert tree_signature(nnx.state(ours, nnx.Param)) == tree_signature(
      nnx.state(theirs, nnx.Param))
  run = nnx.jit(lambda m: nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m))
  (out, g), (ref, g_ref) = run(ours), run(theirs)
  np.testing.assert_allclose(out, ref, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               nnx.state(g, nnx.Param), nnx.state(g_ref, nnx.Param))
  # causal: the first token ignores the rest of the sequence
  np.testing.assert_allclose(ours(x)[:, :1], ours(x[:, :1]), atol=1e-5)


def test_training_curve_matches_flax():
  """Tiny config: per-step losses of jaxflash vs Flax's attention agree within 1e-4."""
  sys.path.insert(0, str(EXAMPLES))
  try:
    import train_lm
  finally:
    sys.path.remove(str(EXAMPLES))
  cfg = train_lm.Config(features=32, num_heads=4, num_kv_heads=2, num_layers=1, seq_len=32,
                        batch_size=4, steps=20)
  ours = np.array(train_lm.train(cfg, "jaxflash"))
  theirs = np.array(train_lm.train(cfg, "flax"))
  assert ours[-1] < ours[0] - 0.5  # it learns
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
