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
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxflash import _calls, _ffi, sharding
from jaxflash.reference import (CAUSAL_ALIGNMENTS, attention_reference, dropout_seeds,
                                window_bounds)

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
  window: tuple[int, int] | None = None  # (left, right), see reference.window_bounds
  bottom_right: bool = False             # causal_alignment == 'bottom_right'
  softcap: float | None = None
  dropout_rate: float = 0.0
  deterministic: bool = False            # deterministic_backward

  def options(self):
    """Static variant options, with the names _calls.fwd/bwd take."""
    return dict(window=self.window, bottom_right=self.bottom_right, softcap=self.softcap,
                dropout_rate=self.dropout_rate)


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
  """None when the CUDA forward kernel covers these inputs (every variant), else why not."""
  if not _ffi.cuda_built():
    return "jaxflash was built without CUDA kernels"
  if query.dtype.name not in KERNEL_DTYPES["cuda"]:
    return (f"the CUDA kernels take float16 or bfloat16, got {query.dtype.name} (cast the "
            "inputs, or use implementation='xla' for float32)")
  if query.dtype.name not in _ffi.cuda_dtypes():
    return (f"this build's CUDA kernels take {' and '.join(_ffi.cuda_dtypes())} "
            f"(JAXFLASH_DTYPES), got {query.dtype.name}")
  H, Hv = query.shape[-1], value.shape[-1]
  dims = _ffi.cuda_head_dims()
  if H not in dims or Hv not in dims or Hv > H:
    return (f"the CUDA forward kernel supports head dims H and Hv in {dims} with Hv <= H, "
            f"got H={H}, Hv={Hv}")
  return None


# A call pinned to one kernel (implementation='cpu' or 'cuda') runs it under
# platform_dependent; on any other platform its branch ends in this identity, which raises
# when that branch is lowered (only the lowering platform's branch is). XLA would otherwise
# fail to compile with a missing FFI handler for the kernel's target.
_PLATFORM_DEVICES = {"cpu": "CPU", "cuda": "NVIDIA GPU"}
_wrong_platform_p = Primitive("jaxflash_wrong_platform")
_wrong_platform_p.multiple_results = True


def _wrong_platform_error(pinned, platforms):
  other = "cuda" if pinned == "cpu" else "cpu"
  return ValueError(
      f"implementation={pinned!r} runs on {_PLATFORM_DEVICES[pinned]} devices only, but this "
      f"computation runs on {', '.join(platforms)}: use implementation=None (the best kernel "
      f"for the platform), {other!r} or 'xla', or place the arrays on a "
      f"{_PLATFORM_DEVICES[pinned]} device")


def _wrong_platform_lowering(ctx, *args, pinned):
  raise _wrong_platform_error(pinned, ctx.module_context.platforms)


_wrong_platform_p.def_abstract_eval(lambda *avals, pinned: avals)
mlir.register_lowering(_wrong_platform_p, _wrong_platform_lowering)
batching.primitive_batchers[_wrong_platform_p] = (
    lambda args, dims, **kw: (_wrong_platform_p.bind(*args, **kw), dims))


def _pinned(fn, pinned):
  """fn on the platform of kernel `pinned`, the error above on any other."""
  def wrong(*args):
    arrays = jax.tree.leaves(args)
    if not any(isinstance(x, jax.core.Tracer) for x in arrays):
      # Run eagerly, platform_dependent picked the default device's branch; the arrays may
      # sit on a device of the pinned platform all the same.
      platforms = sorted({d.platform for x in arrays if isinstance(x, jax.Array)
                          for d in x.devices()})
      if platforms == [{"cuda": "gpu"}.get(pinned, pinned)]:
        return fn(*args)
      raise _wrong_platform_error(pinned, platforms)
    leaves, tree = jax.tree.flatten(fn(*args))
    return jax.tree.unflatten(tree, _wrong_platform_p.bind(*leaves, pinned=pinned))
  return lambda *args: jax.lax.platform_dependent(*args, **{pinned: fn}, default=wrong)


