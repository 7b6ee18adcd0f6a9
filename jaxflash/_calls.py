"""Thin jax.ffi.ffi_call wrappers. Their output types are the abstract evaluation.

Output types come from jax.typeof(q).update(...), not a bare ShapeDtypeStruct, so that
inside shard_map they keep q's varying-axis type (a bare struct makes autodiff insert a
psum and the gradients come out wrong).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


# Per operand and result of each call, one letter per axis (jaxflash.sharding): B batch, N query
# heads, K kv heads may be split over devices; every other axis is needed whole. A new operand
# is one more entry.
FWD_AXES = (("BTNH", "BSKH", "BSKV"),                             # q, k, v
            ("BTNV", "BNT"))                                      # out, lse
BWD_AXES = (("BTNH", "BSKH", "BSKV", "BTNV", "BNT", "BTNV", "BNT"),  # q, k, v, out, lse, dout, dlse
            ("BTNH", "BSKH", "BSKV"))                             # dq, dk, dv


def _like(x, shape, dtype):
  return jax.typeof(x).update(shape=tuple(shape), dtype=jnp.dtype(dtype))


def _lse_shape(q):
  *lead, t, n, _ = q.shape
  return (*lead, n, t)


def fwd(q, k, v, *, scale: float, is_causal: bool, platform: str):
  """(..., T, N, H), (..., S, K, H), (..., S, K, Hv) -> out (..., T, N, Hv), lse (..., N, T)."""
  out_types = (_like(q, q.shape[:-1] + v.shape[-1:], q.dtype),
               _like(q, _lse_shape(q), jnp.float32))
  call = jax.ffi.ffi_call(f"jaxflash_fwd_{platform}", out_types, vmap_method="broadcast_all")
  return call(q, k, v, scale=np.float32(scale), is_causal=bool(is_causal))


def bwd(q, k, v, out, lse, dout, dlse, *, scale: float, is_causal: bool, platform: str):
  """Returns dq, dk, dv with the shapes and dtypes of q, k, v."""
  out_types = tuple(_like(x, x.shape, x.dtype) for x in (q, k, v))
  call = jax.ffi.ffi_call(f"jaxflash_bwd_{platform}", out_types, vmap_method="broadcast_all")
  return call(q, k, v, out, lse, dout, dlse, scale=np.float32(scale), is_causal=bool(is_causal))
