"""Attention variants (issue 4) against the reference, for every implementation.

Each case runs the implementation on bf16 inputs and checks out, lse, dq, dk, dv (and dbias,
dalibi) with the accuracy rule against the reference on float32 copies; the reference on the
bf16 inputs gives the error bar. Shapes are small, with lengths that are not tile multiples.
The CUDA cases (GPU only) run the same variants at the head dims the CUDA kernels have, in
bfloat16 and float16, forward and backward (also in deterministic mode), and check that the
deterministic CUDA backward is bit-identical across runs.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from common import assert_accurate, gpu, on_device, on_host
from jaxflash.reference import attention_reference, dropout_keep, dropout_seeds

B, T, S, N, K, H, HV = 2, 37, 70, 4, 2, 24, 16
DTYPE = jnp.bfloat16
# the module (jaxflash.attention the attribute is the function)
attention_mod = importlib.import_module("jaxflash.attention")


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _ids(seed, length, docs, sort=True):
  """Segment ids of shape (B, length): sorted (packed documents of random lengths), or with
  sort=False an id drawn per token."""
  cuts = jax.random.randint(jax.random.PRNGKey(seed), (B, length), 0, docs)
  return (jnp.sort(cuts, axis=-1) if sort else cuts).astype(jnp.int32)


def _docs(length, docs):
  """(B, length) ids of `docs` equal documents 0, 1, ..."""
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) * docs // length, (B, length))


def _block_sparse(seed, shape, block, tile):
  """A bool mask of `shape` (..., T|1, S) of block x block pieces, each all False, all True or
  random, cut at T and S. Where the kernels' tiles are tile x tile, rows [0, 2 tile) x keys
  [2 tile, 4 tile) are False (whole tiles that the forward and backward skip) and rows
  [T / 2, T) x keys [0, 2 tile) True (tiles with no per-element test); row 1 sees nothing."""
  *lead, t, s = shape
  kind = jax.random.choice(jax.random.PRNGKey(seed), 3, (*lead, -(-t // block), -(-s // block)),
                           p=jnp.array([0.45, 0.3, 0.25]))
  kind = jnp.repeat(jnp.repeat(kind, block, -2), block, -1)[..., :t, :s]
  mixed = jax.random.bernoulli(jax.random.PRNGKey(seed + 1), 0.5, shape)
  mask = jnp.where(kind == 2, mixed, kind == 1)
  mask = mask.at[..., :2 * tile, 2 * tile:4 * tile].set(False)
  mask = mask.at[..., t // 2:, :2 * tile].set(True)
  return mask.at[..., 1:2, :].set(False)


@functools.cache
def _cases(T, S):
  """name -> (static kwargs, differentiable kwargs) for query length T and key length S."""
  LENGTHS = dict(query_seq_lengths=jnp.array([T * 29 // 37, 0], jnp.int32),
                 key_value_seq_lengths=jnp.array([S * 51 // 70, S], jnp.int32))
  tile = 64 if T > 64 else 16  # the CUDA kernels' mask tiles; the small shapes scale it down
  return {
      "lengths_causal": (dict(is_causal=True, **LENGTHS), {}),
      "bottom_right_causal": (dict(is_causal=True, causal_alignment="bottom_right"), {}),
      "bottom_right_lengths_window": (dict(is_causal=True, causal_alignment="bottom_right",
                                           local_window_size=(9, 0), **LENGTHS), {}),
      "window_int": (dict(local_window_size=7), {}),
      "window_pair_causal": (dict(local_window_size=(12, 3), is_causal=True), {}),
      "segments_causal": (dict(query_segment_ids=_ids(16, T, 4),
                               key_value_segment_ids=_ids(17, S, 4), is_causal=True), {}),
      "segments_causal_window": (dict(query_segment_ids=_ids(1, T, 3),
                                      key_value_segment_ids=_ids(2, S, 3),
                                      is_causal=True, local_window_size=(20, 20)), {}),
      "segments": (dict(query_segment_ids=_ids(27, T, 4), key_value_segment_ids=_ids(28, S, 4)),
                   {}),
      "segments_lengths_bottom_right": (dict(query_segment_ids=_ids(29, T, 3),
                                             key_value_segment_ids=_ids(30, S, 3), is_causal=True,
                                             causal_alignment="bottom_right", **LENGTHS), {}),
      # the queries of document 2 find no key of theirs (fully masked rows); no query sees the
      # keys of document 5
      "segments_orphans_window": (dict(query_segment_ids=_docs(T, 4),
                                       key_value_segment_ids=jnp.where(_docs(S, 4) == 2, 5,
                                                                       _docs(S, 4)),
                                       local_window_size=(S // 4, S // 8)), {}),
      "segments_unsorted_causal": (dict(query_segment_ids=_ids(31, T, 3, sort=False),
                                        key_value_segment_ids=_ids(32, S, 3, sort=False),
                                        is_causal=True), {}),
      "softcap_alibi": (dict(logits_soft_cap=1.5), dict(alibi_slopes=jnp.abs(_rand(2, (N,))))),
      # the soft cap alone and with the rules: the sm90 kernels' (forward and backward) on Hopper
      "softcap_causal": (dict(logits_soft_cap=2.0, is_causal=True), {}),
      "softcap_lengths_window": (dict(logits_soft_cap=4.0, local_window_size=(40, 10), **LENGTHS),
                                 {}),
      "alibi_lengths_bottom_right": (dict(alibi_slopes=jnp.abs(_rand(5, (B, N))), is_causal=True,
                                          causal_alignment="bottom_right", **LENGTHS), {}),
      "alibi_batched_bottom_right": (dict(causal_alignment="bottom_right", is_causal=True),
                                     dict(alibi_slopes=jnp.abs(_rand(3, (B, N))))),
      "mask_lengths": (dict(mask=jax.random.bernoulli(jax.random.PRNGKey(4), 0.6, (B, 1, T, S)),
                            **LENGTHS), {}),
      "mask_rank2_causal": (dict(mask=jax.random.bernoulli(jax.random.PRNGKey(5), 0.3, (T, S)),
                                 is_causal=True), {}),
      # block-sparse masks (whole tiles False or True, mixed ones), one for every batch and
      # head, per (batch, head) with head 0 of batch 0 seeing nothing, and over the keys alone
      "block_sparse_shared": (dict(mask=_block_sparse(27, (1, 1, T, S), tile, tile)), {}),
      "block_sparse_heads_causal": (dict(mask=_block_sparse(28, (B, N, T, S), tile * 3 // 4, tile)
                                         .at[0, 0].set(False), is_causal=True), {}),
      "block_sparse_keys_lengths": (dict(mask=_block_sparse(29, (B, 1, 1, S), tile, tile),
                                         **LENGTHS), {}),
      "bias_heads_rows_causal": (dict(is_causal=True), dict(bias=_rand(6, (1, N, T, 1)))),
      # dbias summed over broadcast batch / heads / query rows (the GPU's fp32 workspace)
      "bias_heads_causal": (dict(is_causal=True), dict(bias=_rand(18, (1, N, T, S)))),
      "bias_batch_causal": (dict(is_causal=True), dict(bias=_rand(19, (B, 1, T, S)))),
      "bias_shared_causal": (dict(is_causal=True), dict(bias=_rand(25, (1, 1, T, S)))),
      "bias_keys_causal": (dict(is_causal=True), dict(bias=_rand(26, (B, N, 1, S)))),
      # a full bias: dbias = dZ element by element (on Hopper with S % 8 == 0 the sm90 backward
      # writes every element with no rules, the visited ones over zeros with them)
      "bias_full": ({}, dict(bias=_rand(36, (B, N, T, S)))),
      "bias_full_causal_window": (dict(is_causal=True, local_window_size=(S // 4, 0)),
                                  dict(bias=_rand(37, (B, N, T, S)))),
      "bias_full_mask": (dict(mask=jax.random.bernoulli(jax.random.PRNGKey(7), 0.7, (B, N, T, S))),
                         dict(bias=_rand(8, (B, N, T, S)))),
      "bias_keys_lengths_f32": (dict(**LENGTHS), dict(bias=_rand(9, (B, 1, 1, S)))),
      "bias_segments_lengths": (dict(query_segment_ids=_ids(33, T, 4),
                                     key_value_segment_ids=_ids(34, S, 4), **LENGTHS),
                                dict(bias=_rand(35, (B, N, T, S)))),
      "dropout_window": (dict(dropout_rate=0.25, dropout_rng=jax.random.key(10),
                              local_window_size=(30, 5)), {}),
      "everything": (dict(is_causal=True, causal_alignment="bottom_right",
                          local_window_size=(25, 2), logits_soft_cap=3.0, dropout_rate=0.1,
                          dropout_rng=jax.random.key(11), query_segment_ids=_ids(12, T, 2),
                          key_value_segment_ids=_ids(12, S, 2), **LENGTHS,
                          mask=jax.random.bernoulli(jax.random.PRNGKey(13), 0.8, (1, N, T, S))),
                     dict(bias=_rand(14, (B, N, 1, S)), alibi_slopes=jnp.abs(_rand(15, (N,))))),
  }


CASES = _cases(T, S)


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


def _loss_and_grads(fn, q, k, v, diff, dout, dlse):
  """(out, lse) and grads of sum(out * dout) + sum(finite lse * dlse) w.r.t. q, k, v, diff;
  lse as computed (-inf on rows that see no key)."""
  def loss(q, k, v, diff):
    out, lse = fn(q, k, v, diff)
    finite = jnp.where(jnp.isinf(lse), 0.0, lse)
    return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(finite * dlse), (out, lse)
  (_, res), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, diff)
  return res, grads


# Small odd head dims (24/16) and a float32 case: the CPU kernel and the reference; the CUDA
# kernel runs the same cases at GPU head dims below.
CPU_IMPLEMENTATIONS = ["xla", "cpu"]


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_variant(impl, case):
  _check_case(impl, case, T, S, H, HV)


# GPU-sized: T and S span several query and key tiles (64/128 and 16 to 64), with lengths
# that are not tile multiples.
GPU_T, GPU_S = 200, 333
# Every case at H = Hv = 64 and 128, forward and backward; the other head dims (H, Hv) take a
# few cases that use many rules at once (their kernels share the variant code, not the tiles).
GPU_MORE_HEAD_DIMS = [(32, 32), (96, 96), (192, 192), (256, 256), (192, 128)]
GPU_MORE_CASES = ["segments_causal_window", "bottom_right_lengths_window", "everything"]


GPU_CASES = [c for c in CASES if not c.endswith("f32")]
GPU_DTYPES = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case, head_dims, dtype",
                         [(c, d, t) for d in GPU_MORE_HEAD_DIMS for c in GPU_MORE_CASES
                          for t in (jnp.bfloat16, jnp.float16)],
                         ids=lambda x: ("%dx%d" % x if isinstance(x, tuple) else
                                        x if isinstance(x, str) else jnp.dtype(x).name))
def test_cuda_head_dims_variant(case, head_dims, dtype):
  """implementation='cuda' at the other head dims (padded or 64-key tiles): the CUDA forward
  and backward run the variant (out, lse, dq, dk, dv, dbias, dalibi checked)."""
  if head_dims[0] not in jaxflash._ffi.cuda_bwd_head_dims():
    pytest.skip("head dim not in this build (JAXFLASH_HEAD_DIMS)")
  _check_case("cuda", case, GPU_T, GPU_S, *head_dims, dtype=dtype)


@pytest.mark.gpu
@gpu
@GPU_DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_variant(case, head_dim, dtype):
  """implementation='cuda': the CUDA forward and backward run the variant (out, lse, dq, dk,
  dv, dbias, dalibi checked). dbias over broadcast dims and dalibi need the backward's delta
  from the forward's fp32 O (test_o_f32_residual)."""
  _check_case("cuda", case, GPU_T, GPU_S, head_dim, head_dim, dtype=dtype)


