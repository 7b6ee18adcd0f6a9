"""Sharding: batch/head sharding under jit (no collectives), shard_map, pmap, ring attention.

Runs on whatever devices jax has: the 8 fake CPU devices that conftest.py asks for (float32,
the CPU kernel), or the GPUs of a multi-GPU machine (bfloat16 and head dims of 64+,
implementation='cuda': the CUDA kernels take neither float32 nor small head dims). Meshes are
built from the device count; a case that needs more devices than are present skips, saying so.
References run on the host in float32 and in the input dtype, for the accuracy rule.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflash
from jaxflash import _ffi
from jaxflash.check import ATOL, max_err

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")

DEVICES = jax.devices()
ON_GPU = DEVICES[0].platform == "gpu"
KERNEL = "cuda" if ON_GPU else "cpu"        # the custom call every block runs
IMPL = "cuda" if ON_GPU else None          # on CPU, None picks the CPU kernel
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32

if ON_GPU and not _ffi.cuda_built():
  pytest.skip("GPUs present but jaxflash was built without CUDA kernels", allow_module_level=True)


def _devices(n):
  if n > len(DEVICES):
    pytest.skip(f"needs {n} devices, {len(DEVICES)} present")
  return DEVICES[:n]


def _mesh(shape, names, axis_type=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=_devices(math.prod(shape)))


def _upto(n):
  """A device count of at most n for cases that work on any 2+ devices."""
  return max(2, min(n, len(DEVICES)))


def _inputs(seed, B, T, N, K, H, dtype=DTYPE):
  """Fresh normal q, k, v, dout as host arrays. On GPU the head dim H becomes the smallest
  one the CUDA kernels are built for that is >= H (they have no small ones)."""
  if ON_GPU:
    H = min(d for d in _ffi.cuda_head_dims() if d >= H)
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32)
  do = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
  return [np.asarray(x.astype(dtype)) for x in (q, k, v, do)]


def _ref_and_grads(q, k, v, do, dlse_scale, is_causal, q_ids=None, kv_ids=None):
  """Reference out, lse and (dq, dk, dv) for the loss <out, do> + dlse_scale * sum(lse), on the
  host: (in float32, in the inputs' dtype)."""
  def run(dtype):
    def f(q, k, v):
      return jaxflash.attention_reference(q, k, v, is_causal=is_causal,
                                          query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
    (out, lse), vjp = jax.vjp(f, *(jnp.asarray(x, dtype) for x in (q, k, v)))
    grads = vjp((jnp.asarray(do, dtype), jnp.full_like(lse, dlse_scale)))
    return [np.asarray(x, np.float32) for x in (out, lse, *grads)]

  with jax.default_device(jax.devices("cpu")[0]):
    want32 = run(jnp.float32)
    return want32, (want32 if q.dtype == np.float32 else run(q.dtype))


def _check(got, want, dtype=DTYPE):
  """The accuracy rule: error <= 2x the reference's own error in the input dtype, + atol."""
  want32, want_low = want
  atol = ATOL[jnp.dtype(dtype).name]
  for name, g, w, l in zip(("out", "lse", "dq", "dk", "dv"), got, want32, want_low):
    err, bound = max_err(g, w), atol + 2 * max_err(l, w)
    assert not np.isnan(np.asarray(g, np.float32)).any(), f"{name}: NaN"
    assert err <= bound, f"{name}: error {err} > {bound}"


def _collectives(compiled_text):
  return [c for c in COLLECTIVES if c in compiled_text]


# --- batch / head sharding under jit ---------------------------------------------------------

def _batch_head_meshes():
  """(batch, heads) mesh shapes: 2 x up to 4 (the kv heads) when 4+ devices are present;
  with 2 devices, one mesh per axis so that both are split somewhere."""
  n = len(DEVICES)
  return [(2, min(4, n // 2))] if n >= 4 else [(2, 1), (1, 2)]


@pytest.mark.parametrize("shape", _batch_head_meshes(), ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
@pytest.mark.parametrize("spec", [P("b", None, "h", None), P(None, None, "h"), P("b")], ids=str)
def test_batch_head_sharding_has_no_collectives(axis_type, spec, shape):
  mesh = _mesh(shape, ("b", "h"), axis_type)
  q, k, v, do = _inputs(0, 4, 24, 8, 4, 32)  # GQA: 8 query heads over 4 kv heads
  want = _ref_and_grads(q, k, v, do, 0.5, True)
  sh = NamedSharding(mesh, spec)
  q, k, v, do = (jax.device_put(x, sh) for x in (q, k, v, do))

  attn = functools.partial(jaxflash.attention, is_causal=True, return_residual=True,
                           implementation=IMPL)

  def loss(q, k, v, do):
    out, lse = attn(q, k, v)
    return jnp.sum((out * do).astype(jnp.float32)) + 0.5 * jnp.sum(lse)

  fwd = jax.jit(attn)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  assert _collectives(fwd.lower(q, k, v).compile().as_text()) == []
  assert _collectives(grad.lower(q, k, v, do).compile().as_text()) == []
  out, lse = fwd(q, k, v)
  grads = grad(q, k, v, do)
  full = lambda p: tuple(p) + (None,) * (4 - len(p))
  for x in (out, *grads):
    assert full(x.sharding.spec) == full(spec)
  _check([out, lse, *grads], want)


@pytest.mark.parametrize("spec", [P(None, "h"), P()], ids=["sequence", "replicated"])
def test_sequence_sharded_or_replicated_inputs_stay_correct(spec):
  mesh = _mesh((_upto(8),), ("h",))
  q, k, v, do = _inputs(1, 2, 32, 4, 2, 16)
  want = _ref_and_grads(q, k, v, do, 0.0, True)
  sh = NamedSharding(mesh, spec)
  q, k, v, do = (jax.device_put(x, sh) for x in (q, k, v, do))
  attn = functools.partial(jaxflash.attention, is_causal=True, implementation=IMPL)
  loss = lambda q, k, v, do: jnp.sum((attn(q, k, v) * do).astype(jnp.float32))
  out = jax.jit(attn)(q, k, v)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, do)
  _check([out, want[0][1], *grads], want)


def test_inside_shard_map_grads_are_per_shard():
  # The output types keep the varying axes: no spurious psum in the gradients.
  mesh = _mesh((_upto(4),), ("b",))
  q, k, v, do = _inputs(2, 4, 16, 4, 2, 16)
  want = _ref_and_grads(q, k, v, do, 0.0, False)
  attn = jax.shard_map(functools.partial(jaxflash.attention, implementation=IMPL), mesh=mesh,
                       in_specs=P("b"), out_specs=P("b"))
  loss = lambda q, k, v: jnp.sum((attn(q, k, v) * do).astype(jnp.float32))
  out = jax.jit(attn)(q, k, v)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  _check([out, want[0][1], *grads], want)


def test_pmap_with_gqa():
  n = _upto(4)  # one batch element per device
  q, k, v, do = _inputs(3, n, 16, 4, 2, 16)
  want = _ref_and_grads(q, k, v, do, 0.0, True)
  one = lambda x: x[None]
  attn = lambda q, k, v: jaxflash.attention(one(q), one(k), one(v), is_causal=True,
                                            implementation=IMPL)[0]
  f = jax.pmap(attn, devices=_devices(n))
  g = jax.pmap(jax.grad(lambda q, k, v, do: jnp.sum((attn(q, k, v) * do).astype(jnp.float32)),
                        argnums=(0, 1, 2)), devices=_devices(n))
  _check([f(q, k, v), want[0][1], *g(q, k, v, do)], want)


# --- ring attention ------------------------------------------------------------------------

def _ring(mesh, layout, is_causal, batch_axis=None, segment_ids=False, **kw):
  """Ring attention under shard_map; with segment_ids, it takes (q, k, v, q_ids, kv_ids)."""
  attn = functools.partial(jaxflash.ring_attention, axis_name="sp", is_causal=is_causal,
                           layout=layout, return_residual=True, implementation=IMPL, **kw)
  if segment_ids:
    plain = attn
    attn = lambda q, k, v, qs, ks: plain(q, k, v, q_segment_ids=qs, kv_segment_ids=ks)
  tok = P(batch_axis, "sp")
  return jax.shard_map(attn, mesh=mesh, in_specs=tok, out_specs=(tok, P(batch_axis, None, "sp")))


def _ring_run(ring, q, k, v, do, num_shards, layout, dlse_scale, ids=()):
  """Runs ring attention on token-order host arrays; returns out, lse, grads in token order.
  `ids`: token-order (q_ids, kv_ids) when the ring takes segment ids. dlse_scale None: the loss
  leaves lse out (its cotangent symbolic), the gradients those of scale 0."""
  if layout == "zigzag":
    perm = lambda x, axis=1: np.asarray(jaxflash.zigzag_permute(x, num_shards, axis))
    unperm = lambda x, axis=1: np.asarray(jaxflash.zigzag_unpermute(x, num_shards, axis))
  else:
    perm = unperm = lambda x, axis=1: np.asarray(x)

  do = perm(do)
  ids = [perm(x) for x in ids]

  def loss(q, k, v):
    out, lse = ring(q, k, v, *ids)
    value = jnp.sum(out.astype(jnp.float32) * do)
    return value + (0.0 if dlse_scale is None else dlse_scale * jnp.sum(lse)), (out, lse)

  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
      perm(q), perm(k), perm(v))
  return [unperm(out), unperm(lse, 2)] + [unperm(g) for g in grads]


@pytest.mark.parametrize("num_shards", [2, 4, 8])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ring_matches_reference(num_shards, is_causal):
  mesh = _mesh((num_shards,), ("sp",))
  # GQA 4 over 2; 32 tokens a shard: on GPU the kernels round P and dS to bf16, and over a
  # 16-token sequence the max error of a few thousand elements sits at the bound (NOTES.md)
  q, k, v, do = _inputs(10 + num_shards, 2, 32 * num_shards, 4, 2, 16)
  want = _ref_and_grads(q, k, v, do, 0.25, is_causal)
  got = _ring_run(_ring(mesh, "zigzag", is_causal), q, k, v, do, num_shards, "zigzag", 0.25)
  _check(got, want)


def test_ring_contiguous_layout_and_batch_sharding():
  sp = min(4, max(2, len(DEVICES) // 2))  # 8 devices: 2 x 4; 4: 2 x 2; 2: 1 x 2
  mesh = _mesh((max(1, min(2, len(DEVICES) // sp)), sp), ("dp", "sp"))
  q, k, v, do = _inputs(20, 2, 32, 2, 2, 16)
  want = _ref_and_grads(q, k, v, do, 0.0, True)
  got = _ring_run(_ring(mesh, "contiguous", True, batch_axis="dp"), q, k, v, do, sp,
                  "contiguous", None)
  _check(got, want)


def test_ring_bfloat16_accuracy():
  n = _upto(4)
  mesh = _mesh((n,), ("sp",))
  q, k, v, do = _inputs(30, 1, 64, 4, 1, 32, jnp.bfloat16)
  want = _ref_and_grads(q, k, v, do, 0.0, True)
  got = _ring_run(_ring(mesh, "zigzag", True), q, k, v, do, n, "zigzag", None)
  _check(got, want, jnp.bfloat16)


def _documents(seed, B, T, num_docs):
  """(B, T) int32 ids of packed documents with random boundaries (ids 0, 1, ...)."""
  rng = np.random.default_rng(seed)
  starts = np.zeros((B, T), np.int32)
  for b in range(B):
    starts[b, rng.choice(np.arange(1, T), num_docs - 1, replace=False)] = 1
  return np.cumsum(starts, axis=1).astype(np.int32)


@pytest.mark.parametrize("num_shards", [2, 4])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ring_segment_ids_match_reference(num_shards, is_causal):
  # On GPU each block's forward and backward with segment ids are the CUDA variant kernels.
  mesh = _mesh((num_shards,), ("sp",))
  T = 8 * num_shards
  q, k, v, do = _inputs(60 + num_shards, 2, T, 4, 2, 16)  # GQA 4 over 2
  ids = _documents(num_shards, 2, T, 5)
  want = _ref_and_grads(q, k, v, do, 0.25, is_causal, q_ids=ids, kv_ids=ids)
  ring = _ring(mesh, "zigzag", is_causal, segment_ids=True)
  got = _ring_run(ring, q, k, v, do, num_shards, "zigzag", 0.25, ids=(ids, ids))
  _check(got, want)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_padding_rows_are_zero_without_nan(layout):
  # Pad queries (-1) and pad keys (-2) match nothing. Batch row 1 is padded over its last
  # half, so whole blocks of queries and keys see nothing; row 0 has one short document.
  num_shards, T = _upto(4), 32
  mesh = _mesh((num_shards,), ("sp",))
  q, k, v, do = _inputs(70, 2, T, 2, 1, 16)
  docs = _documents(7, 2, T, 3)
  pad = np.zeros((2, T), bool)
  pad[0, 5:9] = True
  pad[1, T // 2:] = True
  q_ids, kv_ids = np.where(pad, -1, docs), np.where(pad, -2, docs)
  want = _ref_and_grads(q, k, v, do, 0.5, True, q_ids=q_ids, kv_ids=kv_ids)
  ring = _ring(mesh, layout, True, segment_ids=True)
  got = _ring_run(ring, q, k, v, do, num_shards, layout, 0.5, ids=(q_ids, kv_ids))
  out, lse, dq, dk, dv = got
  for x in got:
    assert not np.isnan(np.asarray(x, np.float32)).any()
  np.testing.assert_array_equal(out[pad], 0.0)
  assert np.all(lse.transpose(0, 2, 1)[pad] == -np.inf)
  assert np.all(np.isfinite(lse.transpose(0, 2, 1)[~pad]))
  for g in (dq, dk, dv):
    np.testing.assert_array_equal(g[pad], 0.0)
  _check(got, want)


def test_ring_communicates_only_by_ppermute():
  mesh = _mesh((_upto(4),), ("sp",))
  q, k, v, do = _inputs(40, 1, 32, 2, 2, 16)
  ring = _ring(mesh, "zigzag", True)
  loss = lambda q, k, v: jnp.sum((ring(q, k, v)[0] * do).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  assert set(_collectives(text)) == {"collective-permute"}
  assert f"jaxflash_fwd_{KERNEL}" in text and f"jaxflash_bwd_{KERNEL}" in text


def test_zigzag_round_trip_and_balance():
  x = np.arange(2 * 32 * 3).reshape(2, 32, 3)
  for n in (1, 2, 4, 8):
    y = np.asarray(jaxflash.zigzag_permute(x, n))
    np.testing.assert_array_equal(np.asarray(jaxflash.zigzag_unpermute(y, n)), x)
    # shard i holds chunks i and 2n-1-i: every shard's positions sum to the same total
    shards = y[0, :, 0].reshape(n, -1) // 3
    assert len(set(shards.sum(axis=1).tolist())) == 1
  with pytest.raises(ValueError, match="multiple of 2 \\* num_shards"):
    jaxflash.zigzag_permute(x, 3)


def test_ring_rejects_what_it_cannot_do():
  mesh = _mesh((2,), ("sp",))
  q, k, v, _ = _inputs(50, 1, 8, 2, 2, 16)
  lengths = np.full((1,), 8, np.int32)
  with_lengths = jax.shard_map(lambda q, k, v, n: jaxflash.ring_attention(
      q, k, v, axis_name="sp", query_seq_lengths=n), mesh=mesh,
      in_specs=(P(None, "sp"),) * 3 + (P(),), out_specs=P(None, "sp"))
  with pytest.raises(NotImplementedError, match="query_seq_lengths.*segment_ids"):
    with_lengths(q, k, v, lengths)
  one_side = jax.shard_map(lambda q, k, v, s: jaxflash.ring_attention(
      q, k, v, axis_name="sp", q_segment_ids=s), mesh=mesh,
      in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  with pytest.raises(ValueError, match="given together"):
    one_side(q, k, v, _documents(0, 1, 8, 2))
  with pytest.raises(ValueError, match="layout"):
    jax.shard_map(functools.partial(jaxflash.ring_attention, axis_name="sp", layout="striped"),
                  mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
  with pytest.raises(ValueError, match="implementation must be None, 'cpu' or 'cuda'"):
    jax.shard_map(functools.partial(jaxflash.ring_attention, axis_name="sp",
                                    implementation="xla"),
                  mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)


def test_ring_never_differentiates_blocks_through_the_reference(monkeypatch):
  """float32 on a GPU, which the CUDA kernels refuse: with implementation=None each GPU block
  still calls the CUDA kernels (whose handler reports the dtype) rather than the reference,
  whose VJP would differentiate the block's own softmax."""
  monkeypatch.setattr(_ffi, "cuda_built", lambda: True)
  mesh = _mesh((2,), ("sp",))
  q, k, v, _ = _inputs(90, 2, 16, 4, 2, 64, jnp.float32)
  ring = jax.shard_map(
      functools.partial(jaxflash.ring_attention, axis_name="sp", implementation=None),
      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  loss = lambda q, k, v: jnp.sum(ring(q, k, v))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))  # traced only
  assert "jaxflash_fwd_cuda" in jaxpr and "jaxflash_bwd_cuda" in jaxpr
