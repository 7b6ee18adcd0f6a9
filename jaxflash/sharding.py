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
    split = []
    for o, ax in zip(outs, out_axes):
      b = ax.index("B")
      o = o.reshape(o.shape[:b] + (axis_size, B) + o.shape[b + 1:])
      split.append(jnp.moveaxis(o, b, 0))
    return tuple(split), tuple(True for _ in outs)

  return call