def _reference(q, k, v, ops, cfg: _Config):
  return attention_reference(
      q, k, v, bias=ops["bias"], mask=ops["mask"], scale=cfg.scale, is_causal=cfg.is_causal,
      query_seq_lengths=ops["query_seq_lengths"],
      key_value_seq_lengths=ops["key_value_seq_lengths"], local_window_size=cfg.window,
      causal_alignment="bottom_right" if cfg.bottom_right else "top_left",
      query_segment_ids=ops["query_segment_ids"],
      key_value_segment_ids=ops["key_value_segment_ids"], logits_soft_cap=cfg.softcap,
      alibi_slopes=ops["alibi_slopes"], dropout_rate=cfg.dropout_rate,
      dropout_seeds_=ops["dropout_seeds"])


# The variant operands of a call that uses none of them.
NO_VARIANTS = {name: None for name, _ in _calls.VARIANT_OPERANDS}

# Axes of each variant operand for sharding.shard_local: B and N may be split over devices,
# every other letter is kept whole on each device.
_OPERAND_AXES = dict(bias="BNTS", mask="BNTS", query_seq_lengths="B", key_value_seq_lengths="B",
                     query_segment_ids="BT", key_value_segment_ids="BS", alibi_slopes="BN",
                     dropout_seeds="BX")


def _per_shard(fn, arrays, ops, in_axes, out_axes):
  """Runs fn(*arrays, ops) on each device's block of batch and heads (no collectives): the
  live operands of `ops` travel as extra positional arrays with their axes."""
  names = [n for n, x in ops.items() if x is not None]

  def local(*args):
    live = dict(zip(names, args[len(arrays):]))
    return fn(*args[:len(arrays)], {n: live.get(n) for n in ops})

  axes = tuple(in_axes) + tuple(_OPERAND_AXES[n] for n in names)
  return sharding.shard_local(local, axes, out_axes)(*arrays, *(ops[n] for n in names))


def _keeps_o_f32(q, k, ops, cfg: _Config) -> bool:
  """Whether the differentiated forward keeps O in float32 (params.h o_f32) for the kernel
  backward's delta = rowsum(dO * O) - dlse. dbias of a bias broadcast over batch, heads, rows
  or keys and dalibi sum dZ = P (dP - delta) over many elements, where the rounding of the
  stored O (q's dtype) against the backward's own fp32 sum of P dP adds up instead of
  averaging out (benchmarks/NOTES.md); no other gradient needs it, a full bias's dbias (dZ
  itself) neither. O(T * Hv) float32 memory, only for calls with a broadcast bias or
  alibi_slopes that reach a kernel (the CUDA forward that writes it is the sm80-class one)."""
  kernels = {cfg.pinned} if cfg.pinned else {cfg.cpu, cfg.cuda}
  B, T, N, _ = q.shape
  full = (B, N, T, k.shape[1])
  live = ((ops["bias"] is not None and ops["bias"].shape != full) or
          ops["alibi_slopes"] is not None)
  return live and kernels != {"xla"}


def _run_fwd(q, k, v, ops, cfg: _Config, keep_f32=False):
  """out, lse; and with keep_f32 out_f32 (float32; the reference's out cast, which its VJP
  does not read)."""
  def reference(q, k, v, ops):
    out, lse = _reference(q, k, v, ops, cfg)
    return (out, lse, out.astype(jnp.float32)) if keep_f32 else (out, lse)

  def kernel(platform):
    impl = getattr(cfg, platform)
    if impl == "xla":
      return reference
    return lambda q, k, v, ops: _calls.fwd(q, k, v, ops, scale=cfg.scale,
                                           is_causal=cfg.is_causal, platform=impl,
                                           keep_f32=keep_f32, **cfg.options())

  def local(q, k, v, ops):
    if cfg.pinned:
      return _pinned(kernel(cfg.pinned), cfg.pinned)(q, k, v, ops)
    return jax.lax.platform_dependent(q, k, v, ops, cpu=kernel("cpu"), cuda=kernel("cuda"),
                                      default=reference)

  in_axes, out_axes = _calls.FWD_AXES
  out_axes += (_calls.O_F32_AXES,) if keep_f32 else ()
  return _per_shard(local, (q, k, v), ops, in_axes, out_axes)


