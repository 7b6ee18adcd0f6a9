"""Flax integration: an `attention_fn` adapter, linen and nnx attention modules, a block.

Letter key: B batch, T query length, S key/value length, N query heads, K key/value heads,
H head dim.

One-line switch for existing Flax code:

  flax.linen.MultiHeadDotProductAttention(..., attention_fn=jaxflash.flax.dot_product_attention)
  flax.nnx.MultiHeadAttention(..., attention_fn=jaxflash.flax.dot_product_attention)

or use `jaxflash.flax.MultiHeadDotProductAttention` / `jaxflash.flax.MultiHeadAttention`,
which take the same arguments, build the same parameter tree, and add `is_causal` (run the
causal kernel instead of a dense causal mask) and `implementation`.

How Flax's keywords map onto jaxflash (`dot_product_attention`):
  mask, bias        passed to `jaxflash.attention` (the kernels take both; bias is
                    differentiable). Prefer `is_causal` over a dense causal mask. A row whose
                    keys are all masked gives 0 (Flax gives the mean of the values).
  is_causal         the causal kernel (top-left aligned, as Flax and jax.nn).
  dropout_*         with dropout_rate > 0 and deterministic=False, jaxflash's attention
                    dropout with `dropout_rng` (a hash of (seed[b], n, t, s), see
                    `jaxflash.reference.dropout_keep`; the batch dims are folded into b).
                    It needs broadcast_dropout=False: Flax's default True shares one (T, S)
                    mask across every batch dim and head, which the kernels cannot draw
                    (the head index is always hashed), so it raises NotImplementedError.
                    Either way the masks are not Flax's bits, only the same distribution.
                    Otherwise no dropout happens, as in Flax.
  dtype             casts query, key and value to it (default: their promoted dtype), as
                    Flax does; jaxflash takes float32, float16 and bfloat16.
  precision         the kernels have a fixed precision: products of the input dtype with
                    float32 accumulation and a float32 softmax. None/DEFAULT is accepted;
                    HIGH/HIGHEST only for float16/bfloat16 inputs (where that is exact);
                    anything else raises NotImplementedError.
  module            (sow_weights=True) the attention weights are rebuilt from the kernel's
                    logsumexp, exp(logits - lse), and sown as Flax does.
  force_fp32_for_softmax  always honoured: the softmax runs in float32.
  qk_attn_weights_einsum, attn_weights_value_einsum  custom einsums cannot run inside a
                    fused kernel: anything but None raises NotImplementedError.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from jaxflash.reference import visibility

__all__ = ["dot_product_attention", "MultiHeadDotProductAttention", "MultiHeadAttention",
           "TransformerBlock", "apply_rope"]

_EXACT_16BIT = ("float16", "bfloat16")


def _check_precision(precision, dtype):
  """Raises unless the kernels' fixed precision satisfies `precision`."""
  if precision is None:
    return
  parts = precision if isinstance(precision, (tuple, list)) else (precision,)
  try:
    parts = [jax.lax.Precision(p) if isinstance(p, str) else p for p in parts]
  except ValueError as e:
    raise NotImplementedError(f"precision={precision!r} is not understood: {e}") from None
  ok = all(p is None or p == jax.lax.Precision.DEFAULT for p in parts)
  if not ok and jnp.dtype(dtype).name in _EXACT_16BIT:
    ok = all(isinstance(p, jax.lax.Precision) or p is None for p in parts)
  if not ok:
    raise NotImplementedError(
        f"precision={precision!r} cannot be honoured for {jnp.dtype(dtype).name} inputs: the "
        "jaxflash kernels have a fixed precision (input-dtype products, float32 accumulation). "
        "Use precision=None, or float16/bfloat16 inputs with HIGH/HIGHEST")


