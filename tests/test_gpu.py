"""GPU-only checks: 64-bit offsets (a tensor of more than 2**31 elements), platform choice,
the sm90 backward's dQ modes (first stores, deterministic orders), its preprocess beside the main
kernel, head dims the forward runs and the backward does not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _calls, _ffi
from common import assert_accurate, gpu

pytestmark = [pytest.mark.gpu, gpu]


def test_default_implementation_is_cuda_on_gpu():
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  assert "jaxflash_fwd_cuda" in jax.jit(jaxflash.attention).lower(q, q, q).as_text()


def _rand(key, shape):
  return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(jnp.bfloat16)


def test_query_tensor_over_2pow31_elements():
  """q, out and dq have 2**31 + 2**21 elements; rows are independent, so a slice is checked."""
  B, T, N, H, S = 1, 65536 + 64, 256, 128, 96
  assert B * T * N * H > 2**31
  q, k, v = _rand(0, (B, T, N, H)), _rand(1, (B, S, N, H)), _rand(2, (B, S, N, H))

  def loss(q):
    return jnp.sum(jaxflash.attention(q, k, v, implementation="cuda").astype(jnp.float32))

  out = jax.jit(lambda q: jaxflash.attention(q, k, v, implementation="cuda"))(q)
  tail = out[:, -100:]
  dq_tail = jax.jit(jax.grad(loss))(q)[:, -100:]
  del out

  qs = q[:, -100:]
  f32 = lambda x: x.astype(jnp.float32)
  ref, _ = jaxflash.attention_reference(f32(qs), f32(k), f32(v))
  lo, _ = jaxflash.attention_reference(qs, k, v)
  assert_accurate("out tail", tail, ref, lo, jnp.bfloat16)
  ref_loss = lambda q, k, v: jnp.sum(jaxflash.attention_reference(q, k, v)[0].astype(jnp.float32))
  assert_accurate("dq tail", dq_tail, jax.grad(ref_loss)(f32(qs), f32(k), f32(v)),
                  jax.grad(ref_loss)(qs, k, v), jnp.bfloat16)


def test_key_tensor_over_2pow31_elements():
  """k and v have 2**31 + 2**22 elements (S ~ 1M keys)."""
  B, T, N, H, S = 1, 64, 16, 128, 1048576 + 2048
  assert B * S * N * H > 2**31
  q, k, v = _rand(3, (B, T, N, H)), _rand(4, (B, S, N, H)), _rand(5, (B, S, N, H))
  out = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, implementation="cuda"))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  ref, _ = jax.jit(jaxflash.attention_reference)(f32(q), f32(k), f32(v))
  lo, _ = jax.jit(jaxflash.attention_reference)(q, k, v)
  assert_accurate("out", out, ref, lo, jnp.bfloat16)


def _forward_against_reference(shape, is_causal, seeds):
  """out and lse of one implementation='cuda' executable for each seed's inputs, checked
  against the reference; returns the executable, the last seed's inputs and its outputs."""
  B, T, S, N, K, H = shape
  fwd = jax.jit(lambda q, k, v: jaxflash.attention(
      q, k, v, is_causal=is_causal, implementation="cuda", return_residual=True))
  f32 = lambda x: x.astype(jnp.float32)
  ref = jax.jit(lambda *a: jaxflash.attention_reference(*a, is_causal=is_causal))
  for seed in seeds:
    q = _rand(seed, (B, T, N, H))
    k, v = _rand(seed + 1, (B, S, K, H)), _rand(seed + 2, (B, S, K, H))
    out, lse = fwd(q, k, v)
    (ref_out, ref_lse), (lo_out, lo_lse) = ref(f32(q), f32(k), f32(v)), ref(q, k, v)
    assert_accurate(f"out (seed {seed})", out, ref_out, lo_out, jnp.bfloat16)
    assert_accurate(f"lse (seed {seed})", lse, ref_lse, lo_lse, jnp.bfloat16)
  return fwd, (q, k, v), (out, lse)


@pytest.mark.parametrize("shape", [(4, 1000, 40, 8, 64), (2, 2048, 8, 8, 128)])
def test_persistent_causal_forward(shape):
  """The sm90 causal forward at H = 64 on at most 8 query tiles, and at H = 128 up to 4k, runs
  persistent, its CTAs taking tiles from a counter that no pass zeroes (hopper.cuh claim_tile):
  here 1280 (256) tiles of unequal lengths over one CTA per SM, the last query tile ragged,
  GQA. One executable runs three times on fresh inputs (each launch must take the counter
  over from the one before); every row of every head is checked."""
  B, T, N, K, H = shape
  _forward_against_reference((B, T, T, N, K, H), True, (6, 9, 12))


@pytest.mark.parametrize("shape", [(2, 1000, 4096, 10, 2, 128), (1, 1000, 4100, 10, 2, 128),
                                   (2, 1000, 4500, 16, 4, 64), (4, 200, 4224, 24, 8, 64)])