# ALiBi and a bias in a forward with no backward: on Hopper the sm90 forward runs them (a bias
# whose rows are 16-byte aligned: S a multiple of 8; not a tile's), which it does not where the
# backward needs the sm80 forward's fp32 O (test_o_f32_residual). 1000 x 1304: the bias stages
# cycle over 11 key tiles, and with segment ids over those a query tile visits.
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case, t, s, dtype", [
    ("softcap_alibi", GPU_T, GPU_S, jnp.bfloat16), ("softcap_alibi", GPU_T, GPU_S, jnp.float16),
    ("alibi_batched_bottom_right", GPU_T, GPU_S, jnp.bfloat16),
    ("alibi_lengths_bottom_right", GPU_T, GPU_S, jnp.bfloat16),
    ("bias_heads_causal", GPU_T, GPU_S + 3, jnp.bfloat16),
    ("bias_heads_causal", GPU_T, GPU_S + 3, jnp.float16),
    ("bias_keys_causal", GPU_T, GPU_S + 3, jnp.bfloat16),
    ("bias_shared_causal", GPU_T, GPU_S + 3, jnp.bfloat16),
    ("bias_segments_lengths", GPU_T, GPU_S + 3, jnp.bfloat16),
    ("bias_segments_lengths", 1000, 1304, jnp.bfloat16),
], ids=lambda x: x if isinstance(x, (str, int)) else jnp.dtype(x).name)
def test_cuda_variant_forward(case, t, s, dtype, head_dim):
  _check_case("cuda", case, t, s, head_dim, head_dim, with_grads=False, dtype=dtype)


