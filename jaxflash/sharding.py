"""Sharding: per-shard custom calls under jit, and ring (context-parallel) attention.

Letter key: B batch, T query length, S key/value length, N query heads, K key/value heads,
H head dim (V for the value head dim), P devices on the ring axis.

Batch/head sharding. `shard_local` wraps a function of the kernel operands in
`custom_partitioning` with a Shardy sharding rule built from a per-operand axis description
(`_calls.FWD_AXES`, `_calls.BWD_AXES`): every shard runs the function on its local block, so a
batch- or head-sharded call needs no collective. Axes other than B/N/K must be whole on every
shard; an input sharded along them (e.g. the sequence) is gathered first, which is correct but
not context-parallel: use `ring_attention` for that.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# Axis letters that may be split over devices; every other letter names an axis each shard
# needs whole.
_SPLITTABLE = ("B", "N", "K")


def _sizes(axes, shapes):
  """(B, N, K) of a call, read from the first operand with each letter at full size."""
  sizes = {}
  for ax, shape in zip(axes, shapes):
    for letter, n in zip(ax, shape):
      if letter in _SPLITTABLE:
        sizes[letter] = max(sizes.get(letter, 1), n)
  return sizes.get("B", 1), sizes.get("N", 1), sizes.get("K", sizes.get("N", 1))


def _factor(letter, n, B, N, K):
  """The Shardy factor of one axis. Broadcast (size-1) axes get factors of their own."""
  if letter == "B" and n == B:
    return "b"
  if letter == "K" and n == K:
    return "k"
  if letter == "N" and n == N:
    return "k" if N == K else CompoundFactor("k", "g")
  return f"{letter.lower()}{n}"


def _sharding_rule(in_axes, out_axes, in_shapes, out_shapes):
  B, N, K = _sizes(in_axes + out_axes, in_shapes + out_shapes)
  mappings = [ArrayMapping(*(_factor(l, n, B, N, K) for l, n in zip(ax, shape)))
              for ax, shape in zip(in_axes + out_axes, in_shapes + out_shapes)]
  names = [f for m in mappings for d in m for f in ((d,) if isinstance(d, str) else d)]
  # "g" (query heads per kv head) stays whole so that q heads split exactly as kv heads do.
  # Shardy wants the special factors in order of first appearance.
  local = tuple(f for f in dict.fromkeys(names) if f not in ("b", "k"))
  sizes = {"g": N // K} if N != K else {}
  return SdyShardingRule(tuple(mappings[:len(in_axes)]), tuple(mappings[len(in_axes):]),
                         need_replication_factors=local, **sizes)


def _mesh_size(mesh, entry):
  if entry is None:
    return 1
  names = (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(mesh.shape[a] for a in names)


def _local_specs(mesh, q_spec, in_axes, out_axes, in_shapes, out_shapes):
  """PartitionSpecs where B and N/K keep the query's sharding and every other axis is whole."""
  B, N, K = _sizes(in_axes + out_axes, in_shapes + out_shapes)
  q_ax = in_axes[0]
  spec = tuple(q_spec) + (None,) * (len(q_ax) - len(q_spec))
  batch = spec[q_ax.index("B")] if "B" in q_ax else None
  heads = spec[q_ax.index("N")] if "N" in q_ax else None
  if K % _mesh_size(mesh, heads):
    heads = None  # fewer kv heads than head shards: keep heads whole (the call gathers them)

  def spec_of(ax, shape):
    full = {"B": B, "N": N, "K": K}
    return PartitionSpec(*((batch if l == "B" else heads)
                           if l in _SPLITTABLE and n == full[l] else None
                           for l, n in zip(ax, shape)))

  return ([spec_of(a, s) for a, s in zip(in_axes, in_shapes)],
          [spec_of(a, s) for a, s in zip(out_axes, out_shapes)])