def test_split_last_round_forward(shape):
  """The persistent plain sm90 forward splits its last round (flash_fwd_sm90.cuh FwdTail) into
  runs of key tiles over the SMs; the last piece of a tile to finish merges the pieces. On 132
  SMs: 160 tiles (28 split, runs of ~7 key tiles, ragged rows, GQA); 80 tiles (all split, no
  whole round, ragged keys); at H = 64 192-row tiles of three warpgroups (60 split) and 128-row
  tiles with 192-key tiles (60 split). Three launches of one executable on fresh inputs (each
  takes the counters over from the one before), every row checked; a fourth gives the third's
  bits (the merge's order does not depend on which piece is last)."""
  fwd, args, (out, lse) = _forward_against_reference(shape, False, (3, 4, 5))
  out_again, lse_again = fwd(*args)
  assert (np.asarray(out).view(np.uint16) == np.asarray(out_again).view(np.uint16)).all()
  assert (np.asarray(lse) == np.asarray(lse_again)).all()


def _grads_against_reference(shape, is_causal, deterministic=False, seeds=(0, 1), **rules):
  """dq, dk, dv of implementation='cuda' for each seed's inputs, checked against the reference;
  returns the last seed's, and a function that computes them again. `rules`: more arguments
  of both (lengths, window, alignment, segment ids)."""
  B, T, S, N, K, H = shape
  if H not in _ffi.cuda_bwd_head_dims():
    pytest.skip("head dim not in this build (JAXFLASH_HEAD_DIMS)")
  grads = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(jaxflash.attention(
      q, k, v, is_causal=is_causal, implementation="cuda", deterministic_backward=deterministic,
      **rules).astype(jnp.float32) * do), (0, 1, 2)))
  ref = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(jaxflash.attention_reference(
      q, k, v, is_causal=is_causal, **rules)[0].astype(jnp.float32) * do), (0, 1, 2)))
  f32 = lambda x: x.astype(jnp.float32)
  for seed in seeds:
    q = _rand(20 + seed, (B, T, N, H))
    k, v = _rand(30 + seed, (B, S, K, H)), _rand(40 + seed, (B, S, K, H))
    do = jax.random.normal(jax.random.PRNGKey(50 + seed), (B, T, N, H), jnp.float32)
    got, hi, lo = grads(q, k, v, do), ref(f32(q), f32(k), f32(v), do), ref(q, k, v, do)
    for name, g, r, l in zip(("dq", "dk", "dv"), got, hi, lo):
      assert_accurate(name, g, r, l, jnp.bfloat16)
  return got, functools.partial(grads, q, k, v, do)


def _assert_same_bits(first, again):
  """`first` (dq, dk, dv) and three more runs of `again` are the same bits."""
  for _ in range(3):
    for name, a, b in zip(("dq", "dk", "dv"), first, again()):
      assert (np.asarray(a).view(np.uint16) == np.asarray(b).view(np.uint16)).all(), name


