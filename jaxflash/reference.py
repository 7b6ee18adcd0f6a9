"""Pure-jnp attention: the specification every kernel is checked against.

Letter key: B batch, T query length, S key/value length, N query heads,
K key/value heads (N % K == 0), H head dim.

Semantics (shared by every implementation):
  * logits[b, n, t, s] = scale * <q[b, t, n], k[b, s, n // (N // K)]> + bias
  * key s is visible to query t when every active rule allows it:
      is_causal            s <= t                       (top-left aligned, as jax.nn)
      local_window_size    t - left <= s <= t + right
      mask                 mask[b, n, t, s] is True
      seq lengths          t < query_seq_lengths[b] and s < key_value_seq_lengths[b]
  * out[t] = softmax over visible s of logits, times v; lse[t] = logsumexp over visible s.
  * A query row with no visible key gives out = 0 and lse = -inf.

The math runs in the dtype of the inputs except the softmax, which runs in float32
(as jax.nn does), so calling it on float32 copies gives the float32 reference and on
bf16 inputs gives the low-precision error bar used by the accuracy rule.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def window_bounds(local_window_size):
  """Normalises `local_window_size` to (left, right); None means unbounded."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    return (local_window_size, local_window_size)
  left, right = local_window_size
  return (int(left), int(right))


def visibility(T, S, *, is_causal=False, local_window_size=None,
               query_seq_lengths=None, key_value_seq_lengths=None, mask=None):
  """Boolean (B|1, N|1, T, S) array: True where query t may attend key s."""
  t = jnp.arange(T)[:, None]
  s = jnp.arange(S)[None, :]
  vis = jnp.ones((1, 1, T, S), bool)
  if is_causal:
    vis &= (s <= t)[None, None]
  bounds = window_bounds(local_window_size)
  if bounds is not None:
    left, right = bounds
    vis &= ((s >= t - left) & (s <= t + right))[None, None]
  if query_seq_lengths is not None:
    vis &= (t[None] < query_seq_lengths[:, None, None])[:, None]
  if key_value_seq_lengths is not None:
    vis &= (s[None] < key_value_seq_lengths[:, None, None])[:, None]
  if mask is not None:
    vis &= mask.astype(bool)
  return vis


def attention_reference(query, key, value, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None,
                        key_value_seq_lengths=None, local_window_size=None):
  """Returns (out (B, T, N, H) in the input dtype, lse (B, N, T) float32)."""
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  G = N // K
  dtype = query.dtype
  scale = 1.0 / math.sqrt(H) if scale is None else scale

  q = query.reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key).astype(dtype)
  logits = logits.reshape(B, N, T, S).astype(jnp.float32) * scale
  if bias is not None:
    logits = logits + bias.astype(dtype).astype(jnp.float32)

  vis = visibility(T, S, is_causal=is_causal, local_window_size=local_window_size,
                   query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths, mask=mask)
  vis = jnp.broadcast_to(vis, logits.shape)
  logits = jnp.where(vis, logits, -jnp.inf)

  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.exp(logits - row_max)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  lse = jnp.where(denom[..., 0] > 0, jnp.log(denom[..., 0]) + row_max[..., 0], -jnp.inf)
  probs = (p / jnp.where(denom > 0, denom, 1.0)).astype(dtype)

  probs = probs.reshape(B, K, G, T, S)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value).astype(dtype)
  return out.reshape(B, T, N, value.shape[-1]), lse