def _letter_specs(axes, shapes, specs):
  """{(letter, size): mesh axes} as the operands are sharded; the first operand wins."""
  out = {}
  for ax, shape, spec in zip(axes, shapes, specs):
    spec = tuple(spec) + (None,) * (len(ax) - len(spec))
    for l, n, e in zip(ax, shape, spec):
      out.setdefault((l, n), e)
  return out


def _partitioned(fn, in_axes, out_axes, in_shapes, out_shapes):
  """custom_partitioning of `fn` for operands of these shapes."""
  def local(*args):  # positional only: custom_partitioning binds the signature
    return fn(*args)

  wrapped = custom_partitioning(local)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    ins, outs = _local_specs(mesh, arg_shapes[0].sharding.spec, in_axes, out_axes, in_shapes,
                             out_shapes)
    named = lambda specs: tuple(NamedSharding(mesh, p) for p in specs)
    return mesh, local, named(outs), named(ins)

  wrapped.def_partition(partition=partition,
                        sharding_rule=_sharding_rule(in_axes, out_axes, in_shapes, out_shapes))
  return wrapped


def _out_shapes(fn, args):
  # plain shapes: with sharding in types, the global call's own output types are ambiguous
  outs = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
  return tuple(tuple(o.shape) for o in outs)


def shard_local(fn, in_axes, out_axes):
  """Wraps `fn(*arrays) -> tuple of arrays` to run per shard of its batch and head axes.

  Args:
    fn: a function of positional arrays returning a tuple of arrays.
    in_axes, out_axes: per operand / result, a string with one letter per axis (letter key of
      this module): B and N/K may be split over devices, every other axis is kept whole.

  vmap folds the mapped axis into B, so a vmapped call stays one partitioned call.
  """
  in_axes, out_axes = tuple(in_axes), tuple(out_axes)

  @jax.custom_batching.custom_vmap
  def call(*args):
    in_shapes = tuple(tuple(a.shape) for a in args)
    out_shapes = _out_shapes(fn, args)
    mesh = jax.typeof(args[0]).sharding.mesh
    explicit = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                     if t == AxisType.Explicit)
    if explicit:
      # Shardings are part of the types: map the local call over the explicit axes.
      ins, outs = _local_specs(mesh, jax.typeof(args[0]).sharding.spec, in_axes, out_axes,
                               in_shapes, out_shapes)
      given = _letter_specs(in_axes, in_shapes, [jax.typeof(a).sharding.spec for a in args])
      args = [jax.sharding.reshard(a, NamedSharding(mesh, p)) for a, p in zip(args, ins)]
      mapped = jax.shard_map(fn, mesh=mesh, in_specs=tuple(ins), out_specs=tuple(outs),
                             axis_names=frozenset(explicit))
      # outputs (and so gradients) come back sharded as the inputs were
      return tuple(jax.sharding.reshard(o, NamedSharding(mesh, PartitionSpec(
          *(given.get((l, n)) for l, n in zip(ax, o.shape)))))
                   for o, ax in zip(mapped(*args), out_axes))
    wrapped = _partitioned(fn, in_axes, out_axes, in_shapes, out_shapes)
    return tuple(wrapped(*args))

  @call.def_vmap
  def call_vmap(axis_size, in_batched, *args):
    B, _, _ = _sizes(in_axes, [a.shape[1:] if b else a.shape for a, b in zip(args, in_batched)])
    merged = []
    for a, batched, ax in zip(args, in_batched, in_axes):
      if not batched:
        a = jnp.broadcast_to(a, (axis_size,) + a.shape)
      b = ax.index("B")
      a = jnp.moveaxis(a, 0, b)
      shape = a.shape[:b + 1] + (B,) + a.shape[b + 2:]
      a = jnp.broadcast_to(a, shape)  # a broadcast (size-1) batch axis becomes B
      merged.append(a.reshape(a.shape[:b] + (axis_size * B,) + a.shape[b + 2:]))
    outs = call(*merged)
    # An output with a size-1 batch axis is the cotangent of a broadcast operand (dbias of a
    # (1, N, T, S) bias): the broadcast above is undone by summing over it.
    unmapped = _out_shapes(fn, [jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
                                for a, b in zip(args, in_batched)])
    split = []
    for o, ax, shape in zip(outs, out_axes, unmapped):
      b = ax.index("B")
      o = o.reshape(o.shape[:b] + (axis_size, B) + o.shape[b + 1:])
      if shape[b] == 1 and B > 1:
        o = jnp.sum(o, axis=b + 1, keepdims=True, dtype=jnp.float32).astype(o.dtype)
      split.append(jnp.moveaxis(o, b, 0))
    return tuple(split), tuple(True for _ in outs)

  return call