def _run_bwd(q, k, v, ops, out, lse, dout, dlse, cfg: _Config, out_f32=None, grads_f32=False):
  """dq, dk, dv, then dbias and dalibi for whichever of bias and alibi_slopes is live;
  dlse: lse's cotangent, or None for zeros (the kernels then read none); out_f32: the
  forward's (keep_f32), for the kernels' delta; grads_f32: dq, dk, dv in float32 (not rounded
  to q's dtype), for a caller that sums them further."""
  def reference_vjp(q, k, v, out, lse, dout, dlse, ops, out_f32=None):
    del out_f32  # the reference recomputes its softmax VJP from q, k, v
    def ref(q, k, v, bias, alibi):
      return _reference(q, k, v, {**ops, "bias": bias, "alibi_slopes": alibi}, cfg)
    _, vjp = jax.vjp(ref, q, k, v, ops["bias"], ops["alibi_slopes"])
    dq, dk, dv, *rest = vjp((dout, jnp.zeros_like(lse) if dlse is None else dlse))
    if grads_f32:
      dq, dk, dv = (g.astype(jnp.float32) for g in (dq, dk, dv))
    return (dq, dk, dv, *rest)

  def kernel(platform):
    impl = getattr(cfg, platform)
    if impl == "xla":
      return reference_vjp
    return lambda q, k, v, out, lse, dout, dlse, ops, out_f32=None: _calls.bwd(
        q, k, v, out, lse, dout, dlse, ops, scale=cfg.scale, is_causal=cfg.is_causal,
        platform=impl, deterministic=cfg.deterministic, check=cfg.pinned is not None,
        out_f32=out_f32, grads_f32=grads_f32, **cfg.options())

  fixed = 6 if dlse is None else 7  # q .. dout, and dlse when given

  def local(*args):
    *arrays, ops = args
    dl = arrays[6] if fixed == 7 else None
    args = (*arrays[:6], dl, ops, *arrays[fixed:])  # out_f32, when kept, last
    if cfg.pinned:
      grads = _pinned(kernel(cfg.pinned), cfg.pinned)(*args)
    else:
      grads = jax.lax.platform_dependent(*args, cpu=kernel("cpu"), cuda=kernel("cuda"),
                                         default=reference_vjp)
    return tuple(g for g in grads if g is not None)

  arrays, in_axes = (q, k, v, out, lse, dout, dlse)[:fixed], _calls.BWD_AXES[0][:fixed]
  if out_f32 is not None:
    arrays, in_axes = arrays + (out_f32,), in_axes + (_calls.O_F32_AXES,)
  grad_axes = _calls.BWD_AXES[1] + tuple(
      _OPERAND_AXES[n] for n in ("bias", "alibi_slopes") if ops[n] is not None)
  grads = iter(_per_shard(local, arrays, ops, in_axes, grad_axes))
  dq, dk, dv = next(grads), next(grads), next(grads)
  dbias = next(grads) if ops["bias"] is not None else None
  dalibi = next(grads) if ops["alibi_slopes"] is not None else None
  return dq, dk, dv, dbias, dalibi


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, ops, cfg: _Config):
  return _run_fwd(q, k, v, ops, cfg)


def _primal_values(tree):
  """The primals of a custom_vjp fwd rule under symbolic_zeros, which hands them wrapped."""
  return jax.tree.map(lambda x: x.value, tree, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))


def _out_cotangents(cts, out):
  """(dout in out's dtype, dlse in float32 or None) from the (out, lse) cotangents under
  symbolic_zeros: lse unused by the caller (no return_residual) gives None, so that no (B, N, T)
  zeros are written before each backward and the kernels take delta = rowsum(dO * O) alone."""
  dout, dlse = cts
  dout = jnp.zeros_like(out) if isinstance(dout, SymbolicZero) else dout.astype(out.dtype)
  return dout, None if isinstance(dlse, SymbolicZero) else dlse.astype(jnp.float32)


def _flash_fwd(q, k, v, ops, cfg):
  q, k, v, ops = _primal_values((q, k, v, ops))
  out, lse, *out_f32 = _run_fwd(q, k, v, ops, cfg, keep_f32=_keeps_o_f32(q, k, ops, cfg))
  return (out, lse), (q, k, v, ops, out, lse, out_f32[0] if out_f32 else None)