def _fold_batch(x, batch):
  """Broadcastable [batch..., N|1, T, S] -> (B|1, N|1, T, S), B = prod(batch)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  rank = len(batch) + 3
  if x.ndim > rank:
    raise ValueError(f"mask/bias of shape {x.shape} has more dims than [batch..., N, T, S] "
                     f"with batch dims {batch}")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  lead, tail = x.shape[:len(batch)], x.shape[len(batch):]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + tail)
  return jnp.broadcast_to(x, tuple(batch) + tail).reshape((math.prod(batch),) + tail)


def _attention_weights(q, k, bias, mask, is_causal, lse):
  """softmax weights (B, N, T, S) rebuilt from the kernel's lse, for sow_weights."""
  B, T, N, H = q.shape
  _, S, K, _ = k.shape
  qg = q.reshape(B, T, K, N // K, H).astype(jnp.float32)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)).reshape(B, N, T, S)
  logits = logits / math.sqrt(H)
  if bias is not None:
    logits = logits + bias.astype(q.dtype).astype(jnp.float32)
  vis = visibility(B, T, S, is_causal=is_causal, mask=mask)
  weights = jnp.where(vis, jnp.exp(logits - lse[..., None]), 0.0)
  return weights.astype(q.dtype)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, force_fp32_for_softmax=False,
                          qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                          promote_dtype=None, is_causal=False, implementation=None):
  """Flax-compatible `attention_fn` that runs jaxflash; see the module docstring.

  Args:
    query: [batch..., T, N, H]; any number of batch dims (including none).
    key, value: [batch..., S, K, H]; N must be a multiple of K (GQA).
    bias, mask: broadcastable to [batch..., N, T, S]; in a mask, nonzero means attend.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic: Flax's dropout arguments;
      dropout applies when dropout_rate > 0 and not deterministic, and then needs
      broadcast_dropout=False and a dropout_rng.
    dtype: cast query, key and value to this dtype first.
    precision: None/DEFAULT, or HIGH/HIGHEST with 16-bit inputs.
    module: when given, sow the attention weights (Flax's `sow_weights=True`).
    force_fp32_for_softmax: accepted; the softmax always runs in float32.
    qk_attn_weights_einsum, attn_weights_value_einsum: must be None.
    promote_dtype: optional Flax promote function ((q, k, v), dtype=) -> (q, k, v).
    is_causal: query t attends keys s <= t, with the causal kernel.
    implementation: passed to `jaxflash.attention` (None picks the kernel).

  Returns:
    [batch..., T, N, H] in the (promoted) input dtype.
  """
  dropout = {}
  if dropout_rate > 0.0 and not deterministic:
    if broadcast_dropout:
      raise NotImplementedError(
          f"broadcast_dropout=True with dropout_rate={dropout_rate}: one dropout mask shared "
          "by every batch element and head cannot be drawn by the jaxflash kernels (they "
          "hash the head index); pass broadcast_dropout=False (independent masks per batch "
          "element and head), or deterministic=True")
    if dropout_rng is None:
      raise ValueError(f"dropout_rng is required when dropout_rate={dropout_rate} and "
                       "deterministic=False")
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  for name, fn in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                   ("attn_weights_value_einsum", attn_weights_value_einsum)):
    if fn is not None:
      raise NotImplementedError(f"{name}: a custom einsum cannot run inside the fused jaxflash "
                                "kernel; pass None")
  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  else:
    dtype = dtype or jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  _check_precision(precision, query.dtype)

  if not (query.ndim == key.ndim == value.ndim) or query.ndim < 3:
    raise ValueError(f"query, key and value must have one rank >= 3 ([batch..., T, N, H]); "
                     f"got {query.shape}, {key.shape}, {value.shape}")
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"query, key and value batch dims must match; got {query.shape}, "
                     f"{key.shape}, {value.shape}")
  fold = lambda x: x.reshape((math.prod(batch),) + x.shape[-3:])
  q, k, v = fold(query), fold(key), fold(value)
  bias, mask = _fold_batch(bias, batch), _fold_batch(mask, batch)

  run = functools.partial(jaxflash.attention, q, k, v, bias, mask, is_causal=is_causal,
                          implementation=implementation, **dropout)
  if module is None:
    out = run()
  else:
    # Flax sows the weights before dropout; the kernel's lse is also taken before it
    out, lse = run(return_residual=True)
    weights = _attention_weights(q, k, bias, mask, is_causal, lse)
    weights = weights.reshape(batch + weights.shape[1:])
    if isinstance(module, nnx.Module):
      module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
      module.sow("intermediates", "attention_weights", weights)
  return out.reshape(query.shape[:-1] + value.shape[-1:])