# ---------------------------------------------------------------------------------------------
# Ring attention (context parallelism).
#
# The sequence is split over a mesh axis of P devices. Each device keeps its query block and
# passes its key/value block around the ring with lax.ppermute, so after P steps every query
# block has seen every key block; the partial results combine through their logsumexp. The
# transfer of the next block is issued before the current block is computed, so the two
# overlap. Memory per device is O(T/P).
#
# Causal load balance (layout='zigzag'): the global sequence is cut into 2P chunks and device i
# holds chunks i and 2P-1-i. Against the key block of device j, device i then computes
#   j == i: the local block, causal;
#   j <  i: all its queries against the first key chunk (fully visible, the second is not);
#   j >  i: its second query chunk against both key chunks (its first chunk sees neither);
# so every device does the same work at every step.

LAYOUTS = ("zigzag", "contiguous")


def _chunked(x, num_shards, axis, name):
  """Splits `axis` of length L into (2, P, L/2P) (or (P, 2, L/2P) for the zigzag order)."""
  n = x.shape[axis]
  if n % (2 * num_shards):
    raise ValueError(f"{name}: the sequence length {n} (axis {axis}) must be a multiple of "
                     f"2 * num_shards = {2 * num_shards}")
  return n // (2 * num_shards)


def _index(x, i, axis):
  return jax.lax.index_in_dim(x, i, axis, keepdims=False)


def zigzag_permute(x, num_shards, axis=1):
  """Reorders a global sequence axis so that an even split gives shard i chunks i, 2P-1-i.

  Apply to query, key, value (axis=1 in BTNH) and to any per-token array (axis=1 of (B, T))
  before sharding the sequence over `num_shards` devices for `ring_attention(layout='zigzag')`.
  """
  axis = axis % x.ndim
  c = _chunked(x, num_shards, axis, "zigzag_permute")
  x = x.reshape(x.shape[:axis] + (2, num_shards, c) + x.shape[axis + 1:])
  first, second = _index(x, 0, axis), jnp.flip(_index(x, 1, axis), axis)
  # (P, 2, c): shard i gets chunk i of the first half and chunk P-1-i of the second half
  x = jnp.stack([first, second], axis=axis + 1)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 3:])


def zigzag_unpermute(x, num_shards, axis=1):
  """Inverse of `zigzag_permute`: brings outputs (axis=1) or lse (axis=2) back to token order."""
  axis = axis % x.ndim
  c = _chunked(x, num_shards, axis, "zigzag_unpermute")
  x = x.reshape(x.shape[:axis] + (num_shards, 2, c) + x.shape[axis + 1:])
  first, second = _index(x, 0, axis + 1), jnp.flip(_index(x, 1, axis + 1), axis)
  x = jnp.stack([first, second], axis=axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 3:])


@dataclasses.dataclass(frozen=True)
class _Ring:
  cfg: object      # the attention _Config, non-causal
  is_causal: bool
  layout: str
  axis_name: object


def _attention_module():
  # imported late: jaxflash.attention imports this module
  return importlib.import_module("jaxflash.attention")


