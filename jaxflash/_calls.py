"""Thin jax.ffi.ffi_call wrappers. Their output types are the abstract evaluation.

Output types come from jax.typeof(q).update(...), not a bare ShapeDtypeStruct, so that
inside shard_map they keep q's varying-axis type (a bare struct makes autodiff insert a
psum and the gradients come out wrong).

The CPU and CUDA targets take every variant operand in the order of VARIANT_OPERANDS; an absent
one is passed as a zero-element placeholder and marked dead by its `has_*` attr
(csrc/ffi_params.h checks both). So is the fp32 copy of O (`has_o_f32`, params.h o_f32): a
third forward result when asked for (keep_f32), and the backward's operand after dlse, from
which it takes delta = rowsum(dout * o) - dlse (both platforms; see attention._keeps_o_f32). The CUDA forward and backward run every variant, and the
backward honours `deterministic` on every platform; the CUDA backward runs fewer head dims than
the forward, so bwd(platform='cuda') raises for those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _ffi
from jaxflash.reference import window_bounds

# Variant operands in binding order, with the dtype each has (None: q's dtype). Per-batch
# operands have a leading (B,) dim; bias and mask are (B|1, N|1, T|1, S|1).
VARIANT_OPERANDS = (
    ("bias", None),
    ("mask", jnp.bool_),
    ("query_seq_lengths", jnp.int32),
    ("key_value_seq_lengths", jnp.int32),
    ("query_segment_ids", jnp.int32),
    ("key_value_segment_ids", jnp.int32),
    ("alibi_slopes", jnp.float32),
    ("dropout_seeds", jnp.uint32),
)


# Per operand and result of each call, one letter per axis (jaxflash.sharding): B batch, N query
# heads, K kv heads may be split over devices; every other axis is needed whole. A new operand
# is one more entry.
FWD_AXES = (("BTNH", "BSKH", "BSKV"),                             # q, k, v
            ("BTNV", "BNT"))                                      # out, lse
O_F32_AXES = "BTNV"  # out_f32: a forward result (keep_f32) and a backward operand
BWD_AXES = (("BTNH", "BSKH", "BSKV", "BTNV", "BNT", "BTNV", "BNT"),  # q, k, v, out, lse, dout, dlse
            ("BTNH", "BSKH", "BSKV"))                             # dq, dk, dv


def _like(x, shape, dtype):
  return jax.typeof(x).update(shape=tuple(shape), dtype=jnp.dtype(dtype))


def _lse_shape(q):
  *lead, t, n, _ = q.shape
  return (*lead, n, t)


def _variant_inputs(q, variants, window, bottom_right, softcap, dropout_rate,
                    deterministic=False, o_f32=False):
  """(operands, attrs) for the CPU targets; `variants` maps VARIANT_OPERANDS names to arrays;
  o_f32: the call returns (forward) or takes (backward) the fp32 copy of O."""
  variants = variants or {}
  unknown = set(variants) - {name for name, _ in VARIANT_OPERANDS}
  if unknown:
    raise ValueError(f"unknown variant operands {sorted(unknown)}")
  operands = []
  for name, dtype in VARIANT_OPERANDS:
    x = variants.get(name)
    operands.append(jnp.zeros((0,), q.dtype if dtype is None else dtype) if x is None else x)
  live = lambda name: variants.get(name) is not None
  if live("query_segment_ids") != live("key_value_segment_ids"):
    raise ValueError("query_segment_ids and key_value_segment_ids go together")
  if (dropout_rate > 0) != live("dropout_seeds"):
    raise ValueError("dropout_seeds must be given exactly when dropout_rate > 0")
  left, right = window_bounds(window) or (-1, -1)
  attrs = dict(has_bias=live("bias"), has_mask=live("mask"),
               has_q_lengths=live("query_seq_lengths"),
               has_kv_lengths=live("key_value_seq_lengths"),
               has_segment_ids=live("query_segment_ids"), has_alibi=live("alibi_slopes"),
               window_left=np.int64(left), window_right=np.int64(right),
               bottom_right=bool(bottom_right), softcap=np.float32(softcap or 0.0),
               dropout_rate=np.float32(dropout_rate), deterministic=bool(deterministic),
               has_o_f32=bool(o_f32))
  return operands, attrs


def cuda_bwd_head_dims_error(H, Hv) -> str | None:
  """Why the CUDA backward kernel cannot run head dims (H, Hv), or None. The set comes from
  the build (_ffi.cuda_bwd_head_dims: the bwd_hdim<d> instantiations compiled; 192 brings the
  MLA pair 192/128 too, as csrc/cuda/dispatch.h dispatch_bwd_head_dims), so a new backward head
  dim needs no change here."""
  dims = _ffi.cuda_bwd_head_dims()
  if H in dims and (Hv == H or (H, Hv) == (192, 128)):
    return None
  return (f"the CUDA backward kernel supports head dims {dims} with Hv == H, and H=192, "
          f"Hv=128, got H={H}, Hv={Hv} (the CUDA forward runs them); use "
          "implementation='xla' to differentiate through the reference")


def _check_cuda_bwd(q, v):
  """Raises (at trace time) a NotImplementedError for head dims the CUDA backward lacks."""
  reason = cuda_bwd_head_dims_error(q.shape[-1], v.shape[-1])
  if reason:
    raise NotImplementedError(reason)


def fwd(q, k, v, variants=None, *, scale: float, is_causal: bool, platform: str, window=None,
        bottom_right=False, softcap=None, dropout_rate=0.0, keep_f32=False):
  """(..., T, N, H), (..., S, K, H), (..., S, K, Hv) -> out (..., T, N, Hv), lse (..., N, T);
  keep_f32: and out_f32, out before its rounding to q's dtype, float32 (for bwd's out_f32)."""
  out_shape = q.shape[:-1] + v.shape[-1:]
  out_types = (_like(q, out_shape, q.dtype), _like(q, _lse_shape(q), jnp.float32))
  if keep_f32:
    out_types += (_like(q, out_shape, jnp.float32),)
  call = jax.ffi.ffi_call(f"jaxflash_fwd_{platform}", out_types, vmap_method="broadcast_all")
  base = dict(scale=np.float32(scale), is_causal=bool(is_causal))
  operands, attrs = _variant_inputs(q, variants, window, bottom_right, softcap, dropout_rate,
                                    o_f32=keep_f32)
  return call(q, k, v, *operands, **base, **attrs)


def bwd(q, k, v, out, lse, dout, dlse, variants=None, *, scale: float, is_causal: bool,
        platform: str, window=None, bottom_right=False, softcap=None, dropout_rate=0.0,
        deterministic=False, check=True, out_f32=None, grads_f32=False):
  """Returns dq, dk, dv with the shapes and dtypes of q, k, v (float32 when grads_f32); and,
  when `variants` is given, also dbias (bias's shape, or None) and dalibi (alibi_slopes'
  shape, or None).

  dlse: lse's cotangent, or None for zeros (an empty placeholder the kernels read as zeros).
  out_f32: fwd's out_f32 (keep_f32), or None; delta then comes from it instead of out.
  grads_f32: dq, dk, dv as the kernels accumulate them, not rounded to q's dtype (for a caller
  that sums them further, as ring attention does over its steps).

  check: raise at trace time for what the CUDA backward lacks. False inside
  lax.platform_dependent, whose CUDA branch is traced on every platform: there the CUDA
  handler reports it, on GPUs only, when the call runs (before any launch)."""
  grads = tuple(_like(x, x.shape, jnp.float32 if grads_f32 else x.dtype) for x in (q, k, v))
  base = dict(scale=np.float32(scale), is_causal=bool(is_causal))
  if platform == "cuda" and check:
    _check_cuda_bwd(q, v)
  operands, attrs = _variant_inputs(q, variants, window, bottom_right, softcap, dropout_rate,
                                    deterministic, o_f32=out_f32 is not None)
  if dlse is None:
    dlse = jnp.zeros((0,), jnp.float32)  # empty: no cotangent (csrc/ffi_params.h)
  if out_f32 is None:
    out_f32 = jnp.zeros((0,), jnp.float32)  # dead placeholder (has_o_f32 False)
  bias, alibi = operands[0], operands[6]
  out_types = grads + (_like(q, bias.shape, bias.dtype), _like(q, alibi.shape, alibi.dtype))
  call = jax.ffi.ffi_call(f"jaxflash_bwd_{platform}", out_types, vmap_method="broadcast_all")
  dq, dk, dv, dbias, dalibi = call(q, k, v, out, lse, dout, dlse, out_f32, *operands, **base,
                                   **attrs)
  if variants is None:
    return dq, dk, dv
  return (dq, dk, dv, dbias if attrs["has_bias"] else None,
          dalibi if attrs["has_alibi"] else None)
