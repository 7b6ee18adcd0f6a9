"""Public attention(): validation, implementation choice, custom_vjp.

Letter key: B batch, T query length, S key/value length, N query heads, K key/value heads,
H head dim (Hv for values).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxflash import _calls, _ffi, sharding
from jaxflash.reference import attention_reference

IMPLEMENTATIONS = (None, "xla", "cpu", "cuda")
KERNEL_DTYPES = {"cpu": ("float32", "float16", "bfloat16"), "cuda": ("float16", "bfloat16")}


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  is_causal: bool
  # kernel per platform; "xla" means the reference (a fallback or the user's choice)
  cpu: str
  cuda: str
  # pinned: run `cpu` or `cuda` regardless of platform (an explicit implementation=)
  pinned: str | None


def _shapes_error(msg, query, key, value):
  return ValueError(f"{msg}; got query {query.shape} {query.dtype}, key {key.shape} "
                    f"{key.dtype}, value {value.shape} {value.dtype}")


def check_inputs(query, key, value):
  """Validates BTNH inputs (batched, rank 4); raises ValueError naming the argument."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise _shapes_error(f"{name} must have rank 3 (T, N, H) or 4 (B, T, N, H)",
                          query, key, value)
    if x.dtype.name not in ("float32", "float16", "bfloat16"):
      raise _shapes_error(f"{name} dtype must be float32, float16 or bfloat16",
                          query, key, value)
  if not (query.dtype == key.dtype == value.dtype):
    raise _shapes_error("query, key and value must share one dtype", query, key, value)
  B, T, N, H = query.shape
  if key.shape[0] != B or value.shape[0] != B:
    raise _shapes_error("query, key and value must have the same batch size B", query, key,
                        value)
  if key.shape[:3] != value.shape[:3]:
    raise _shapes_error("key and value must agree in (B, S, K)", query, key, value)
  if key.shape[3] != H:
    raise _shapes_error("query and key must have the same head dim H", query, key, value)
  K = key.shape[2]
  if K == 0 or N % K:
    raise _shapes_error(f"query heads N={N} must be a multiple of key/value heads K={K}",
                        query, key, value)


def _cuda_support(query, value) -> str | None:
  """None when the CUDA kernel covers these inputs, else why not."""
  if not _ffi.cuda_built():
    return "jaxflash was built without CUDA kernels"
  if query.dtype.name not in KERNEL_DTYPES["cuda"]:
    return (f"the CUDA kernels take float16 or bfloat16, got {query.dtype.name} (cast the "
            "inputs, or use implementation='xla' for float32)")
  H, Hv = query.shape[-1], value.shape[-1]
  if H != Hv or H not in _ffi.cuda_head_dims():
    return (f"the CUDA kernels support head dims {_ffi.cuda_head_dims()} with equal query "
            f"and value head dims, got H={H}, Hv={Hv}")
  return None


def _run_fwd(q, k, v, cfg: _Config):
  # per shard of batch and heads under jit: no collectives
  local = functools.partial(_fwd_local, cfg=cfg)
  return sharding.shard_local(local, *_calls.FWD_AXES)(q, k, v)


def _fwd_local(q, k, v, cfg: _Config):
  def kernel(platform):
    impl = getattr(cfg, platform)
    if impl == "xla":
      return lambda q, k, v: attention_reference(q, k, v, scale=cfg.scale,
                                                 is_causal=cfg.is_causal)
    return functools.partial(_calls.fwd, scale=cfg.scale, is_causal=cfg.is_causal,
                             platform=impl)

  if cfg.pinned:
    return kernel(cfg.pinned)(q, k, v)
  reference = lambda q, k, v: attention_reference(q, k, v, scale=cfg.scale,
                                                 is_causal=cfg.is_causal)
  return jax.lax.platform_dependent(q, k, v, cpu=kernel("cpu"), cuda=kernel("cuda"),
                                    default=reference)


def _run_bwd(q, k, v, out, lse, dout, dlse, cfg: _Config):
  local = functools.partial(_bwd_local, cfg=cfg)
  return sharding.shard_local(local, *_calls.BWD_AXES)(q, k, v, out, lse, dout, dlse)