# A bias with no broadcast dim, differentiated, its rows 16-byte aligned (S % 8 == 0): on Hopper
# the sm90 forward (no fp32 O kept for it) and, at D=128, the sm90 backward run it, dbias = dS
# written from its registers; else the sm80-class backward. 1000 x 1304: 11 key tiles; the
# window and segment ids skip steps.
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case, t, s, dtype", [
    ("bias_full", GPU_T, GPU_S + 3, jnp.bfloat16), ("bias_full", GPU_T, GPU_S + 3, jnp.float16),
    ("bias_full_causal_window", GPU_T, GPU_S + 3, jnp.bfloat16),
    ("bias_segments_lengths", GPU_T, GPU_S + 3, jnp.bfloat16),
    ("bias_full", 1000, 1304, jnp.bfloat16),
    ("bias_full_causal_window", 1000, 1304, jnp.bfloat16),
    ("bias_segments_lengths", 1000, 1304, jnp.bfloat16),
], ids=lambda x: x if isinstance(x, (str, int)) else jnp.dtype(x).name)
def test_cuda_bias_backward(case, t, s, dtype, head_dim):
  _check_case("cuda", case, t, s, head_dim, head_dim, dtype=dtype)


# Segment ids where documents span several 128-key tiles (GPU_T, GPU_S hold 2-3 key tiles):
# the sm90 forward skips the key tiles a query tile has no id of, and runs tiles whose rows and
# keys carry one id without the element test, the others with it. T, S not tile multiples; GQA.
SEGMENT_CASES = [c for c in CASES if c.startswith("segments")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", SEGMENT_CASES)
def test_cuda_segments_long(case, head_dim):
  """implementation='cuda' on 1000 queries and 1300 keys with segment ids alone and with
  causal, window, lengths, bottom-right alignment, unsorted ids and fully masked rows."""
  _check_case("cuda", case, 1000, 1300, head_dim, head_dim)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", ["lengths_causal", "segments_causal_window", "softcap_alibi",
                                  "softcap_lengths_window", "bias_heads_causal", "bias_keys_causal",
                                  "bias_heads_rows_causal", "bias_full_mask", "everything"])
