// Entry points of the CUDA kernels. One explicit instantiation per (direction, head dim,
// dtype) lives in instantiations/, each file covering both causal values.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "../params.h"

namespace jaxflash::cuda {

// The user-facing name of the first live variant of p (jaxflash.attention's argument), or
// nullptr when p asks for plain (optionally causal) attention.
inline const char* live_variant(const FwdParams& p) {
  if (p.bias) return "bias";
  if (p.mask) return "mask";
  if (p.q_lengths) return "query_seq_lengths";
  if (p.kv_lengths) return "key_value_seq_lengths";
  if (p.q_segment_ids) return "query_segment_ids";
  if (p.alibi_slopes) return "alibi_slopes";
  if (p.dropout_seeds) return "dropout_rate";
  if (p.window_left >= 0 || p.window_right >= 0) return "local_window_size";
  if (p.bottom_right) return "causal_alignment";
  if (p.softcap > 0.f) return "logits_soft_cap";
  return nullptr;
}

// The current device's SM count (a persistent grid's size), cached per device; 132 when the
// runtime cannot say (an H100 SXM).
inline int sm_count() {
  static std::atomic<int> cached[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  int n = cached[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
      n = 132;
    cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The mask's tile summary (FwdParams::mask_tiles), written by summarize_mask before the
// variant kernels run (the forward and backward handlers each write their own): one byte per
// kMaskTile x kMaskTile tile of the mask as the user stored it, kMaskVisible if some element of
// the tile is true, | kMaskHidden if some is false, so that the bytes of several tiles combine
// by OR. The kernels skip the key tiles with no visible element and test the mask per element
// only in tiles with a hidden one. A broadcast dim keeps one tile, as the mask keeps one
// element: a (1, 1, T, S) mask has one summary for every batch and head. Layout (outer, B|1,
// N|1, T tiles|1, S tiles|1), as the mask's.
constexpr int kMaskTile = 64;
constexpr uint8_t kMaskVisible = 1, kMaskHidden = 2;

struct MaskTiles {
  int64_t batches, heads, rows, cols;  // extents of the B|1, N|1, T tiles|1, S tiles|1 dims

  __host__ __device__ explicit MaskTiles(const FwdParams& p) {
    const BcastStrides& st = p.mask_strides;
    batches = st.batch ? p.batch_inner : 1;
    heads = st.head ? p.n : 1;
    rows = st.row ? (p.t + kMaskTile - 1) / kMaskTile : 1;
    cols = st.col ? (p.s + kMaskTile - 1) / kMaskTile : 1;
  }
  // Bytes of the summary of p's mask (0 without one): T * S / 4096 per stored (b, n) at most.
  __host__ __device__ static int64_t bytes(const FwdParams& p) {
    if (!p.mask || p.t == 0 || p.s == 0) return 0;  // an empty mask has no tile
    const MaskTiles mt(p);
    return p.b / p.batch_inner * mt.batches * mt.heads * mt.rows * mt.cols;
  }
  // Offset of the summary of flattened batch b, head n (its row tile 0, key tile 0).
  __host__ __device__ int64_t slab(const FwdParams& p, int64_t b, int64_t n) const {
    const int64_t bi = batches > 1 ? b % p.batch_inner : 0;
    return ((b / p.batch_inner * batches + bi) * heads + (heads > 1 ? n : 0)) * rows * cols;
  }
  // OR of the summary bytes at `slab` (p.mask_tiles + slab(p, b, n)) over the tiles that hold
  // mask rows [r0, r1) and keys [c0, c1), both non-empty and inside (T, S).
  __device__ int bits(const uint8_t* slab, int r0, int r1, int c0, int c1) const {
    int out = 0;
    for (int i = r0 / kMaskTile; i <= (r1 - 1) / kMaskTile; ++i)
      for (int j = c0 / kMaskTile; j <= (c1 - 1) / kMaskTile; ++j)
        out |= slab[(rows > 1 ? i : 0) * cols + (cols > 1 ? j : 0)];
    return out;
  }
};

// Writes the summary of p.mask to `tiles` (MaskTiles::bytes(p) bytes of device memory), which
// the caller then passes to the kernels as p.mask_tiles.
void summarize_mask(const FwdParams& p, uint8_t* tiles, cudaStream_t stream);

// T is __half or __nv_bfloat16; kHeadDim is H and kHeadDimV >= Hv (dispatch_fwd_head_dims
// says which pair runs which (H, Hv)). Every variant of p is supported, and p.o_f32 (which
// the sm90 forward does not write).
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_fwd(const FwdParams& p, cudaStream_t stream);

// Tiles of the CUDA backward (flash_bwd.cuh Tiles) by head dim H: the width of its Q, K
// tiles (H rounded up to a multiple of 64: 32 runs on 64 columns and 96 on 128, zero-padded),
// keys per CTA and queries per step.
constexpr int bwd_width(int64_t head_dim) { return static_cast<int>((head_dim + 63) / 64 * 64); }
constexpr int bwd_block_n(int64_t head_dim) { return bwd_width(head_dim) <= 128 ? 128 : 64; }
constexpr int bwd_block_m(int64_t head_dim) { return bwd_width(head_dim) == 64 ? 128 : 64; }
// Query rows padded to whole tiles of every head dim's sm90 backward (BwdParams::t_pad).
constexpr int64_t bwd_t_pad(int64_t t) { return (t + 127) / 128 * 128; }
// Dynamic shared memory of the backward's main kernel: K, V, 2 x Q, 2 x dO, P, dS (16-bit),
// 2 x lse, 2 x delta (fp32).
constexpr int bwd_smem_bytes(int64_t head_dim) {
  const int d = bwd_width(head_dim), n = bwd_block_n(head_dim), m = bwd_block_m(head_dim);
  return (2 * n * d + 4 * m * d + 2 * m * n) * 2 + 4 * m * 4;
}

// True when every (b, n, t, s) owns its own bias element (no broadcast dim): the backward then
// writes each dbias element once, with no workspace.
inline bool dbias_direct(const FwdParams& p) {
  const BcastStrides& st = p.bias_strides;
  return (st.batch != 0 || p.batch_inner == 1) && (st.head != 0 || p.n == 1) &&
         (st.row != 0 || p.t == 1) && (st.col != 0 || p.s == 1);
}

// Elements of the bias (and of dbias): q's leading dims, then (B|1, N|1, T|1, S|1).
inline int64_t bias_elements(const FwdParams& p) { return p.bias_strides.outer * (p.b / p.batch_inner); }

// dQ tickets (BwdParams::dq_ticket): one per 64 query rows of each head, the smallest sm90
// backward query tile, so that every head dim's tiles have one.
__host__ __device__ inline int64_t dq_tickets(const BwdParams& p) {
  return p.b * p.n * ((p.t + 63) / 64);
}

// Element counts of the workspaces a backward call needs beyond delta and dq_accum (0: none).
struct BwdWorkspace {
  int64_t dbias_accum = 0, dalibi_accum = 0, dq_turn = 0, kv_seg_range = 0, dq_ticket = 0;
  int64_t prep_done = 0;
};

inline BwdWorkspace bwd_workspace(const BwdParams& p) {
  BwdWorkspace w;
  const int64_t block_n = bwd_block_n(p.h);
  const int64_t key_tiles = (p.s + block_n - 1) / block_n;
  const int64_t block_m = bwd_block_m(p.h);
  // (deterministic: flash_bwd.cuh dbias_kernel sums a broadcast bias's dbias with no atomics)
  if (p.bias && !dbias_direct(p) && !p.deterministic) w.dbias_accum = bias_elements(p);
  if (p.alibi_slopes) w.dalibi_accum = p.b * p.n * key_tiles;
  w.dq_ticket = dq_tickets(p);
  w.prep_done = 3 * p.b * p.kh;  // the pass's counts, then DqSlots::done (2 a group at most)
  if (p.deterministic) {
    w.dq_turn = p.b * p.n * ((p.t + block_m - 1) / block_m);
    if (p.q_segment_ids) w.kv_seg_range = p.b * key_tiles * 2;
  }
  return w;
}

// p.delta and p.lse_log2 (B, N, bwd_t_pad(T)) and p.dq_accum (B, T, N, bwd_width(H)) must
// point at fp32 device workspace, and the fields of bwd_workspace(p) at workspaces of those
// sizes. (kHeadDim, kHeadDimV) is (H, Hv) exactly (dispatch_bwd_head_dims). Every variant is
// supported.
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace jaxflash::cuda