def _flash_bwd(cfg, res, cts):
  q, k, v, ops, out, lse, out_f32 = res
  dout, dlse = _out_cotangents(cts, out)
  dq, dk, dv, dbias, dalibi = _run_bwd(q, k, v, ops, out, lse, dout, dlse, cfg, out_f32)
  # integer/bool operands and the dropout seeds get no cotangent
  d_ops = {name: None for name in ops}
  d_ops["bias"], d_ops["alibi_slopes"] = dbias, dalibi
  return dq, dk, dv, d_ops


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              causal_alignment="top_left", query_segment_ids=None, key_value_segment_ids=None,
              logits_soft_cap=None, alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
              deterministic_backward=False, implementation=None, return_residual=False):
  """Scaled dot-product attention, a drop-in for `jax.nn.dot_product_attention`.

  The exact semantics of every option are written out in `jaxflash.reference`.

  Args:
    query: (B, T, N, H) or unbatched (T, N, H).
    key: (B, S, K, H) or (S, K, H); N must be a multiple of K (GQA/MQA).
    value: (B, S, K, Hv) or (S, K, Hv).
    bias: additive, rank <= 4 (leading dims are added), broadcastable to (B, N, T, S) with
      each dim full or 1; any float dtype (used in query's dtype). Differentiable: its
      gradient is reduced over the broadcast dims. Read in place, never expanded.
    mask: bool, same shapes as bias; True = attend. Read in place, never expanded.
    scale: multiplies the logits; default 1/sqrt(H).
    is_causal: query t sees keys s <= t + shift (see causal_alignment).
    query_seq_lengths, key_value_seq_lengths: (B,) int32; rows t >= q_len see nothing
      (out 0, lse -inf) and keys s >= kv_len are invisible. A length 0 is allowed.
    local_window_size: int w (= (w, w)) or (left, right): query t sees keys in
      [t + shift - left, t + shift + right]; with or without is_causal.
    causal_alignment: 'top_left' (shift 0, as jax.nn) or 'bottom_right' (shift =
      kv_len - q_len per batch element, with the lengths above when given else T and S,
      as FlashAttention >= 2.1: the last query sees the last key). Applies to is_causal,
      local_window_size and alibi_slopes.
    query_segment_ids, key_value_segment_ids: (B, T) and (B, S) integers, given together
      (packed documents): attend only where the ids are equal.
    logits_soft_cap: c > 0: logits = c * tanh(scale * q.k / c), applied before bias/ALiBi.
    alibi_slopes: (N,) or (B, N): logits -= slope * |s - (t + shift)|. Differentiable.
    dropout_rate: in [0, 1); drops attention probabilities with a counter-based hash of
      (seed, b, n, t, s) (`jaxflash.reference.dropout_keep`), so the forward, the backward
      and the reference see one mask.
    dropout_rng: a jax PRNG key; required when dropout_rate > 0.
    deterministic_backward: ask for a backward that is bit-identical across runs. The CPU
      kernel and 'xla' on CPU always are; the CUDA backward then adds dQ (and dbias of a
      broadcast bias) in a fixed order instead of with atomics, at some cost in speed.
    implementation: None (the best kernel for the platform the computation lowers to:
      CUDA on GPUs where it covers the inputs, the C++ kernel on CPU, else 'xla'),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference). 'cuda' and 'cpu' run on their own
      platform only (a ValueError where the computation runs on another). The CUDA kernels
      (float16 and bfloat16) run every option above, forward and backward. The CUDA forward
      takes head dims H, Hv in (32, 64, 96, 128, 192, 256) with Hv <= H (e.g. the MLA
      192/128); the CUDA backward the same H with Hv == H, and the MLA 192/128 (of the head
      dims built: jaxflash._ffi.cuda_bwd_head_dims()). At another Hv < H (e.g. 128/64) a
      gradient raises, a NotImplementedError with 'cuda' and the CUDA handler's error on GPU
      with None, rather than fall back to the O(T * S) reference VJP.
    return_residual: also return the logsumexp, (B, N, T) float32 (differentiable); -inf on
      rows that see no key.

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
    query_seq_lengths, key_value_seq_lengths, query_segment_ids, key_value_segment_ids = (
        None if x is None else jnp.asarray(x)[None]
        for x in (query_seq_lengths, key_value_seq_lengths, query_segment_ids,
                  key_value_segment_ids))
  check_inputs(query, key, value)
  B, T, N, H = query.shape
  S = key.shape[1]
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)

  ops = dict(
      bias=_check_bcast("bias", bias, (B, N, T, S), None),
      mask=_check_bcast("mask", mask, (B, N, T, S), jnp.bool_),
      query_seq_lengths=_check_lengths("query_seq_lengths", query_seq_lengths, B),
      key_value_seq_lengths=_check_lengths("key_value_seq_lengths", key_value_seq_lengths, B),
      query_segment_ids=None, key_value_segment_ids=None,
      alibi_slopes=_check_alibi(alibi_slopes, B, N), dropout_seeds=None)
  if ops["bias"] is not None:
    ops["bias"] = ops["bias"].astype(query.dtype)  # the kernels read bias in q's dtype
  if (query_segment_ids is None) != (key_value_segment_ids is None):
    raise ValueError("query_segment_ids and key_value_segment_ids must be given together, got "
                     f"only {'query' if key_value_segment_ids is None else 'key_value'}"
                     "_segment_ids")
  if query_segment_ids is not None:
    ops["query_segment_ids"] = _check_ids("query_segment_ids", query_segment_ids, (B, T))
    ops["key_value_segment_ids"] = _check_ids("key_value_segment_ids", key_value_segment_ids,
                                              (B, S))
  window = _check_window(local_window_size)
  if causal_alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got "
                     f"{causal_alignment!r}")
  softcap = None
  if logits_soft_cap is not None:
    softcap = float(logits_soft_cap)
    if not (0 < softcap < math.inf):
      raise ValueError(f"logits_soft_cap must be a positive finite number or None, got "
                       f"{logits_soft_cap!r}")
  dropout_rate = float(dropout_rate)
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if dropout_rate > 0:
    if dropout_rng is None:
      raise ValueError("dropout_rng (a jax PRNG key) is required when dropout_rate > 0")
    ops["dropout_seeds"] = dropout_seeds(dropout_rng, B)

  cfg = _resolve(query, value, implementation, scale, bool(is_causal))
  cfg = dataclasses.replace(cfg, window=window, bottom_right=causal_alignment == "bottom_right",
                            softcap=softcap, dropout_rate=dropout_rate,
                            deterministic=bool(deterministic_backward))
  if implementation == "xla":
    out, lse = _reference(query, key, value, ops, cfg)
  else:
    out, lse = _flash(query, key, value, ops, cfg)

  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _check_bcast(name, x, full, dtype):
  """bias/mask: rank <= 4, leading 1s added; each dim equal to (B, N, T, S) or 1."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4, broadcastable to (B, N, T, S) = {full}, "
                     f"got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(d not in (1, f) for d, f in zip(x.shape, full)):
    raise ValueError(f"{name} shape {x.shape} is not broadcastable to (B, N, T, S) = {full}: "
                     "each dim must be full or 1")
  if dtype == jnp.bool_ and x.dtype != jnp.bool_:
    x = x != 0  # as jax.nn: a numeric mask attends where it is nonzero
  if dtype is None and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} dtype must be floating, got {x.dtype}")
  return x