# Causal backwards whose dq_accum is not zeroed (sm90, up to 2048 keys): each query tile's first
# dQ is stored by the CTA that claims its ticket and the others add after it. Keys past the
# queries (no CTA owns the query tiles past S, every visitor may claim), GQA, ragged tiles;
# run twice so that the second reuses the first's workspace with its values in it.
@pytest.mark.parametrize("shape", [(2, 1500, 700, 8, 2, 128), (1, 2048, 2048, 8, 8, 64),
                                   (3, 1000, 1000, 4, 4, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_causal_grads_without_zeroed_dq_accum(shape):
  _grads_against_reference(shape, is_causal=True)


# Backwards whose preprocess runs beside the main kernel (sm90, more than two waves of CTAs past
# the first-store tickets): each main CTA waits for its (b, kv head) pair's rows, and slots of
# its grid convert dq group by group once the group's CTAs are done (DqSlots: the last shapes
# have slots among the CTAs, the others only after them). Causal and plain, GQA, ragged rows,
# fewer queries than keys; two calls, the second on the first's workspace.
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 2100, 2100, 16, 8, 128), (4, 1500, 1500, 8, 8, 64),
                                   (2, 1000, 3000, 16, 8, 128), (1, 4100, 4100, 8, 8, 256),
                                   (4, 2500, 2500, 16, 8, 128), (2, 2500, 2500, 24, 24, 64),
                                   (2, 4100, 4100, 16, 16, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_preprocess_beside_main_kernel(shape, is_causal):
  _grads_against_reference(shape, is_causal)


# deterministic_backward=True on plain and causal attention (sm90: the key tiles that visit a
# query tile add its dQ one after the other, last to first; plain attention with a pair's key
# tiles on at most half the SMs in rotated walks, the last shape's 71 key tiles not).
# Many key tiles and heads (atomics would race), GQA, more keys than queries and the reverse,
# ragged tiles: the gradients are accurate and the same bits on every run.
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 900, 1300, 8, 2, 64), (2, 1300, 900, 8, 2, 128),
                                   (1, 1000, 1000, 4, 4, 256), (1, 300, 4500, 4, 2, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_deterministic_backward_plain_and_causal(shape, is_causal):
  _assert_same_bits(*_grads_against_reference(shape, is_causal, deterministic=True, seeds=(0,)))


def _packed_ids(seed, batch, length, docs, shuffle=False):
  """(batch, length) ids of `docs` documents of random lengths, in order or (shuffle) each
  document's id drawn from a permutation, so that the ids are not sorted."""
  ids = jnp.sort(jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, docs), -1)
  if shuffle:
    ids = jax.random.permutation(jax.random.PRNGKey(seed + 1), docs)[ids]
  return ids.astype(jnp.int32)


# deterministic_backward=True with the key-range rules and segment ids (sm90: the rules kernel;
# a query tile's visitors are the key tiles its rows may see, and with segment ids only those
# whose ids meet its own count in its order; segment ids alone in rotated walks). Packed
# documents a few key tiles long (most key tiles meet only some query tiles), unsorted ids,
# lengths, window, bottom-right alignment, GQA, T != S, ragged tiles.
B_RULES, T_RULES, S_RULES = 2, 1300, 1700
DETERMINISTIC_RULES = {
    "segments_causal": lambda: dict(
        is_causal=True, query_segment_ids=_packed_ids(1, B_RULES, T_RULES, 9),
        key_value_segment_ids=_packed_ids(1, B_RULES, S_RULES, 9)),
    "segments_shuffled": lambda: dict(
        is_causal=False, query_segment_ids=_packed_ids(5, B_RULES, T_RULES, 6, shuffle=True),
        key_value_segment_ids=_packed_ids(5, B_RULES, S_RULES, 6, shuffle=True)),
    "segments_unsorted_lengths": lambda: dict(
        is_causal=False, query_segment_ids=_packed_ids(3, B_RULES, T_RULES, 7, shuffle=True),
        key_value_segment_ids=_packed_ids(3, B_RULES, S_RULES, 7, shuffle=True),
        query_seq_lengths=jnp.array([1100, 1300], jnp.int32),
        key_value_seq_lengths=jnp.array([1700, 950], jnp.int32)),
    "window_bottom_right_lengths": lambda: dict(
        is_causal=True, causal_alignment="bottom_right", local_window_size=(333, 0),
        query_seq_lengths=jnp.array([1300, 777], jnp.int32),
        key_value_seq_lengths=jnp.array([1500, 1700], jnp.int32)),
}


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("case", list(DETERMINISTIC_RULES))
def test_deterministic_backward_rules(case, H):
  rules = DETERMINISTIC_RULES[case]()
  is_causal = rules.pop("is_causal")
  _assert_same_bits(*_grads_against_reference((B_RULES, T_RULES, S_RULES, 8, 2, H), is_causal,
                                              deterministic=True, seeds=(0,), **rules))


# (H, Hv) pairs the CUDA forward runs without a CUDA backward: a value head dim below H other
# than the MLA 192/128 (and, in a build without them, any bwd_hdim<d> left out).
FORWARD_ONLY_CANDIDATES = [(128, 64), (256, 128), (96, 32), (192, 64), (256, 192)]


@pytest.mark.parametrize("H, Hv", FORWARD_ONLY_CANDIDATES, ids=lambda d: str(d))
def test_grad_at_forward_only_head_dims_raises(H, Hv):
  """The CUDA forward runs (also by default); a gradient raises naming the head dims, both
  pinned to 'cuda' (NotImplementedError at trace time) and with implementation=None (the
  handler's error at run time, not the O(T * S) reference VJP behind the user's back)."""
  dims = _ffi.cuda_head_dims()  # the forward runs H and Hv both compiled
  if H not in dims or Hv not in dims or _calls.cuda_bwd_head_dims_error(H, Hv) is None:
    pytest.skip("not a forward-only head dim pair in this build")
  q, k, v = _rand(6, (1, 40, 2, H)), _rand(7, (1, 50, 2, H)), _rand(8, (1, 50, 2, Hv))
  assert "jaxflash_fwd_cuda" in jax.jit(jaxflash.attention).lower(q, k, v).as_text()

  def loss(impl):
    return lambda q: jnp.sum(jaxflash.attention(q, k, v, implementation=impl).astype(jnp.float32))

  with pytest.raises(NotImplementedError, match=rf"supports head dims .*got H={H}, Hv={Hv}"):
    jax.grad(loss("cuda"))(q)
  with pytest.raises(Exception, match=rf"CUDA backward kernel supports head dims .*H={H}, Hv={Hv}"):
    jax.block_until_ready(jax.jit(jax.grad(loss(None)))(q))