def _bwd_local(q, k, v, out, lse, dout, dlse, cfg: _Config):
  def reference_vjp(q, k, v, out, lse, dout, dlse):
    ref = lambda q, k, v: attention_reference(q, k, v, scale=cfg.scale, is_causal=cfg.is_causal)
    _, vjp = jax.vjp(ref, q, k, v)
    return vjp((dout, dlse))

  def kernel(platform):
    impl = getattr(cfg, platform)
    if impl == "xla":
      return reference_vjp
    return functools.partial(_calls.bwd, scale=cfg.scale, is_causal=cfg.is_causal,
                             platform=impl)

  args = (q, k, v, out, lse, dout, dlse)
  if cfg.pinned:
    return kernel(cfg.pinned)(*args)
  return jax.lax.platform_dependent(*args, cpu=kernel("cpu"), cuda=kernel("cuda"),
                                    default=reference_vjp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, cfg: _Config):
  return _run_fwd(q, k, v, cfg)


def _flash_fwd(q, k, v, cfg):
  out, lse = _run_fwd(q, k, v, cfg)
  return (out, lse), (q, k, v, out, lse)


def _flash_bwd(cfg, res, cts):
  q, k, v, out, lse = res
  dout, dlse = cts
  return _run_bwd(q, k, v, out, lse, dout.astype(out.dtype), dlse.astype(jnp.float32), cfg)


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              implementation=None, return_residual=False):
  """Scaled dot-product attention, a drop-in for `jax.nn.dot_product_attention`.

  Args:
    query: (B, T, N, H) or unbatched (T, N, H).
    key: (B, S, K, H) or (S, K, H); N must be a multiple of K (GQA/MQA).
    value: (B, S, K, Hv) or (S, K, Hv).
    bias, mask, query_seq_lengths, key_value_seq_lengths, local_window_size: as in
      jax.nn.dot_product_attention; today only implementation='xla' takes them.
    scale: multiplies the logits; default 1/sqrt(H).
    is_causal: query t sees keys s <= t (top-left aligned, as jax.nn).
    implementation: None (the best kernel for the platform the computation lowers to:
      CUDA on GPUs where it covers the inputs, the C++ kernel on CPU, else 'xla'),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference).
    return_residual: also return the logsumexp, (B, N, T) float32 (differentiable).

  Returns:
    out with query's shape (last dim Hv) and dtype; and lse when return_residual.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  unbatched = query.ndim == 3
  if unbatched:
    if key.ndim != 3 or value.ndim != 3:
      raise _shapes_error("query, key and value must all be batched or all unbatched",
                          query, key, value)
    query, key, value = query[None], key[None], value[None]
  check_inputs(query, key, value)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)

  extras = dict(bias=bias, mask=mask, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths,
                local_window_size=local_window_size)
  if implementation == "xla":
    if unbatched:
      extras = _batch_extras(**extras)
    out, lse = attention_reference(query, key, value, scale=scale, is_causal=is_causal,
                                   **extras)
  else:
    for name, x in extras.items():
      if x is not None:
        raise NotImplementedError(
            f"jaxflash kernels do not support `{name}` yet; pass implementation='xla' to "
            "use the reference implementation")
    cfg = _resolve(query, value, implementation, scale, bool(is_causal))
    out, lse = _flash(query, key, value, cfg)

  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _batch_extras(bias, mask, query_seq_lengths, key_value_seq_lengths, local_window_size):
  """Gives the variant arguments of an unbatched call their batch dim."""
  lift = lambda x: x if x is None or jnp.ndim(x) == 4 else jnp.asarray(x)[None]
  lengths = lambda x: None if x is None else jnp.reshape(jnp.asarray(x), (1,))
  return dict(bias=lift(bias), mask=lift(mask), query_seq_lengths=lengths(query_seq_lengths),
              key_value_seq_lengths=lengths(key_value_seq_lengths),
              local_window_size=local_window_size)


def _resolve(query, value, implementation, scale, is_causal) -> _Config:
  cuda_reason = _cuda_support(query, value)
  if implementation in ("cpu", None) and not _ffi.cpu_built():
    if implementation == "cpu":
      raise ValueError(f"implementation='cpu' is not available: the jaxflash extension did "
                       f"not load ({_ffi.missing_reason()})")
  if implementation == "cuda" and cuda_reason:
    raise ValueError(f"implementation='cuda' cannot run these inputs: {cuda_reason}")
  cpu = "cpu" if _ffi.cpu_built() else "xla"
  cuda = "xla" if cuda_reason else "cuda"
  return _Config(scale=scale, is_causal=is_causal, cpu=cpu, cuda=cuda,
                 pinned=implementation)