def _check_lengths(name, x, B):
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape != (B,) or x.dtype != jnp.int32:
    raise ValueError(f"{name} must be int32 of shape (B,) = ({B},), got {x.dtype} {x.shape}")
  return x


def _check_ids(name, x, shape):
  x = jnp.asarray(x)
  if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be integers of shape {shape}, got {x.dtype} {x.shape}")
  return x.astype(jnp.int32)


def _check_alibi(x, B, N):
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape not in ((N,), (B, N)) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"alibi_slopes must be floating of shape (N,) = ({N},) or (B, N) = "
                     f"({B}, {N}), got {x.dtype} {x.shape}")
  return jnp.broadcast_to(x.astype(jnp.float32), (B, N))


def _check_window(local_window_size):
  if local_window_size is None:
    return None
  ok = isinstance(local_window_size, (int, np.integer)) or (
      isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 and
      all(isinstance(w, (int, np.integer)) for w in local_window_size))
  if not ok or isinstance(local_window_size, bool):
    raise ValueError(f"local_window_size must be an int or a (left, right) pair of ints, got "
                     f"{local_window_size!r}")
  window = window_bounds(local_window_size)
  if min(window) < 0:
    raise ValueError(f"local_window_size must be >= 0, got {local_window_size!r}")
  return window


def _resolve(query, value, implementation, scale, is_causal) -> _Config:
  cuda_reason = _cuda_support(query, value)
  if implementation == "cpu" and not _ffi.cpu_built():
    raise ValueError(f"implementation='cpu' is not available: the jaxflash extension did not "
                     f"load ({_ffi.missing_reason()})")
  if implementation == "cuda" and cuda_reason:
    raise ValueError(f"implementation='cuda' cannot run these inputs: {cuda_reason}")
  cpu = "cpu" if _ffi.cpu_built() else "xla"
  cuda = "xla" if cuda_reason else "cuda"
  return _Config(scale=scale, is_causal=is_causal, cpu=cpu, cuda=cuda, pinned=implementation)


