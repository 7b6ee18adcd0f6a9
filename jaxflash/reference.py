"""Pure-jnp attention: the specification every kernel is checked against.

Letter key: B batch, T query length, S key/value length, N query heads,
K key/value heads (N % K == 0), H head dim.

Semantics (shared by every implementation):
  * shift[b] places query t at key position t + shift[b]: 0 for causal_alignment
    'top_left' (as jax.nn), and kv_len[b] - q_len[b] for 'bottom_right' (as FlashAttention
    2.1+ for Sq != Sk), where the lengths are the seq lengths when given, else T and S.
  * logits[b, n, t, s] = c(scale * <q[b, t, n], k[b, s, n // (N // K)]>) + bias[b, n, t, s]
                         - alibi_slopes[b, n] * |s - (t + shift[b])|
    with c(x) = logits_soft_cap * tanh(x / logits_soft_cap) when a cap is given, else x.
  * key s is visible to query t when every active rule allows it:
      is_causal             s <= t + shift
      local_window_size     t + shift - left <= s <= t + shift + right
      mask                  mask[b, n, t, s] is True (broadcast)
      seq lengths           t < query_seq_lengths[b] and s < key_value_seq_lengths[b]
      segment ids           query_segment_ids[b, t] == key_value_segment_ids[b, s]
  * lse[t] = logsumexp over visible s; p = softmax over visible s.
  * dropout: p is multiplied by keep[b, n, t, s] / (1 - dropout_rate), where keep comes from
    `dropout_keep` (a counter-based hash, computed identically by the C++ kernel); lse is the
    logsumexp before dropout.
  * out[t] = p @ v. A query row with no visible key gives out = 0, lse = -inf, zero grads.

The math runs in the dtype of the inputs except the softmax, which runs in float32
(as jax.nn does), so calling it on float32 copies gives the float32 reference and on
bf16 inputs gives the low-precision error bar used by the accuracy rule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
HIGHEST = jax.lax.Precision.HIGHEST


def window_bounds(local_window_size):
  """Normalises `local_window_size` to (left, right); None means unbounded."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)):
    return (int(local_window_size), int(local_window_size))
  left, right = local_window_size
  return (int(left), int(right))


def causal_shift(B, T, S, causal_alignment="top_left", query_seq_lengths=None,
                 key_value_seq_lengths=None):
  """(B,) int32: the key position of query 0 for each batch element."""
  if causal_alignment == "top_left":
    return jnp.zeros((B,), jnp.int32)
  q_len = jnp.full((B,), T, jnp.int32) if query_seq_lengths is None else query_seq_lengths
  kv_len = jnp.full((B,), S, jnp.int32) if key_value_seq_lengths is None else key_value_seq_lengths
  return (kv_len - q_len).astype(jnp.int32)


def visibility(B, T, S, *, is_causal=False, local_window_size=None, query_seq_lengths=None,
               key_value_seq_lengths=None, mask=None, query_segment_ids=None,
               key_value_segment_ids=None, causal_alignment="top_left"):
  """Boolean (B, N|1, T, S) array: True where query t may attend key s."""
  shift = causal_shift(B, T, S, causal_alignment, query_seq_lengths, key_value_seq_lengths)
  t = jnp.arange(T)[None, :, None] + shift[:, None, None]  # (B, T, 1) key position of t
  s = jnp.arange(S)[None, None, :]
  vis = jnp.ones((B, T, S), bool)
  if is_causal:
    vis &= s <= t
  bounds = window_bounds(local_window_size)
  if bounds is not None:
    left, right = bounds
    vis &= (s >= t - left) & (s <= t + right)
  if query_seq_lengths is not None:
    vis &= jnp.arange(T)[None, :, None] < query_seq_lengths[:, None, None]
  if key_value_seq_lengths is not None:
    vis &= s < key_value_seq_lengths[:, None, None]
  if query_segment_ids is not None:
    vis &= query_segment_ids[:, :, None] == key_value_segment_ids[:, None, :]
  vis = vis[:, None]
  if mask is not None:
    vis = vis & mask.astype(bool)
  return vis