def test_cuda_deterministic_variant(case, head_dim):
  """deterministic_backward=True: the ordered dQ sums and the dbias kernel of a broadcast bias
  give the reference's gradients too."""
  _check_case("cuda", case, GPU_T, GPU_S, head_dim, head_dim, deterministic=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dims", [(256, 256), (192, 128), (32, 32)], ids=lambda d: "%dx%d" % d)
@pytest.mark.parametrize("case", ["bias_heads_causal", "everything"])
def test_cuda_deterministic_head_dims(case, head_dims):
  """deterministic_backward=True on the 64-key tiles (256, MLA 192/128) and a padded width
  (32 on 64): ordered dQ sums and the dbias kernel of a broadcast bias."""
  if head_dims[0] not in jaxflash._ffi.cuda_bwd_head_dims():
    pytest.skip("head dim not in this build (JAXFLASH_HEAD_DIMS)")
  _check_case("cuda", case, GPU_T, GPU_S, *head_dims, deterministic=True)


BLOCK_SPARSE_CASES = [c for c in CASES if c.startswith("block_sparse")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("head_dims", [(64, 64), (128, 128), (256, 256), (192, 128)],
                         ids=lambda d: "%dx%d" % d)
@pytest.mark.parametrize("case", BLOCK_SPARSE_CASES)
def test_cuda_block_sparse_mask(case, head_dims, deterministic):
  """The mask's tile summary: tiles with no True element skipped, all-True ones not tested per
  element, mixed ones tested, on every tile shape of the forward (64 x 64 | 32 | 16 keys) and
  of the backward (128 x 128, 64 x 128, 64 x 64) and in both dQ modes (the deterministic
  order counts only the key tiles the mask leaves)."""
  if head_dims[0] not in jaxflash._ffi.cuda_bwd_head_dims():
    pytest.skip("head dim not in this build (JAXFLASH_HEAD_DIMS)")
  _check_case("cuda", case, GPU_T, GPU_S, *head_dims, deterministic=deterministic)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", BLOCK_SPARSE_CASES)
def test_cuda_block_sparse_mask_word_rows(case, head_dim):
  """S % 4 == 0: the summary reads the mask's rows 4 bytes at a time."""
  _check_case("cuda", case, GPU_T, GPU_S - 1, head_dim, head_dim)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["segments_causal", "bias_shared_causal", "everything"])
def test_cuda_default_implementation_runs_variant_backward(case):
  """implementation=None on GPU: the CUDA forward and the CUDA backward (no reference VJP)."""
  _check_case(None, case, GPU_T, GPU_S, 64, 64, device="cuda")


def _check_case(impl, case, T, S, H, HV, with_grads=True, device=None, dtype=DTYPE,
                deterministic=False):
  static, diff = _cases(T, S)[case]
  q = _rand(20, (B, T, N, H), dtype)
  k = _rand(21, (B, S, K, H), dtype)
  v = _rand(22, (B, S, K, HV), dtype)
  dout = _rand(23, (B, T, N, HV))
  dlse = _rand(24, (B, N, T))
  if case.endswith("f32"):
    q, k, v = _cast((q, k, v), jnp.float32)
  dtype = q.dtype.type  # the scalar type keys common.ATOL

  def impl_fn(q, k, v, diff):
    return jaxflash.attention(q, k, v, implementation=impl, return_residual=True,
                              deterministic_backward=deterministic, **static, **diff)

  def ref_fn(q, k, v, diff):
    kw = dict(static, **diff)
    kw["bias"] = kw.get("bias", None)
    if kw["bias"] is not None and kw["bias"].ndim < 4:
      kw["bias"] = kw["bias"].reshape((1,) * (4 - kw["bias"].ndim) + kw["bias"].shape)
    if kw.get("mask") is not None and kw["mask"].ndim < 4:
      kw["mask"] = kw["mask"][None, None]
    return attention_reference(q, k, v, **kw)

  args = (q, k, v, _cast(diff, dtype), dout, dlse)
  with on_device(device or impl):
    if with_grads:
      run = jax.jit(lambda *a: _loss_and_grads(impl_fn, *a))
      (out, lse), grads = run(*args)
    else:
      run = jax.jit(lambda *a: impl_fn(*a[:4]))
      out, lse = run(*args)
    if device == "cuda" or impl == "cuda":  # the variant really reached the CUDA kernels
      hlo = run.lower(*args).as_text()
      assert "jaxflash_fwd_cuda" in hlo and ("jaxflash_bwd_cuda" in hlo) == with_grads
  ref = jax.jit(lambda *a: _loss_and_grads(ref_fn, *a))  # one compile, not one per op
  (r_out, r_lse), r_grads = ref(*_cast((q, k, v, diff), jnp.float32), dout, dlse)
  (l_out, l_lse), l_grads = ref(q, k, v, _cast(diff, dtype), dout, dlse)

  assert out.dtype == q.dtype and out.shape == (B, T, N, HV)
  assert_accurate("out", out, r_out, l_out, dtype)
  assert_accurate("lse", lse, r_lse, l_lse, dtype)
  if not with_grads:
    return
  names = ["dq", "dk", "dv"] + [f"d{n}" for n in sorted(diff)]
  for name, g, r, lo in zip(names, jax.tree.leaves(grads), jax.tree.leaves(r_grads),
                            jax.tree.leaves(l_grads)):
    assert g.shape == r.shape, name
    assert_accurate(name, g, r, lo, dtype)


@pytest.mark.parametrize("impl", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_fully_masked_rows(impl):
  """Rows past a length of 0 or with an all-False mask row: out 0, lse -inf, grads 0, no NaN."""
  h, hv, dtype = (64, 64, jnp.bfloat16) if impl == "cuda" else (H, HV, jnp.float32)
  q = _rand(30, (B, T, N, h), dtype)
  k = _rand(31, (B, S, K, h), dtype)
  v = _rand(32, (B, S, K, hv), dtype)
  mask = jnp.ones((1, 1, T, S), bool).at[..., 5, :].set(False)
  kw = dict(query_seq_lengths=jnp.array([T, 10], jnp.int32),
            key_value_seq_lengths=jnp.array([0, S], jnp.int32), mask=mask, is_causal=True)
  bias = _rand(33, (B, N, T, S), dtype)

  def loss(q, k, v, bias):
    out, lse = jaxflash.attention(q, k, v, bias, implementation=impl, return_residual=True,
                                  **kw)
    return (jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse)),
            (out, lse))

  with on_device(impl):
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
        q, k, v, bias)
  dq, dk, dv, dbias = grads
  for x in (out, dq, dk, dv, dbias):
    assert not jnp.isnan(x).any()
  assert (out[0] == 0).all() and (lse[0] == -jnp.inf).all()  # kv length 0
  assert (out[1, 10:] == 0).all() and (lse[1, :, 10:] == -jnp.inf).all()  # past q length
  assert (out[1, 5] == 0).all() and (lse[1, :, 5] == -jnp.inf).all()  # all-False mask row
  assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
  assert (dq[1, 10:] == 0).all() and (dbias[1, :, 10:] == 0).all() and (dbias[0] == 0).all()
  assert jnp.isfinite(lse[1, :, :5]).all()