def _packed_segment_ids(cu_seqlens, total, pad_id):
  """(total,) int32: the sequence index of each packed token; pad_id past cu_seqlens[-1]."""
  t = jnp.arange(total, dtype=cu_seqlens.dtype)
  seg = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
  live = (t >= cu_seqlens[0]) & (t < cu_seqlens[-1])
  return jnp.where(live, seg, pad_id)


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, *, scale=None, is_causal=False, local_window_size=None,
                     logits_soft_cap=None, alibi_slopes=None, dropout_rate=0.0,
                     dropout_rng=None, deterministic_backward=False, implementation=None,
                     return_residual=False):
  """Attention over packed variable-length sequences, as FlashAttention's varlen API.

  Sequence i holds query tokens [cu_seqlens_q[i], cu_seqlens_q[i + 1]) and key tokens
  [cu_seqlens_k[i], cu_seqlens_k[i + 1]). It runs as one batch element of `attention` with
  segment ids derived from cu_seqlens (no copy of q, k, v; the kernels skip tiles across
  sequences). Tokens past cu_seqlens[-1] attend nothing (out 0, lse -inf).

  Args:
    query: (Tq, N, H) packed queries; key: (Tk, K, H); value: (Tk, K, Hv).
    cu_seqlens_q: (num_seqs + 1,) int32, non-decreasing, starting at 0.
    cu_seqlens_k: same for keys; None means self-attention (cu_seqlens_q). is_causal,
      local_window_size and alibi_slopes compare positions inside each sequence, which the
      packed layout gives only for self-attention: they require cu_seqlens_k None or the
      same array as cu_seqlens_q.
    max_seqlen_q, max_seqlen_k: optional static upper bounds of the sequence lengths, as in
      FlashAttention; checked against the packed lengths. The segment-id mapping does not
      need them.
    Other arguments: as `attention` (alibi_slopes of shape (N,)).

  Returns:
    out (Tq, N, Hv); and lse (N, Tq) when return_residual.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 3:
      raise ValueError(f"attention_varlen: {name} must be packed (total_tokens, heads, dim), "
                       f"got shape {x.shape}")
  self_attention = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
  cu_seqlens_q = jnp.asarray(cu_seqlens_q)
  cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else jnp.asarray(cu_seqlens_k)
  for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
    if cu.ndim != 1 or cu.shape[0] < 2 or cu.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 of shape (num_seqs + 1,), got {cu.dtype} "
                       f"{cu.shape}")
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError(f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k "
                     f"{cu_seqlens_k.shape} must describe the same number of sequences")
  for name, bound, total in (("max_seqlen_q", max_seqlen_q, query.shape[0]),
                             ("max_seqlen_k", max_seqlen_k, key.shape[0])):
    if bound is not None and not (isinstance(bound, (int, np.integer)) and 0 <= bound <= total):
      raise ValueError(f"{name} must be None or an int in [0, {total}], got {bound!r}")
  if not self_attention:
    for name, on in (("is_causal", is_causal), ("local_window_size", local_window_size),
                     ("alibi_slopes", alibi_slopes)):
      if on is not None and on is not False:
        raise NotImplementedError(
            f"attention_varlen: `{name}` needs self-attention (cu_seqlens_k None or the same "
            "array as cu_seqlens_q); for cross-attention with positions use `attention` with "
            "padded inputs and query/key_value_seq_lengths")
  q_ids = _packed_segment_ids(cu_seqlens_q, query.shape[0], -1)
  kv_ids = _packed_segment_ids(cu_seqlens_k, key.shape[0], -2)
  out, lse = attention(query[None], key[None], value[None], scale=scale, is_causal=is_causal,
                       local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                       alibi_slopes=alibi_slopes, query_segment_ids=q_ids[None],
                       key_value_segment_ids=kv_ids[None], dropout_rate=dropout_rate,
                       dropout_rng=dropout_rng, deterministic_backward=deterministic_backward,
                       implementation=implementation, return_residual=True)
  return (out[0], lse[0]) if return_residual else out[0]