def _accepts(fn, name):
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def _default_attention_fn(attention_fn, implementation):
  """Binds `implementation`; refuses to drop it when attention_fn cannot take it."""
  if implementation is None:
    return attention_fn
  if not _accepts(attention_fn, "implementation"):
    raise ValueError(f"implementation={implementation!r} needs an attention_fn with an "
                     f"`implementation` argument; {attention_fn!r} has none")
  return functools.partial(attention_fn, implementation=implementation)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """linen drop-in for `flax.linen.MultiHeadDotProductAttention` running jaxflash.

  Same attributes, call signature and parameter tree as Flax's module, plus:
    is_causal: causal self-attention with the causal kernel (no dense mask). In decode mode
      the cache mask already limits each step to the keys written so far, so it is unused.
      With an `attention_fn` that has no `is_causal` argument, a dense causal mask is built.
    implementation: passed to `jaxflash.attention` through `attention_fn`.
  Training with dropout_rate > 0 needs broadcast_dropout=False (see the module docstring).
  """
  attention_fn: Callable[..., Any] = dot_product_attention
  is_causal: bool = False
  implementation: str | None = None

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               deterministic=None, dropout_rng=None, sow_weights=False):
    if inputs_kv is not None:
      if inputs_k is not None or inputs_v is not None:
        raise ValueError("pass either inputs_kv or inputs_k/inputs_v, not both")
      inputs_k = inputs_v = inputs_kv
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None when inputs_v is given")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k

    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features={qkv_features} must be divisible by "
                       f"num_heads={self.num_heads}")
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, features=(self.num_heads, head_dim), dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    # (B..., T|S, N, H)
    query = dense(name="query")(inputs_q)
    key = dense(name="key")(inputs_k)
    value = dense(name="value")(inputs_v)
    if self.normalize_qk:
      ln = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                             param_dtype=self.param_dtype)
      query = ln(name="query_ln")(query)
      key = ln(name="key_ln")(key)

    is_causal = self.is_causal
    if self.decode:
      key, value, mask, is_causal = self._decode_step(query, key, value, mask, is_causal)

    if self.dropout_rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True

    fn = _default_attention_fn(self.attention_fn, self.implementation)
    if is_causal and not _accepts(fn, "is_causal"):
      T, S = query.shape[-3], key.shape[-3]
      causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]  # (T, S), top-left aligned
      causal = causal.reshape((1,) * (query.ndim - 2) + (T, S))
      mask, is_causal = nn.combine_masks(mask, causal, dtype=jnp.bool_), False
    kwargs = dict(
        mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
        dtype=self.dtype, precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        qk_attn_weights_einsum=(self.qk_attn_weights_einsum_cls()
                                if self.qk_attn_weights_einsum_cls else None),
        attn_weights_value_einsum=(self.attn_weights_value_einsum_cls()
                                   if self.attn_weights_value_einsum_cls else None),
        is_causal=is_causal)
    # as Flax: pass the keywords that attention_fn takes
    kwargs = {k: v for k, v in kwargs.items() if _accepts(fn, k)}
    if sow_weights:
      kwargs["module"] = self
    x = fn(query, key, value, **kwargs)  # (B..., T, N, H)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
        dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general, dot_general_cls=self.out_dot_general_cls,
        name="out")(x)

  def _decode_step(self, query, key, value, mask, is_causal):
    """Flax's KV-cache convention: 'cache' collection with cached_key/value, cache_index."""
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:  # init: shapes the cache from the full-length input
      return key, value, mask, is_causal
    *batch, max_length, heads, head_dim = cached_key.value.shape
    if query.shape != (*batch, 1, heads, head_dim):
      raise ValueError(f"decode=True takes one token per call: expected query shape "
                       f"{(*batch, 1, heads, head_dim)}, got {query.shape}")
    index = cache_index.value
    start = (0,) * len(batch) + (index, 0, 0)
    key = jax.lax.dynamic_update_slice(cached_key.value, key, start)
    value = jax.lax.dynamic_update_slice(cached_value.value, value, start)
    cached_key.value, cached_value.value = key, value
    cache_index.value = index + 1
    # the query at `index` sees the keys written so far; that is the causal rule here
    visible = jnp.broadcast_to(jnp.arange(max_length) <= index, (*batch, 1, 1, max_length))
    return key, value, nn.combine_masks(mask, visible), False