@on_host
def test_vmap_and_vmap_of_grad():
  """vmap over a leading axis (bias unbatched, mask/lengths/segments/dropout keys batched)
  gives, per element, the unbatched call; and so does vmap of grad."""
  V = 3
  q = _rand(40, (V, B, T, N, H))
  k = _rand(41, (V, B, S, K, H))
  v = _rand(42, (V, B, S, K, HV))
  bias = _rand(43, (1, N, T, S))
  mask = jax.random.bernoulli(jax.random.PRNGKey(44), 0.7, (V, B, 1, T, S))
  lengths = jnp.array([[30, 5], [37, 0], [1, 20]], jnp.int32)
  qseg = jnp.stack([_ids(45 + i, T, 2) for i in range(V)])
  kvseg = jnp.stack([_ids(45 + i, S, 2) for i in range(V)])
  keys = jax.random.split(jax.random.key(46), V)

  def f(q, k, v, bias, mask, lengths, qseg, kvseg, key):
    out, lse = jaxflash.attention(q, k, v, bias, mask, implementation="cpu",
                                  query_seq_lengths=lengths, is_causal=True,
                                  query_segment_ids=qseg, key_value_segment_ids=kvseg,
                                  dropout_rate=0.2, dropout_rng=key, return_residual=True)
    return out, lse

  def g(*args):
    loss = lambda q, k, v, bias: jnp.sum(f(q, k, v, bias, *args[4:])[0] ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(*args[:4])

  axes = (0, 0, 0, None, 0, 0, 0, 0, 0)
  args = (q, k, v, bias, mask, lengths, qseg, kvseg, keys)
  outs = jax.jit(jax.vmap(f, axes))(*args)
  grads = jax.jit(jax.vmap(g, axes))(*args)
  dbias_sum = 0.0
  for i in range(V):
    one = [a if ax is None else a[i] for a, ax in zip(args, axes)]
    for got, want in zip(outs, jax.jit(f)(*one)):
      np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    want_g = jax.jit(g)(*one)
    for got, want in zip(grads, want_g):  # vmap of grad: per-element grads, bias included
      np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    dbias_sum = dbias_sum + want_g[3]
  # grad of vmap: the unbatched bias gets its cotangent summed over the vmapped axis
  loss = lambda bias: jnp.sum(jax.vmap(f, axes)(q, k, v, bias, *args[4:])[0] ** 2)
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(bias), dbias_sum, rtol=1e-4, atol=1e-4)


@on_host
def test_dropout_mask_properties():
  """Reproducible per key, different across keys, and dropping at the requested rate."""
  seeds_a = dropout_seeds(jax.random.key(0), 2)
  seeds_b = dropout_seeds(jax.random.key(1), 2)
  keep_a = dropout_keep(seeds_a, 4, 64, 256, 0.3)
  assert (keep_a == dropout_keep(seeds_a, 4, 64, 256, 0.3)).all()
  assert (keep_a != dropout_keep(seeds_b, 4, 64, 256, 0.3)).mean() > 0.3
  assert (keep_a[0] != keep_a[1]).mean() > 0.3  # batch elements differ
  assert abs(float(keep_a.mean()) - 0.7) < 0.01
  assert abs(float(dropout_keep(seeds_b, 4, 64, 256, 0.05).mean()) - 0.95) < 0.005

  q, k, v = _rand(50, (B, T, N, H)), _rand(51, (B, S, K, H)), _rand(52, (B, S, K, HV))
  run = jax.jit(lambda key: jaxflash.attention(q, k, v, implementation="cpu",
                                               dropout_rate=0.3, dropout_rng=key))
  out0 = run(jax.random.key(3))
  assert (out0 == run(jax.random.key(3))).all()
  assert not jnp.allclose(out0, run(jax.random.key(4)))