def _ops(q_ids, kv_ids):
  """The variant operands of one block call: segment ids or nothing."""
  A = _attention_module()
  if q_ids is None:
    return A.NO_VARIANTS
  return {**A.NO_VARIANTS, "query_segment_ids": q_ids, "key_value_segment_ids": kv_ids}


def _block_fwd(rc, q, k, v, q_ids, kv_ids, causal):
  A = _attention_module()
  return A._run_fwd(q, k, v, _ops(q_ids, kv_ids), dataclasses.replace(rc.cfg, is_causal=causal))


def _block_bwd(rc, q, k, v, q_ids, kv_ids, out, lse, dout, dlse, out_f32, causal):
  A = _attention_module()
  cfg = dataclasses.replace(rc.cfg, is_causal=causal)
  # fp32 partials: the ring sums one per step, and rounding each to q's dtype would add a
  # rounding per step to the gradients of k, v (and q). delta = rowsum(dout * out) from the
  # merged out in fp32, not from out rounded once more after the merge of rounded blocks.
  return A._run_bwd(q, k, v, _ops(q_ids, kv_ids), out, lse, dout, dlse, cfg, out_f32=out_f32,
                    grads_f32=True)[:3]


def _shift(xs, axis_name, size):
  """Sends each array to the next device on the ring (device i -> i+1)."""
  perm = [(i, (i + 1) % size) for i in range(size)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), xs)


def _merge(acc, part):
  """Combines two normalised partial attentions (out (B,T,N,Hv) f32, lse (B,N,T)) exactly."""
  o, l = acc
  ob, lb = part
  new = jnp.logaddexp(l, lb)
  ref = jnp.where(jnp.isfinite(new), new, 0.0)  # rows no key has reached yet stay 0 / -inf
  w = lambda x: jnp.moveaxis(jnp.exp(x - ref), -1, -2)[..., None]  # (B,N,T) -> (B,T,N,1)
  return o * w(l) + ob.astype(jnp.float32) * w(lb), new


def _halves(x, axis):
  if x is None:  # absent segment ids
    return None, None
  n = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _ring_step(rc, step, me, size, kv, full, before, after, skip):
  """The block computation of ring step `step` on device `me` (see the layout notes above):
  the local block is causal, an earlier device's block is `before`, a later one's `after`
  (zigzag) or full/skipped (contiguous)."""
  if not rc.is_causal:
    return full(*kv)
  if step == 0:
    return full(*kv, causal=True)
  earlier = (me - step) % size < me
  first, later = (before, after) if rc.layout == "zigzag" else (full, skip)
  return jax.lax.cond(earlier, first, later, *kv)


def _ring_fwd_impl(q, k, v, q_ids, kv_ids, rc: _Ring):
  size = jax.lax.axis_size(rc.axis_name)
  me = jax.lax.axis_index(rc.axis_name)
  empty = (jnp.zeros_like(q, jnp.float32, shape=q.shape[:-1] + v.shape[-1:]),
           jnp.full_like(q, -jnp.inf, jnp.float32, shape=(q.shape[0], q.shape[2], q.shape[1])))
  first_half = lambda x: _halves(x, 1)[0]

  def full(k, v, kv_ids, causal=False):
    return _block_fwd(rc, q, k, v, q_ids, kv_ids, causal)

  def before(k, v, kv_ids):  # key block from an earlier device: only its first chunk is visible
    return full(first_half(k), first_half(v), first_half(kv_ids))

  def after(k, v, kv_ids):  # key block from a later device: only the second query chunk sees it
    second = lambda x, axis=1: _halves(x, axis)[1]
    out, lse = _block_fwd(rc, second(q), k, v, second(q_ids), kv_ids, False)
    o0, l0 = _halves(empty[0], 1)[0], _halves(empty[1], 2)[0]
    return (jnp.concatenate([o0.astype(out.dtype), out], 1), jnp.concatenate([l0, lse], 2))

  def skip(k, v, kv_ids):
    return empty[0].astype(q.dtype), empty[1]

  acc = empty
  kv = (k, v, kv_ids)  # the key block's segment ids travel with it
  for step in range(size):
    nxt = _shift(kv, rc.axis_name, size) if step + 1 < size else None  # overlaps the compute
    part = _ring_step(rc, step, me, size, kv, full, before, after, skip)
    acc = _merge(acc, part)
    kv = nxt
  return acc  # out in float32, lse


