"""The accuracy rule, shared by the tests and the self-check of `python -m jaxflash`.

An implementation's error against the float32 reference must be at most twice the error of
the same reference run in the input dtype, plus a small atol.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.reference import attention_reference

ATOL = {"float32": 2e-5, "bfloat16": 2e-3, "float16": 5e-4}


def max_err(a, b) -> float:
  """Max |a - b|, where two -inf entries count as equal."""
  a = np.asarray(jnp.asarray(a, jnp.float32))
  b = np.asarray(jnp.asarray(b, jnp.float32))
  both_inf = np.isneginf(a) & np.isneginf(b)
  with np.errstate(invalid="ignore"):  # -inf - -inf, masked out by both_inf
    return float(np.max(np.abs(np.where(both_inf, 0.0, a - b)), initial=0.0))


def accuracy(got, ref32, ref_lo, dtype) -> tuple[float, float]:
  """(error, allowed bound); NaN in `got` gives an infinite error."""
  if np.any(np.isnan(np.asarray(got, np.float32))):
    return float("inf"), 0.0
  return max_err(got, ref32), 2 * max_err(ref_lo, ref32) + ATOL[jnp.dtype(dtype).name]


def reference_grads(q, k, v, dout, dlse, **kw):
  """(out, lse) and (dq, dk, dv) of the reference, computed in the dtype of q; dlse None:
  lse has no cotangent (zeros)."""
  (out, lse), vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)
  return (out, lse), vjp((dout, jnp.zeros_like(lse) if dlse is None else dlse))


def check_against_reference(attn, q, k, v, dout, dlse, **kw) -> dict[str, tuple[float, float]]:
  """Runs attn(q, k, v, return_residual=True, **kw) forward and backward; returns per tensor
  (error, bound) under the accuracy rule. The gradients are those of <out, dout> + <lse, dlse>,
  or with dlse None of <out, dout> through attn(q, k, v, **kw), whose lse gets no cotangent."""
  def loss(q, k, v):
    if dlse is None:
      out = attn(q, k, v, **kw)
      return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
    out, lse = attn(q, k, v, return_residual=True, **kw)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(lse * dlse)

  out, lse = jax.jit(lambda q, k, v: attn(q, k, v, return_residual=True, **kw))(q, k, v)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
  run_reference = jax.jit(lambda *a: reference_grads(*a, **kw))  # one compile, not one per op
  (r_out, r_lse), r_grads = run_reference(*f32, dlse)
  (l_out, l_lse), l_grads = run_reference(q, k, v, dout, dlse)
  got = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
  ref = dict(out=r_out, lse=r_lse, dq=r_grads[0], dk=r_grads[1], dv=r_grads[2])
  lo = dict(out=l_out, lse=l_lse, dq=l_grads[0], dk=l_grads[1], dv=l_grads[2])
  dtypes = dict(out=q.dtype, lse=jnp.float32, dq=q.dtype, dk=k.dtype, dv=v.dtype)
  for name in got:
    if got[name].shape != ref[name].shape or got[name].dtype != dtypes[name]:
      raise AssertionError(f"{name}: {got[name].shape} {got[name].dtype}, expected "
                           f"{ref[name].shape} {jnp.dtype(dtypes[name])}")
  return {name: accuracy(got[name], ref[name], lo[name], q.dtype) for name in got}