@pytest.mark.parametrize("impl", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("case", ["causal", "bias_shared_alibi_segments",
                                  "bias_full_dropout_window"])
def test_deterministic_backward_is_bit_identical(impl, case):
  """deterministic_backward=True: the jitted grad twice gives the same bits. On GPU the inputs
  are large enough (S = 2048 keys in 16 key tiles, 8 heads) that atomics would race."""
  t, s, n, h, dtype = ((1024, 2048, 8, 64, jnp.bfloat16) if impl == "cuda"
                       else (T, S, N, H, jnp.float32))
  q, k, v = (_rand(60, (B, t, n, h), dtype), _rand(61, (B, s, 2, h), dtype),
             _rand(62, (B, s, 2, h), dtype))
  static, diff = {
      "causal": (dict(is_causal=True), {}),
      "bias_shared_alibi_segments": (
          dict(is_causal=True, query_segment_ids=_ids(64, t, 3),
               key_value_segment_ids=_ids(65, s, 3)),
          dict(bias=_rand(63, (1, 1, t, s), dtype), alibi_slopes=jnp.abs(_rand(66, (n,))))),
      "bias_full_dropout_window": (
          dict(local_window_size=(300, 40), dropout_rate=0.1, dropout_rng=jax.random.key(67)),
          dict(bias=_rand(68, (B, n, t, s), dtype))),
  }[case]
  dout = _rand(69, (B, t, n, h))

  def loss(q, k, v, diff):
    out = jaxflash.attention(q, k, v, implementation=impl, deterministic_backward=True,
                             **static, **diff)
    return jnp.sum(out.astype(jnp.float32) * dout)

  with on_device(impl):
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    first = jax.tree.leaves(grad(q, k, v, diff))
    for _ in range(3):
      for a, b in zip(first, jax.tree.leaves(grad(q, k, v, diff))):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.view(np.uint8) == b.view(np.uint8)).all()
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in first)


@on_host
def test_numeric_mask_attends_where_nonzero():
  """As in jax.nn (and Flax's float masks): a numeric mask means mask != 0."""
  mask = jax.random.bernoulli(jax.random.PRNGKey(9), 0.5, (B, 1, T, S))
  q, k, v = _qkv()
  want = jaxflash.attention(q, k, v, mask=mask, implementation="cpu")
  got = jaxflash.attention(q, k, v, mask=mask.astype(jnp.float32) * 3, implementation="cpu")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _qkv():
  return _rand(70, (B, T, N, H)), _rand(71, (B, S, K, H)), _rand(72, (B, S, K, HV))


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias=jnp.ones((B, N, T, 3))), "bias"),
    (dict(bias=jnp.ones((B, N, T, S), jnp.int32)), "bias"),
    (dict(mask=jnp.ones((3, 1, T, S), bool)), "mask"),
    (dict(query_seq_lengths=jnp.ones((B,), jnp.float32)), "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.ones((B + 1,), jnp.int32)), "key_value_seq_lengths"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size"),
    (dict(local_window_size=-1), "local_window_size"),
    (dict(causal_alignment="center"), "causal_alignment"),
    (dict(query_segment_ids=jnp.zeros((B, T), jnp.int32)), "segment_ids"),
    (dict(query_segment_ids=jnp.zeros((B, T)), key_value_segment_ids=jnp.zeros((B, S))),
     "query_segment_ids"),
    (dict(query_segment_ids=jnp.zeros((B, T), jnp.int32),
          key_value_segment_ids=jnp.zeros((B, T), jnp.int32)), "key_value_segment_ids"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(alibi_slopes=jnp.ones((N + 1,))), "alibi_slopes"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), "dropout_rate"),
    (dict(dropout_rate=0.1), "dropout_rng"),
])
@pytest.mark.parametrize("impl", [None, "cpu", "xla"])
def test_invalid_arguments(impl, kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxflash.attention(*_qkv(), implementation=impl, **kwargs)


@pytest.mark.parametrize("kwargs, attr", [
    (dict(bias=jnp.ones((1, 1, T, S))), "('has_bias', True)"),
    (dict(bias=jnp.ones((1, N, T, 1))), "('has_o_f32', True)"),
    (dict(bias=jnp.ones((B, N, T, S))), "('has_o_f32', False)"),
    (dict(alibi_slopes=jnp.ones((N,))), "('has_o_f32', True)"),
    (dict(local_window_size=3), "('window_left', np.int64(3))"),
    (dict(causal_alignment="bottom_right"), "('bottom_right', True)"),
    (dict(logits_soft_cap=2.0), "('softcap', np.float32(2.0))"),
    (dict(dropout_rate=0.25, dropout_rng=jax.random.key(0)), "('dropout_rate', np.float32(0.25))"),
    (dict(deterministic_backward=True), "('deterministic', True)"),
])
@pytest.mark.parametrize("impl", [None, "cuda"])
def test_cuda_routing_of_variants(monkeypatch, impl, kwargs, attr):
  """Where the CUDA kernels would run, implementation='cuda' and None differentiate a variant
  call with the CUDA backward kernel (no reference VJP), handing it the variant."""
  monkeypatch.setattr(attention_mod._ffi, "cuda_built", lambda: True)
  monkeypatch.setattr(attention_mod._ffi, "cuda_head_dims", lambda: (H,))
  monkeypatch.setattr(attention_mod._ffi, "cuda_bwd_head_dims", lambda: (H,))
  monkeypatch.setattr(attention_mod._ffi, "cuda_dtypes", lambda: ("bfloat16",))
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
  v = jnp.concatenate([v, v[..., : H - HV]], axis=-1)  # equal head dims, as CUDA needs
  loss = lambda q: jnp.sum(jaxflash.attention(q, k, v, implementation=impl, **kwargs)
                           .astype(jnp.float32))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(q))  # traced only: no GPU here
  assert "jaxflash_fwd_cuda" in jaxpr
  call = jaxpr.index("target_name=jaxflash_bwd_cuda")
  assert attr in jaxpr[jaxpr.rindex("attributes=", 0, call):call]


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("self_attention", [True, False], ids=["self_causal_window", "cross"])
def test_varlen_matches_per_sequence(impl, self_attention):
  """attention_varlen on packed tokens equals the reference run on each sequence alone;
  tokens past the last sequence give out 0, lse -inf; grads match too."""
  cu_q = np.array([0, 13, 13, 50, 61], np.int32)  # an empty sequence; 4 trailing pad tokens
  cu_k = cu_q if self_attention else np.array([0, 30, 35, 35, 70], np.int32)
  Tq, Tk = 65, 72
  q, k, v = _rand(80, (Tq, N, H)), _rand(81, (Tk, K, H)), _rand(82, (Tk, K, HV))
  dout = _rand(83, (Tq, N, HV))
  kw = dict(is_causal=True, local_window_size=(9, 0)) if self_attention else {}
  cu_k_arg = None if self_attention else jnp.asarray(cu_k)

  def packed(q, k, v):
    out, lse = jaxflash.attention_varlen(q, k, v, jnp.asarray(cu_q), cu_k_arg, 37, 35,
                                         implementation=impl, return_residual=True, **kw)
    return jnp.sum(out * dout), (out, lse)

  def per_sequence(q, k, v):
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
      sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
      o, l = attention_reference(q[None, sq], k[None, sk], v[None, sk], **kw)
      outs.append(o[0])
      lses.append(l[0])
    out = jnp.concatenate(outs + [jnp.zeros((Tq - cu_q[-1], N, HV))])
    lse = jnp.concatenate(lses + [jnp.full((N, Tq - cu_q[-1]), -jnp.inf)], axis=1)
    return jnp.sum(out * dout), (out, lse)

  with on_device(impl):
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(packed, (0, 1, 2), has_aux=True))(
        q, k, v)
  (_, (r_out, r_lse)), r_grads = jax.value_and_grad(per_sequence, (0, 1, 2), has_aux=True)(
      q, k, v)
  assert (lse[:, cu_q[-1]:] == -jnp.inf).all() and (out[cu_q[-1]:] == 0).all()
  for name, got, want in zip(["out", "lse", "dq", "dk", "dv"], (out, lse, *grads),
                             (r_out, r_lse, *r_grads)):
    assert_accurate(name, got, want, want, jnp.float32)