def _ring_bwd_impl(rc: _Ring, res, cts):
  q, k, v, q_ids, kv_ids, out_f32, lse = res
  out = out_f32.astype(q.dtype)  # the primal output, which the block backward also takes
  dout, dlse = _attention_module()._out_cotangents(cts, out)  # dlse None: no step reads one
  size = jax.lax.axis_size(rc.axis_name)
  me = jax.lax.axis_index(rc.axis_name)
  f32 = lambda x: jnp.zeros_like(x, jnp.float32)

  def full(k, v, kv_ids, causal=False):
    return _block_bwd(rc, q, k, v, q_ids, kv_ids, out, lse, dout, dlse, out_f32, causal)

  def before(k, v, kv_ids):
    (k0, k1), (v0, v1) = _halves(k, 1), _halves(v, 1)
    dq, dk, dv = full(k0, v0, _halves(kv_ids, 1)[0])
    return dq, jnp.concatenate([dk, f32(k1)], 1), jnp.concatenate([dv, f32(v1)], 1)

  def after(k, v, kv_ids):
    sel = lambda x, axis=1: _halves(x, axis)[1]
    dq, dk, dv = _block_bwd(rc, sel(q), k, v, sel(q_ids), kv_ids, sel(out), sel(lse, 2),
                            sel(dout), None if dlse is None else sel(dlse, 2), sel(out_f32),
                            False)
    return jnp.concatenate([f32(dq), dq], 1), dk, dv

  def skip(k, v, kv_ids):
    return f32(q), f32(k), f32(v)

  dq, dkv, kv = f32(q), (f32(k), f32(v)), (k, v, kv_ids)
  for step in range(size):
    nxt = _shift(kv, rc.axis_name, size) if step + 1 < size else None
    parts = _ring_step(rc, step, me, size, kv, full, before, after, skip)
    dq = dq + parts[0]
    dkv = (dkv[0] + parts[1], dkv[1] + parts[2])
    # the gradients travel with their key block; after the last shift they are home
    dkv = _shift(dkv, rc.axis_name, size)
    kv = nxt
  # integer segment ids get no cotangent
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, q_ids, kv_ids, rc: _Ring):
  out_f32, lse = _ring_fwd_impl(q, k, v, q_ids, kv_ids, rc)
  return out_f32.astype(q.dtype), lse


def _ring_fwd(q, k, v, q_ids, kv_ids, rc):
  q, k, v, q_ids, kv_ids = _attention_module()._primal_values((q, k, v, q_ids, kv_ids))
  out_f32, lse = _ring_fwd_impl(q, k, v, q_ids, kv_ids, rc)
  return (out_f32.astype(q.dtype), lse), (q, k, v, q_ids, kv_ids, out_f32, lse)


_ring.defvjp(_ring_fwd, _ring_bwd_impl, symbolic_zeros=True)