def _mix(x):
  """A 32-bit integer finaliser (xor-shift-multiply); wraps in uint32 like the C++ one."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x21F0AAAD)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0xD35A2D97)
  return x ^ (x >> 15)


def dropout_seeds(dropout_rng, B):
  """(B, 2) uint32 per-batch-element seeds from a jax PRNG key.

  The batch index is hashed in here, so a kernel only needs seeds[b] and (n, t, s).
  """
  bits = jax.random.bits(dropout_rng, (2,), jnp.uint32)
  b = jnp.arange(B, dtype=jnp.uint32)
  return jnp.stack([_mix(bits[0] ^ _mix(b)), _mix(bits[1] ^ _mix(b + jnp.uint32(0x9E3779B9)))],
                   axis=-1)


def dropout_threshold(dropout_rate):
  """uint32 threshold: an element is kept when its hash is >= it (so P(keep) = 1 - rate)."""
  return min(int(math.floor(float(np.float32(dropout_rate)) * 2.0**32)), 2**32 - 1)


def dropout_keep(seeds, N, T, S, dropout_rate):
  """Boolean (B, N, T, S) keep mask: hash(seeds[b], n, t, s) >= threshold."""
  u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  head = _mix(u32(jnp.arange(N))[None, :] ^ _mix(seeds[:, :1] ^ _mix(seeds[:, 1:])))  # (B, N)
  row = _mix(u32(jnp.arange(T))[None, None, :] ^ head[..., None])  # (B, N, T)
  h = _mix(u32(jnp.arange(S))[None, None, None, :] ^ row[..., None])  # (B, N, T, S)
  return h >= jnp.uint32(dropout_threshold(dropout_rate))


def attention_reference(query, key, value, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None,
                        key_value_seq_lengths=None, local_window_size=None,
                        causal_alignment="top_left", query_segment_ids=None,
                        key_value_segment_ids=None, logits_soft_cap=None, alibi_slopes=None,
                        dropout_rate=0.0, dropout_rng=None, dropout_seeds_=None):
  """Returns (out (B, T, N, Hv) in the input dtype, lse (B, N, T) float32).

  `dropout_seeds_` ((B, 2) uint32, from `dropout_seeds`) may replace `dropout_rng`; it is
  how the kernels' fallback paths share one mask with the kernels.
  """
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  G = N // K
  dtype = query.dtype
  scale = 1.0 / math.sqrt(H) if scale is None else scale

  q = query.reshape(B, T, K, G, H)
  # HIGHEST: XLA's default rounds float32 products to TF32 on Ampere+ GPUs, which would make
  # the float32 reference no better than the kernels it checks. Exact for 16-bit inputs.
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key, precision=HIGHEST).astype(dtype)
  logits = logits.reshape(B, N, T, S).astype(jnp.float32) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if bias is not None:
    logits = logits + bias.astype(dtype).astype(jnp.float32)
  shift = causal_shift(B, T, S, causal_alignment, query_seq_lengths, key_value_seq_lengths)
  if alibi_slopes is not None:
    slopes = jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (B, N))
    dist = jnp.abs(jnp.arange(S)[None, None, :] - jnp.arange(T)[None, :, None]
                   - shift[:, None, None])  # (B, T, S)
    logits = logits - slopes[:, :, None, None] * dist[:, None].astype(jnp.float32)

  vis = visibility(B, T, S, is_causal=is_causal, local_window_size=local_window_size,
                   query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths, mask=mask,
                   query_segment_ids=query_segment_ids,
                   key_value_segment_ids=key_value_segment_ids,
                   causal_alignment=causal_alignment)
  vis = jnp.broadcast_to(vis, logits.shape)
  logits = jnp.where(vis, logits, -jnp.inf)

  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.exp(logits - row_max)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  live = denom > 0
  safe = jnp.where(live, denom, 1.0)  # keeps log/divide NaN-free (and their grads) on empty rows
  lse = jnp.where(live[..., 0], jnp.log(safe[..., 0]) + row_max[..., 0], -jnp.inf)
  probs = p / safe
  if dropout_rate:
    seeds = dropout_seeds(dropout_rng, B) if dropout_seeds_ is None else dropout_seeds_
    keep = dropout_keep(seeds, N, T, S, dropout_rate)
    probs = probs * jnp.where(keep, np.float32(1.0 / (1.0 - np.float32(dropout_rate))), 0.0)
  probs = probs.astype(dtype).reshape(B, K, G, T, S)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value, precision=HIGHEST).astype(dtype)
  return out.reshape(B, T, N, value.shape[-1]), lse