def test_varlen_rejects_positions_for_cross_attention():
  q, k, v = _rand(90, (10, N, H)), _rand(91, (12, K, H)), _rand(92, (12, K, HV))
  with pytest.raises(NotImplementedError, match="is_causal"):
    jaxflash.attention_varlen(q, k, v, jnp.array([0, 10], jnp.int32),
                              jnp.array([0, 12], jnp.int32), is_causal=True)
  with pytest.raises(ValueError, match="cu_seqlens_q"):
    jaxflash.attention_varlen(q, k, v, jnp.array([0.0, 10.0]))
  with pytest.raises(ValueError, match="max_seqlen_q"):
    jaxflash.attention_varlen(q, k, v, jnp.array([0, 10], jnp.int32), max_seqlen_q=11)


@pytest.mark.parametrize("name, bad, match", [
    ("mask", jnp.ones((B, N, T, S + 1), bool), "mask has shape"),
    ("bias", jnp.ones((B, N, T, S), jnp.bfloat16), "bias must have q's dtype"),
    ("query_seq_lengths", jnp.ones((B + 1,), jnp.int32), "q_lengths must be int32"),
    ("alibi_slopes", jnp.ones((B, N), jnp.int32), "alibi_slopes must be float32"),
])
def test_handler_validates_variant_operands(name, bad, match):
  """The CPU target re-validates every live variant operand and returns an error, no crash."""
  from jaxflash import _calls
  q, k, v = _qkv()
  operands, attrs = _calls._variant_inputs(q, {name: bad}, None, False, None, 0.0)
  call = jax.ffi.ffi_call("jaxflash_fwd_cpu", (jax.ShapeDtypeStruct((B, T, N, HV), q.dtype),
                                               jax.ShapeDtypeStruct((B, N, T), jnp.float32)))
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=match):
    jax.block_until_ready(call(q, k, v, *operands, scale=np.float32(0.1), is_causal=False,
                               **attrs))