def ring_attention(query, key, value, *, axis_name, is_causal=False, layout="zigzag",
                   scale=None, q_segment_ids=None, kv_segment_ids=None,
                   query_seq_lengths=None, key_value_seq_lengths=None,
                   implementation=None, return_residual=False):
  """Ring (context-parallel) attention over the mesh axis `axis_name`; call inside shard_map.

  Every argument is this device's block of a sequence sharded evenly over `axis_name`
  (P devices): query (B, T/P, N, H), key (B, S/P, K, H), value (B, S/P, K, Hv), T == S when
  causal. Batch and heads may be sharded over other mesh axes as well.

  Args:
    axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
    is_causal: causal attention in global token order.
    layout: how the global sequence maps onto the devices when causal. 'zigzag' (balanced):
      shard i holds chunks i and 2P-1-i of 2P chunks; lay the inputs out with
      `zigzag_permute` and bring the outputs back with `zigzag_unpermute`. 'contiguous':
      shard i holds the i-th block (no permutation, but the last device does P times the
      work of the first).
    scale, implementation: as in `jaxflash.attention` (the kernel runs each block).
    q_segment_ids, kv_segment_ids: (B, T/P) / (B, S/P) integers, given together, in the same
      layout as the tokens (zigzag_permute them too): query t sees key s only where the ids
      are equal. Padding is expressed through them: give pad queries and pad keys ids that
      match nothing, different for the two (e.g. -1 and -2). A query that sees no key gets
      out 0, lse -inf and zero gradients.
    query_seq_lengths, key_value_seq_lengths: not supported (see Raises); use segment ids.
    return_residual: also return the global logsumexp of the local queries, (B, N, T/P) f32.

  Returns:
    out (B, T/P, N, Hv), this device's block of the global attention, and lse when
    return_residual. Differentiable in query, key, value (and through lse).

  Raises:
    NotImplementedError: for query_seq_lengths / key_value_seq_lengths (global positions do
      not map onto one block per device under zigzag): express padding with segment ids.
  """
  A = _attention_module()
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  # Each block's backward takes the global out/lse; the reference's VJP would differentiate
  # the block's own softmax instead, so 'xla' has no correct ring backward.
  if implementation not in (None, "cpu", "cuda"):
    raise ValueError("ring_attention runs the kernels on each block: implementation must be "
                     f"None, 'cpu' or 'cuda', got {implementation!r}")
  for name, x in (("query_seq_lengths", query_seq_lengths),
                  ("key_value_seq_lengths", key_value_seq_lengths)):
    if x is not None:
      raise NotImplementedError(
          f"ring_attention: `{name}` is not supported; express padding with q_segment_ids / "
          "kv_segment_ids (pad queries and pad keys get ids that match nothing, e.g. -1 and "
          "-2)")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("ring_attention: q_segment_ids and kv_segment_ids must be given together, "
                     f"got only {'q' if kv_segment_ids is None else 'kv'}_segment_ids")
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  A.check_inputs(query, key, value)
  if is_causal and query.shape[1] != key.shape[1]:
    raise ValueError(f"ring_attention: causal needs equal query and key block lengths, got "
                     f"T/P={query.shape[1]} and S/P={key.shape[1]}")
  if is_causal and layout == "zigzag" and query.shape[1] % 2:
    raise ValueError(f"ring_attention: layout='zigzag' needs an even block length (two "
                     f"chunks per device), got {query.shape[1]}")
  if q_segment_ids is not None:
    q_segment_ids = A._check_ids("q_segment_ids", q_segment_ids, query.shape[:2])
    kv_segment_ids = A._check_ids("kv_segment_ids", kv_segment_ids, key.shape[:2])
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
  # Each block's backward is the kernel's (CPU or CUDA, segment ids included), fed the global
  # out/lse.
  cfg = A._resolve(query, value, implementation, scale, False)
  # Where the CUDA kernels cannot take the inputs (e.g. float32), implementation=None would
  # pick the reference for GPU blocks, whose VJP differentiates each block's own softmax:
  # wrong gradients. Keep the CUDA kernel instead, whose handler names what it lacks on GPU.
  if cfg.cuda == "xla":
    cfg = dataclasses.replace(cfg, cuda="cuda")
  out, lse = _ring(query, key, value, q_segment_ids, kv_segment_ids,
                   _Ring(cfg, bool(is_causal), layout, axis_name))
  return (out, lse) if return_residual else out