class MultiHeadAttention(nnx.MultiHeadAttention):
  """nnx drop-in for `flax.nnx.MultiHeadAttention` running jaxflash.

  Same constructor, call signature (`init_cache` for decoding included) and parameter tree
  as Flax's module, plus:
    is_causal: default for the call's `is_causal` (the causal kernel). Unused while
      decoding: the cache mask already limits each step to the keys written so far.
    implementation: passed to `jaxflash.attention` through `attention_fn`.
  Training with dropout_rate > 0 needs broadcast_dropout=False (see the module docstring).
  """

  def __init__(self, num_heads, in_features, *args, attention_fn=dot_product_attention,
               is_causal=False, implementation=None, **kwargs):
    super().__init__(num_heads, in_features, *args,
                     attention_fn=_default_attention_fn(attention_fn, implementation),
                     **kwargs)
    self.is_causal = is_causal
    self.implementation = implementation

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, is_causal=None, decode=None,
               **kwargs):
    is_causal = self.is_causal if is_causal is None else is_causal
    if (self.decode if decode is None else decode):
      is_causal = False
    return super().__call__(inputs_q, inputs_k, inputs_v, is_causal=is_causal, decode=decode,
                            **kwargs)


def apply_rope(x, positions, base=10000.0):
  """Rotary position embedding on x (B..., L, heads, H) at positions (L,), H even."""
  H = x.shape[-1]
  if H % 2:
    raise ValueError(f"RoPE needs an even head dim, got H={H}")
  freqs = base ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)  # (H/2,)
  angles = positions.astype(jnp.float32)[:, None] * freqs  # (L, H/2)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # (L, 1, H/2)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _rope_attention(query, key, value, *, attention_fn, base, **kwargs):
  """attention_fn on rotated query/key; positions 0..T-1 and 0..S-1 (no KV cache)."""
  query = apply_rope(query, jnp.arange(query.shape[-3]), base)
  key = apply_rope(key, jnp.arange(key.shape[-3]), base)
  return attention_fn(query, key, value, **kwargs)


class TransformerBlock(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(LN(x)), then x + MLP(LN(x)).

  Args:
    features: model width D.
    num_heads: query heads N (D % N == 0).
    num_kv_heads: key/value heads K for GQA (default N).
    mlp_features: hidden width of the GELU MLP (default 4 D).
    rope_base: RoPE base frequency, or None for no RoPE.
    is_causal: causal self-attention (the causal kernel).
    attention_fn: a Flax-style attention_fn (default jaxflash's).
    implementation: passed to `jaxflash.attention` (only with the default attention_fn).
    dtype, param_dtype: computation and parameter dtypes.
  The block has no decode mode: RoPE positions assume the full sequence.
  """

  def __init__(self, features, num_heads, *, num_kv_heads=None, mlp_features=None,
               rope_base=10000.0, is_causal=True, attention_fn=dot_product_attention,
               implementation=None, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    attention_fn = _default_attention_fn(attention_fn, implementation)
    if rope_base is not None:
      attention_fn = functools.partial(_rope_attention, attention_fn=attention_fn,
                                       base=rope_base)
    mlp_features = mlp_features or 4 * features
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = nnx.LayerNorm(features, **common)
    self.attn = MultiHeadAttention(num_heads, features, num_kv_heads=num_kv_heads,
                                   use_bias=False, attention_fn=attention_fn,
                                   is_causal=is_causal, decode=False, **common)
    self.mlp_norm = nnx.LayerNorm(features, **common)
    self.mlp_in = nnx.Linear(features, mlp_features, **common)
    self.mlp_out = nnx.Linear(mlp_features, features, **common)

  def __call__(self, x, *, mask=None):
    """x: (B, T, D) -> (B, T, D); mask broadcastable to (B, N, T, T), True attends."""
    x = x + self.attn(self.attn_norm(x), mask=mask)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