@pytest.mark.parametrize("impl", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_o_f32_residual(impl, dtype):
  """The forward's fp32 O (keep_f32, params.h o_f32) is O before its rounding, and the backward
  takes delta from it. With a bias broadcast over keys, dbias = sum_b dlse exactly (a constant
  added to a row of logits leaves the softmax unchanged), so dbias's error is delta's: with
  out_f32 on CPU (fp32 P) only dbias's own rounding is left; with the stored out it is worse."""
  t, s, h = (200, 333, 64) if impl == "cuda" else (64, 128, 32)
  q, k, v = (_rand(100, (B, t, N, h), dtype), _rand(101, (B, s, K, h), dtype),
             _rand(102, (B, s, K, h), dtype))
  bias = _rand(103, (1, N, t, 1), dtype)
  dout, dlse = _rand(104, (B, t, N, h), dtype), _rand(105, (B, N, t))
  kw = dict(scale=h ** -0.5, is_causal=True, platform=impl)
  fwd = jax.jit(lambda variants, keep: attention_mod._calls.fwd(q, k, v, variants,
                                                                keep_f32=keep, **kw),
                static_argnums=1)
  # deterministic: bit-comparable gradients on the GPU too
  bwd = jax.jit(lambda out, lse, out_f32: attention_mod._calls.bwd(
      q, k, v, out, lse, dout, dlse, {"bias": bias}, deterministic=True, out_f32=out_f32, **kw))
  with on_device(impl):
    out, lse, out_f32 = fwd({"bias": bias}, True)
    plain_out, _ = fwd({"bias": bias}, False)
    # no variant: on the GPU the sm80 variant kernel runs it (the sm90 one keeps no fp32 O)
    no_variant = fwd(None, True)
    dbias_f32, dbias_stored, dbias_rounded = (
        np.asarray(bwd(out, lse, o)[3], np.float32)
        for o in (out_f32, None, out.astype(jnp.float32)))
  assert (no_variant[2].astype(dtype) == no_variant[0]).all()
  assert out_f32.dtype == jnp.float32 and out_f32.shape == out.shape
  assert (out_f32.astype(dtype) == out).all()
  assert (out_f32 != out.astype(jnp.float32)).any()  # more bits than out
  # On the GPU a forward keeping out_f32 runs P V on P split in two (P_hi + P_lo): its out is
  # at least as close to the float32 reference as the plain forward's.
  ref_out, _ = attention_reference(*_cast((q, k, v), jnp.float32), bias=bias,
                                   is_causal=True, scale=h ** -0.5)
  ref_out = np.asarray(ref_out)
  err_keep, err_plain = (np.abs(np.asarray(o, np.float32) - ref_out).max()
                         for o in (out_f32, plain_out))
  assert err_keep <= err_plain, (err_keep, err_plain)
  np.testing.assert_array_equal(dbias_rounded, dbias_stored)  # delta reads the operand
  want = np.asarray(dlse.sum(0))[None, :, :, None]
  err_f32, err_stored = (np.abs(d - want).max() for d in (dbias_f32, dbias_stored))
  assert err_f32 < err_stored, (err_f32, err_stored)
  if impl == "cpu":
    np.testing.assert_allclose(dbias_f32, want, rtol=float(jnp.finfo(dtype).eps), atol=1e-5)


@pytest.mark.parametrize("kwargs, keep", [(dict(bias=_rand(106, (1, N, T, 1))), True),
                                          (dict(alibi_slopes=jnp.abs(_rand(107, (N,)))), True),
                                          (dict(bias=_rand(108, (B, N, T, S))), False),
                                          (dict(mask=jnp.ones((T, S), bool)), False)],
                         ids=["bias_rows", "alibi", "bias_full", "mask"])
def test_o_f32_kept_only_for_bias_or_alibi(kwargs, keep):
  """The differentiated CPU forward returns out_f32 and the backward takes it (has_o_f32) with
  a broadcast bias or alibi_slopes, and only then (a full bias's dbias is dZ itself)."""
  q, k, v = _qkv()
  loss = lambda q: jnp.sum(jaxflash.attention(q, k, v, implementation="cpu", **kwargs))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(q))
  for target in ("jaxflash_fwd_cpu", "jaxflash_bwd_cpu"):
    call = jaxpr.index(f"target_name={target}")
    attrs = jaxpr[jaxpr.rindex("attributes=", 0, call):call]
    assert f"('has_o_f32', {keep})" in attrs, attrs
  call = jaxpr.index("target_name=jaxflash_fwd_cpu")
  results = jaxpr[jaxpr.rindex("result_avals=", 0, call):call]
  assert results.count("ShapedArray") == (3 if keep else 2), results  # out, lse[, out_f32]


@pytest.mark.parametrize("direction, has_o_f32, o_f32, match", [
    ("fwd", True, None, "one result after o and lse"),
    ("fwd", False, jnp.float32, "no result after o and lse"),
    ("fwd", True, jnp.bfloat16, "o_f32 must be float32"),
    ("bwd", True, None, "o_f32 must be float32 with o's shape"),
    ("bwd", False, jnp.float32, "o_f32 is marked absent"),
])
def test_handler_validates_o_f32(direction, has_o_f32, o_f32, match):
  """The CPU targets check the fp32 O result/operand against has_o_f32 and o's shape."""
  from jaxflash import _calls
  q, k, v = _qkv()
  operands, attrs = _calls._variant_inputs(q, None, None, False, None, 0.0)
  attrs["has_o_f32"] = has_o_f32
  out_type = jax.ShapeDtypeStruct((B, T, N, HV), q.dtype)
  lse_type = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  base = dict(scale=np.float32(0.1), is_causal=False, **attrs)
  if direction == "fwd":
    extra = () if o_f32 is None else (jax.ShapeDtypeStruct((B, T, N, HV), o_f32),)
    run = lambda: jax.ffi.ffi_call("jaxflash_fwd_cpu", (out_type, lse_type) + extra)(
        q, k, v, *operands, **base)
  else:
    out, lse = jnp.zeros(out_type.shape, q.dtype), jnp.zeros(lse_type.shape)
    placeholder = jnp.zeros((0,) if o_f32 is None else out_type.shape, jnp.float32)
    grads = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    dead = (jax.ShapeDtypeStruct((0,), q.dtype), jax.ShapeDtypeStruct((0,), jnp.float32))
    run = lambda: jax.ffi.ffi_call("jaxflash_bwd_cpu", grads + dead)(
        q, k, v, out, lse, out, lse, placeholder, *operands, **base)
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=match):
    jax.block_until_ready(run())
