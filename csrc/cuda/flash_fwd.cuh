// FlashAttention-2 forward on sm80+ (mma.sync m16n8k16, ldmatrix, cp.async).
//
// One CTA owns a (kBlockM, H) tile of queries of one (batch b, head n) and streams the
// (kBlockN, H) tiles of K and V of kv head n / group through shared memory, double
// buffered: tile j + 1 is in flight while tile j is computed. Each warp owns kBlockM / kWarps
// query rows and keeps, per row, the running max m (of log2-scaled logits), the running sum
// l and the fp32 O accumulator in registers (the online softmax). The P tile never leaves
// registers: the m16n8 accumulator of two adjacent key n8 tiles is exactly the m16k16 A
// fragment of P.V.
//
// Shared tiles are row-major and swizzled (SmemTile) so that ldmatrix, the cp.async writes and
// the O staging are free of bank conflicts.
//
// Variants (lengths, window, alignment, segment ids, mask, bias, soft cap, ALiBi, dropout;
// semantics in jaxflash/reference.py) live in a second instantiation, kVariants, chosen at
// launch when any is live, so the plain kernel keeps its registers and instruction stream.
// A dense mask comes with its tile summary (launch.h MaskTiles): key tiles it hides are
// skipped like those outside the key range, and all-true ones are not tested per element.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../params.h"
#include "launch.h"
#include "mma.cuh"

namespace jaxflash::cuda {

// Head dims: one kernel per (kHeadDim, kHeadDimV) = (H, Hv) pair compiled (csrc/cuda/dispatch.h
// lists them: 32, 64, 96, 128, 192, 256 with Hv == H, and the MLA shape 192/128), each with its
// own tile shape, so no head dim pays mma work for padding. A kernel also runs any smaller
// Hv (p.hv, a multiple of 8): V's 16-byte chunks past Hv are zero-filled on load and O's are
// never stored. Head dims that are not multiples of 64 (32, 96) keep rows of the next multiple
// of 64 in shared memory, so the swizzle stays one XOR per group of 8 chunks.
//
// Tile shapes for the 4-warp FA2 forward. 4 warps of 32 query rows, not 8 of 16: each warp
// reads the whole K/V tile by ldmatrix, and with 8 warps those reads outrun the mma.sync
// throughput. Key tiles are the widest with no register spill at 255 registers/thread
// (ptxas -v): one key width wider spills ~100 bytes/thread of loop state.
template <int kHeadDim, int kHeadDimV, bool kVariants>
struct FwdTile;

// d32: O is 32 fp32 registers/thread and S (64 keys) 64; 48 KB of shared memory (rows of 64).
template <>
struct FwdTile<32, 32, false> {
  static constexpr int kBlockM = 128, kBlockN = 64, kWarps = 4;
};

// d64: O is 64 fp32 registers/thread and S (64 keys) another 64; 48 KB of shared memory.
template <>
struct FwdTile<64, 64, false> {
  static constexpr int kBlockM = 128, kBlockN = 64, kWarps = 4;
};

// d96: O is 96 registers, so S gets 32 keys (64 spill 56 bytes/thread); 64 KB of shared
// memory (rows of 128).
template <>
struct FwdTile<96, 96, false> {
  static constexpr int kBlockM = 128, kBlockN = 32, kWarps = 4;
};

// d128: O alone is 128 fp32 registers/thread, so S gets 32 keys (32 registers), as FA2 does
// on sm86/89; 64 KB of shared memory. Registers cap residency at 2 CTAs (8 warps) per SM.
template <>
struct FwdTile<128, 128, false> {
  static constexpr int kBlockM = 128, kBlockN = 32, kWarps = 4;
};

// MLA 192/128: the d128 tile spills 24 bytes/thread (q.k is wider), so warps own 16 rows (O:
// 64 registers) and S gets 64 keys; 104 KB of shared memory.
template <>
struct FwdTile<192, 128, false> {
  static constexpr int kBlockM = 64, kBlockN = 64, kWarps = 4;
};

// d192 and d256: a warp of 32 rows would need 192 / 256 registers for O alone, so warps own
// 16 rows (O: 96 / 128 registers) and S gets 32 keys; 72 / 96 KB of shared memory.
template <>
struct FwdTile<192, 192, false> {
  static constexpr int kBlockM = 64, kBlockN = 32, kWarps = 4;
};

template <>
struct FwdTile<256, 256, false> {
  static constexpr int kBlockM = 64, kBlockN = 32, kWarps = 4;
};

// With variants, the per-element rules (bias/mask addresses, segment ids, hashes) need
// registers the tiles above do not leave: at kBlockM 128 d64 and d128 spill 70-120
// bytes/thread. 4 warps of 16 rows halve O (d128: 64 registers), so S gets 64 keys (ptxas:
// 210 / 250 registers, no spill) up to Hv 128, and fewer past it, where O grows.
template <int kHeadDim, int kHeadDimV>
struct FwdTile<kHeadDim, kHeadDimV, true> {
  static constexpr int kBlockM = 64, kWarps = 4;
  static constexpr int kBlockN = kHeadDimV <= 128 ? 64 : kHeadDimV <= 192 ? 32 : 16;
};

// A shared (rows, kCols) tile, row-major with a row stride of kStride >= kCols elements (kCols
// rounded up to 64: the columns past kCols are never written nor read), and how kThreads
// threads fill it by cp.async. The 16-byte chunk index is XORed with row % 8 inside each group
// of 8 chunks (128 bytes), so that the 8 row addresses of one ldmatrix matrix (same column, 8
// consecutive rows) fall into 8 different bank groups, and so are the cp.async writes and the
// O staging.
template <typename T, int kCols, int kThreads>
struct SmemTile {
  static constexpr int kStride = (kCols + 63) / 64 * 64;
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  // kThreadsPerRow threads copy a row, each kChunksPerThread chunks kThreadsPerRow apart, and
  // a pass of the CTA copies kRowsPerPass whole rows.
  static constexpr int kThreadsPerRow = kChunks % 16 == 0 ? 16 : kChunks % 8 == 0 ? 8 : 4;
  static constexpr int kChunksPerThread = kChunks / kThreadsPerRow;
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(kCols % 32 == 0, "whole k16 mma steps and 4-chunk row copies");
  static_assert(kRowsPerPass % 8 == 0, "passes keep row % 8, hence the swizzle, fixed");

  // Element offset of (row, col).
  __device__ static __forceinline__ int swz(int row, int col) {
    const int chunk = col >> 3;
    return row * kStride + (((chunk ^ row) & 7) | (chunk & ~7)) * 8 + (col & 7);
  }

  // This thread's first source element of a tile whose row 0 is global row row0.
  __device__ static __forceinline__ const T* thread_src(const T* gX, int64_t row_stride,
                                                        int row0, int tid) {
    return gX + (row0 + tid / kThreadsPerRow) * row_stride + tid % kThreadsPerRow * 8;
  }

  // cp.async a (kRows, kCols) tile into sX; src = thread_src(...) of the tile. Rows at or past
  // rows_left (counted from this thread's first row) and chunks at or past `chunks` (Hv / 8 of
  // a V tile wider than Hv) are zero-filled, and their source address is never dereferenced.
  template <int kRows>
  __device__ static __forceinline__ void load_tile(T* sX, const T* src, int64_t row_stride,
                                                   int rows_left, int chunks, int tid) {
    static_assert(kRows % kRowsPerPass == 0, "whole passes");
    const int row0 = tid / kThreadsPerRow, chunk0 = tid % kThreadsPerRow;
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int chunk = chunk0 + j * kThreadsPerRow;
      const uint32_t dst = smem_addr(sX + swz(row0, chunk * 8));
#pragma unroll
      for (int it = 0; it < kRows / kRowsPerPass; ++it)
        cp_async_16(dst + it * kRowsPerPass * kStride * sizeof(T),
                    src + it * kRowsPerPass * row_stride + j * kThreadsPerRow * 8,
                    it * kRowsPerPass < rows_left && chunk < chunks);
    }
  }
};

template <typename T, int kHeadDim, int kHeadDimV, bool kVariants = false>
struct FwdCfg {
  static constexpr int kBlockM = FwdTile<kHeadDim, kHeadDimV, kVariants>::kBlockM;
  static constexpr int kBlockN = FwdTile<kHeadDim, kHeadDimV, kVariants>::kBlockN;
  static constexpr int kWarps = FwdTile<kHeadDim, kHeadDimV, kVariants>::kWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
  static constexpr int kMTiles = kWarpRows / 16;      // m16 tiles per warp
  using TileQK = SmemTile<T, kHeadDim, kThreads>;     // sQ, sK
  using TileVO = SmemTile<T, kHeadDimV, kThreads>;    // sV, and O staged in sQ
  static constexpr int kTileQ = kBlockM * TileQK::kStride;   // elements of sQ
  static constexpr int kTileK = kBlockN * TileQK::kStride;   // elements of one sK stage
  static constexpr int kTileV = kBlockN * TileVO::kStride;   // elements of one sV stage
  // sQ + 2 stages of sK and sV, plus slack to align them to 128 bytes (step16 needs it)
  static constexpr int kSmemBytes =
      (kTileQ + 2 * kTileK + 2 * kTileV) * static_cast<int>(sizeof(T)) + 128;

  static_assert(kWarpRows % 16 == 0 && kBlockN % 16 == 0, "whole m16 / k16 mma tiles");
  static_assert(kHeadDimV <= kHeadDim, "O is staged in sQ");

  // Shared address of a fragment row 16 * kk columns to the right of addr0, whose column is
  // 0 or 8 in a swizzled tile with a 128-byte aligned base: the chunk index moves by 2 kk,
  // which inside a group of 8 chunks (128 bytes) is an XOR with (2 kk) % 8, commuting with
  // the row's XOR; a whole group further is a plain add.
  __device__ static __forceinline__ uint32_t step16(uint32_t addr0, int kk) {
    return (addr0 ^ ((kk % 4) * 32)) + (kk / 4) * 128;
  }
};

// The dropout hash: the 32-bit finaliser of jaxflash/reference.py `_mix` (and the CPU kernel).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0xd35a2d97u;
  return x ^ (x >> 15);
}

// The first i in [i0, end) for which live(i) holds, else end, 32 candidates per warp-wide
// step (every lane calls it with the same i0 and end): a long run of tiles that a mask hides
// costs one summary byte per lane, not a dependent load per tile.
template <typename Live>
__device__ __forceinline__ int first_live(int i0, int end, int lane, Live&& live) {
  for (int i = i0; i < end; i += 32) {
    const unsigned hits = __ballot_sync(0xffffffffu, i + lane < end && live(i + lane));
    if (hits) return i + __ffs(static_cast<int>(hits)) - 1;
  }
  return end;
}

struct NoCapHook {
  __device__ void operator()(int, int, int, float) const {}
};

// The variant rules as one CTA sees them: batch b, head n, query rows [m0, m0 + kBlockM).
// Per element they are the CPU kernel's Head, in tile-relative coordinates: for tile row r
// and column c of the key tile at n0, s - (t + shift) = (c - r) - diag with
// diag = m0 - n0 + shift. It lives in shared memory, written once by warp 0: the d128
// kernel has no registers to spare for ~20 words of state used once per key tile.
template <typename T, int kBlockM, int kBlockN>
struct FwdVariants {
  int m0;
  int q_rows;              // tile rows r < q_rows are valid queries (t < q_len)
  int kv_len;              // keys s < kv_len are valid
  int64_t shift;           // key position of query 0 (causal alignment)
  int key_lo, key_hi;      // keys [key_lo, key_hi) that some row of the tile may see
  float slope;             // ALiBi slope of (b, n)
  float keep_scale;        // 1 / (1 - dropout_rate)
  uint32_t drop_head;      // dropout hash of (seeds[b], n)
  int q_seg_min, q_seg_max;          // segment id range of the tile's valid rows
  const int32_t* q_seg;              // segment ids at (b, m0)
  const int32_t* kv_seg;             // (S) segment ids of batch b
  const T* bias;                     // bias at (b, n, m0, 0); rows/cols via bias_strides
  const uint8_t* mask;               // mask at (b, n, m0, 0); rows/cols via mask_strides
  const uint8_t* mask_slab;          // the mask's tile summary of (b, n) (MaskTiles); null
                                     // without one, and once settle_mask has used it

  // Run by one whole warp (the segment id reduction is warp-wide).
  __device__ void init(const FwdParams& p, int64_t b, int64_t n, int m0_, int lane) {
    m0 = m0_;
    const int64_t q_raw = p.q_lengths ? p.q_lengths[b] : p.t;
    const int64_t kv_raw = p.kv_lengths ? p.kv_lengths[b] : p.s;
    const int q_len = static_cast<int>(max(int64_t{0}, min(q_raw, p.t)));
    kv_len = static_cast<int>(max(int64_t{0}, min(kv_raw, p.s)));
    q_rows = q_len - m0;
    shift = p.bottom_right ? kv_raw - q_raw : 0;
    // Keys [lo, hi) visible to some row through lengths, causal and window (CPU key_range).
    const int64_t wl = min(p.window_left, int64_t{1} << 31);  // keeps the sums in int64
    const int64_t wr = min(p.window_right, int64_t{1} << 31);
    const int64_t last = int64_t{min(m0 + kBlockM, q_len)} - 1;
    int64_t lo = 0, hi = last < m0 ? 0 : kv_len;
    if (p.is_causal) hi = min(hi, last + shift + 1);
    if (wr >= 0) hi = min(hi, last + shift + wr + 1);
    if (wl >= 0) lo = max(lo, m0 + shift - wl);
    key_lo = static_cast<int>(min(lo, int64_t{kv_len}));
    key_hi = static_cast<int>(max(hi, int64_t{key_lo}));

    bias = nullptr;
    mask = mask_slab = nullptr;
    if (p.bias) {
      const BcastStrides& st = p.bias_strides;
      bias = static_cast<const T*>(p.bias) + st.batch_at(b, p.batch_inner) + n * st.head +
             m0 * st.row;
    }
    if (p.mask) {
      const BcastStrides& st = p.mask_strides;
      mask = p.mask + st.batch_at(b, p.batch_inner) + n * st.head + m0 * st.row;
      if (p.mask_tiles) mask_slab = p.mask_tiles + MaskTiles(p).slab(p, b, n);
    }
    q_seg = kv_seg = nullptr;
    slope = 0.f;
    keep_scale = 1.f;
    drop_head = 0;
    if (p.alibi_slopes) slope = p.alibi_slopes[b * p.n + n];
    if (p.dropout_seeds) {
      const uint32_t* seed = p.dropout_seeds + 2 * b;
      drop_head = mix32(static_cast<uint32_t>(n) ^ mix32(seed[0] ^ mix32(seed[1])));
      keep_scale = 1.f / (1.f - p.dropout_rate);
    }
    if (p.q_segment_ids) {
      q_seg = p.q_segment_ids + b * p.t + m0;
      kv_seg = p.kv_segment_ids + b * p.s;
      int lo_id = INT_MAX, hi_id = INT_MIN;
      for (int r = lane; r < min(q_rows, kBlockM); r += 32) {
        lo_id = min(lo_id, q_seg[r]);
        hi_id = max(hi_id, q_seg[r]);
      }
      q_seg_min = __reduce_min_sync(0xffffffffu, lo_id);
      q_seg_max = __reduce_max_sync(0xffffffffu, hi_id);
    }
  }

  // The first of the key tiles at n0, n0 + kBlockN, ... below key_hi that a query of the tile
  // may see: the mask has a true element there (its tile summary) and the keys' segment ids
  // can meet the queries' (disjoint id ranges share no id); else key_hi or past it. Every
  // warp computes the same answer from the same bytes and ids: the CTA stays uniform with no
  // barrier.
  __device__ int next_live(const FwdParams& p, int n0, int lane) const {
    if (!kv_seg && !mask_slab) return n0;
    for (; n0 < key_hi; n0 += kBlockN) {
      if (mask_slab) {
        const int r1 = m0 + min(kBlockM, q_rows), tiles = (key_hi - n0 + kBlockN - 1) / kBlockN;
        const int skip = first_live(0, tiles, lane, [&](int i) {
          const int c0 = n0 + i * kBlockN;
          return (MaskTiles(p).bits(mask_slab, m0, r1, c0, min(c0 + kBlockN, key_hi)) &
                  kMaskVisible) != 0;
        });
        n0 += skip * kBlockN;
        if (n0 >= key_hi) break;
      }
      if (!kv_seg) break;
      int lo_id = INT_MAX, hi_id = INT_MIN;
#pragma unroll
      for (int i = lane; i < kBlockN; i += 32)
        if (n0 + i < key_hi) {
          lo_id = min(lo_id, kv_seg[n0 + i]);
          hi_id = max(hi_id, kv_seg[n0 + i]);
        }
      lo_id = __reduce_min_sync(0xffffffffu, lo_id);
      hi_id = __reduce_max_sync(0xffffffffu, hi_id);
      if (hi_id >= q_seg_min && lo_id <= q_seg_max) break;
    }
    return n0;
  }

  // This thread's S fragment (kMTiles, kNTilesS, 4) of the key tile at n0: raw q.k in, logits
  // in log2 units out, -inf where the key is invisible. Element c of tile (mi, nt) is row
  // warp_row + 16 mi + g + 8 (c / 2), column 8 nt + 2 tig + c % 2. Each variant is a pass of
  // its own under one uniform test, and the visibility tests run only where this warp's block
  // is not seen whole: per element the code then holds just the live variants' arithmetic.
  // Bias and mask are read in place, only inside the lengths (never past T or S). The
  // backward passes on_cap(mi, nt, c, 1 - tanh^2), the soft cap's derivative at element c of
  // tile (mi, nt).
  template <int kMTiles, int kNTilesS, typename OnCap = NoCapHook>
  __device__ void logits(const FwdParams& p, float (&acc_s)[kMTiles][kNTilesS][4], int n0,
                         int warp_row, int g, int tig, OnCap on_cap = {}) const {
    // This struct is in shared memory, and on_cap stores there: its fields are read once.
    const int rows = q_rows, kv_lim = kv_len - n0;  // tile rows r < rows, columns c < kv_lim
    const T* const bias_p = bias;
    const uint8_t* const mask_p = mask;
    const int32_t* const q_seg_p = q_seg;
    const int32_t* const kv_seg_p = kv_seg;
    const float slope_v = slope;
    const int64_t diag64 = int64_t{m0} - n0 + shift;
    const int diag = clamp_diag(diag64);  // for ALiBi; exact for any real lengths
    auto for_each = [&](auto&& f) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            f(mi, nt, c, warp_row + 16 * mi + g + 8 * (c / 2), 8 * nt + 2 * tig + c % 2);
    };
    // This warp's block: rows warp_row .. + 16 kMTiles - 1, columns 0 .. 8 kNTilesS - 1.
    const bool inside = warp_row + 16 * kMTiles <= rows && 8 * kNTilesS <= kv_lim;

    if (p.softcap > 0.f) {
      const float in = p.scale / p.softcap, cap = p.softcap;
      for_each([&](int mi, int nt, int c, int, int) {
        const float th = tanhf(acc_s[mi][nt][c] * in);
        on_cap(mi, nt, c, 1.f - th * th);
        acc_s[mi][nt][c] = cap * th;
      });
    } else {
      const float scale = p.scale;
      for_each([&](int mi, int nt, int c, int, int) { acc_s[mi][nt][c] *= scale; });
    }
    if (bias_p) {
      const int64_t rs = p.bias_strides.row, cs = p.bias_strides.col;
      // Keys contiguous and rows 4-byte aligned from the tile's first key (with a window the
      // tiles start at key_lo, which may be odd): an element pair's two keys in one load.
      if (inside && cs == 1 && rs % 2 == 0 &&
          (reinterpret_cast<uintptr_t>(bias_p + n0) & 3) == 0) {
        for_each([&](int mi, int nt, int c, int row, int col) {
          if (c % 2) return;
          const T* at = bias_p + row * rs + n0 + col;
          const float2 b = unpack2<T>(*reinterpret_cast<const uint32_t*>(at));
          acc_s[mi][nt][c] += b.x;
          acc_s[mi][nt][c + 1] += b.y;
        });
      } else {
        for_each([&](int mi, int nt, int c, int row, int col) {
          if (inside || (row < rows && col < kv_lim))
            acc_s[mi][nt][c] += static_cast<float>(bias_p[row * rs + (n0 + col) * cs]);
        });
      }
    }
    if (p.alibi_slopes)
      for_each([&](int mi, int nt, int c, int row, int col) {
        acc_s[mi][nt][c] -= slope_v * fabsf(static_cast<float>(col - row - diag));
      });

    // Visible: row < rows, col < kv_lim, lo_d <= col - row <= hi_d, the segment ids equal,
    // the mask true. Tested per element only where some element of the block may fail.
    int hi_d = 1 << 20, lo_d = -(1 << 20);
    if (p.is_causal) hi_d = clamp_diag(diag64);
    if (p.window_right >= 0)
      hi_d = min(hi_d, clamp_diag(diag64 + min(p.window_right, int64_t{1} << 31)));
    if (p.window_left >= 0) lo_d = clamp_diag(diag64 - min(p.window_left, int64_t{1} << 31));
    // The mask is read per element only where the summary has a false element in this block
    // of rows and keys (a block with no valid row or key shows nothing whatever it reads).
    const uint8_t* mask_el = mask_p;
    if (mask_slab) {
      const int r1 = min(warp_row + kMTiles * 16, rows), c1 = min(kNTilesS * 8, kv_lim);
      if (r1 <= warp_row || c1 <= 0 ||
          !(MaskTiles(p).bits(mask_slab, m0 + warp_row, m0 + r1, n0, n0 + c1) & kMaskHidden))
        mask_el = nullptr;
    }
    const int d_min = -(warp_row + 16 * kMTiles - 1), d_max = 8 * kNTilesS - 1 - warp_row;
    const bool test = !inside || d_min < lo_d || d_max > hi_d || kv_seg_p || mask_el;
    constexpr float kLog2e = 1.4426950408889634f;
    if (!test) {
      for_each([&](int mi, int nt, int c, int, int) { acc_s[mi][nt][c] *= kLog2e; });
      return;
    }
    const int64_t mrs = p.mask_strides.row, mcs = p.mask_strides.col;
    for_each([&](int mi, int nt, int c, int row, int col) {
      bool vis = row < rows && col < kv_lim && col - row >= lo_d && col - row <= hi_d;
      if (kv_seg_p) vis = vis && kv_seg_p[n0 + col] == q_seg_p[row];
      if (mask_el) vis = vis && mask_el[row * mrs + (n0 + col) * mcs] != 0;
      acc_s[mi][nt][c] = vis ? acc_s[mi][nt][c] * kLog2e : -INFINITY;
    });
  }

  // For a CTA that keeps one key tile, [n0, n1) (the backward's): whether its rows test the mask
  // per element is settled here, once for the whole tile, not per warp in logits.
  __device__ void settle_mask(const FwdParams& p, int n0, int n1) {
    if (!mask_slab) return;
    const int r1 = m0 + min(kBlockM, q_rows), c1 = min(n1, kv_len);
    if (r1 <= m0 || c1 <= n0 || !(MaskTiles(p).bits(mask_slab, m0, r1, n0, c1) & kMaskHidden))
      mask = nullptr;
    mask_slab = nullptr;
  }

  __device__ uint32_t drop_row(int row) const {
    return mix32(static_cast<uint32_t>(m0 + row) ^ drop_head);
  }

  // Multiplier of p[t, s] after dropout: 0 or 1 / (1 - rate).
  __device__ float keep(const FwdParams& p, uint32_t row_hash, int s) const {
    return mix32(static_cast<uint32_t>(s) ^ row_hash) >= p.dropout_threshold ? keep_scale : 0.f;
  }
};

struct NoVariants {};

// kVariants: the variant rules of p (FwdVariants) apply, causal included (kCausal is false).
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal, bool kVariants>
__global__ void __launch_bounds__(FwdCfg<T, kHeadDim, kHeadDimV, kVariants>::kThreads, 2)
    flash_fwd_kernel(const FwdParams p, int num_m_blocks) {
  static_assert(!(kCausal && kVariants), "the variant kernel reads is_causal from p");
  using Cfg = FwdCfg<T, kHeadDim, kHeadDimV, kVariants>;
  using TileQK = typename Cfg::TileQK;
  using TileVO = typename Cfg::TileVO;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kWarpRows = Cfg::kWarpRows, kMTiles = Cfg::kMTiles;
  constexpr int kNTilesS = kBlockN / 8;    // n8 tiles of S (keys)
  constexpr int kNTilesO = kHeadDimV / 8;  // n8 tiles of O (value head dim)

  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + (128 - smem_addr(smem) % 128) % 128);  // (kBlockM, H); reused to stage O
  T* sK = sQ + Cfg::kTileQ;            // (2, kBlockN, H)
  T* sV = sK + 2 * Cfg::kTileK;        // (2, kBlockN, Hv)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tig = lane % 4;  // accumulator row (and row + 8) and column pair

  // blockIdx.x enumerates (b, n, m_block) with m_block fastest, so the query tiles of one
  // head run together and share its K/V in L2. Causal runs the longest rows first.
  // Row indices are int (the handler checks T, S < 2^30); element offsets are int64.
  const int t_len = static_cast<int>(p.t), s_len = static_cast<int>(p.s);
  int m_block = static_cast<int>(blockIdx.x % num_m_blocks);
  const int64_t bn = blockIdx.x / num_m_blocks;  // b * N + n
  const int64_t n = bn % p.n, b = bn / p.n;
  if (kCausal || (kVariants && p.is_causal)) m_block = num_m_blocks - 1 - m_block;
  const int64_t kvh = n / (p.n / p.kh);  // GQA: kv head of query head n (p.group() is host-only)
  const int m0 = m_block * kBlockM;      // first query row of the tile
  // First tile row this thread copies of q/k and of v; the real chunks of a row of each.
  const int row_qk = tid / TileQK::kThreadsPerRow, row_v = tid / TileVO::kThreadsPerRow;
  // H is kHeadDim; Hv may be below kHeadDimV (zero-filled V columns, unstored O columns).
  constexpr int chunks_qk = TileQK::kChunks;
  const int chunks_v = static_cast<int>(p.hv / 8);

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
  TileQK::template load_tile<kBlockM>(sQ, TileQK::thread_src(gQ, p.q_row_stride, m0, tid),
                                      p.q_row_stride, t_len - m0 - row_qk, chunks_qk, tid);
  // This thread's source rows of K/V key 0; the tile at key n0 starts n0 rows further.
  const T* gK = TileQK::thread_src(
      static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride,
      p.k_row_stride, 0, tid);
  const T* gV = TileVO::thread_src(
      static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride,
      p.v_row_stride, 0, tid);
  // Keys [key_lo, key_hi) this tile needs: all S, or under causal up to its last stored row
  // t (s <= t); with variants, the range of FwdVariants, whose tiles start at key_lo and
  // read no key at or past key_hi (the rest of the last tile is zero-filled).
  __shared__ std::conditional_t<kVariants, FwdVariants<T, kBlockM, kBlockN>, NoVariants> vs;
  int key_hi = kCausal ? min(s_len, min(t_len, m0 + kBlockM)) : s_len;
  int kv_end = s_len;
  int n0 = 0;  // first key of this iteration's tile
  if constexpr (kVariants) {
    if (warp == 0) vs.init(p, b, n, m0, lane);  // while Q lands
    __syncthreads();
    key_hi = kv_end = vs.key_hi;
    n0 = vs.next_live(p, vs.key_lo, lane);
  }
  if (n0 < key_hi) {
    TileQK::template load_tile<kBlockN>(sK, gK + n0 * p.k_row_stride, p.k_row_stride,
                                        kv_end - n0 - row_qk, chunks_qk, tid);
    TileVO::template load_tile<kBlockN>(sV, gV + n0 * p.v_row_stride, p.v_row_stride,
                                        kv_end - n0 - row_v, chunks_v, tid);
  }
  cp_async_commit();

  float acc_o[kMTiles][kNTilesO][4];  // (kWarpRows, H) fp32
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc_o[mi][dt][c] = 0.f;
  float row_max[kMTiles][2], row_sum[kMTiles][2];  // rows g and g + 8 of each m16 tile
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mi][h] = -INFINITY;
      row_sum[mi][h] = 0.f;  // this lane's share; the quad's shares are summed at the end
    }

  const int warp_row = warp * kWarpRows;  // first row of this warp within the tile
  // Per-lane ldmatrix row addresses (at k16 step 0). Each lane of a x4 load
  // names row lane % 8 of matrix lane / 8:
  //   Q (A, m16k16): matrices (rows +0..7 | +8..15) x (cols +0..7 | +8..15), row-fastest;
  //   K (B of S = Q K^T, two n8 tiles): (keys +0..7, d +0..7), (keys +0..7, d +8..15), then
  //     the same for keys +8..15;
  //   V (B of O = P V, .trans, two n8 tiles): (keys +0..7 | +8..15) x (d +0..7 | +8..15).
  constexpr uint32_t kRowBytes = TileQK::kStride * sizeof(T);
  constexpr uint32_t kRowBytesV = TileVO::kStride * sizeof(T);
  const uint32_t q_addr = smem_addr(sQ + TileQK::swz(warp_row + lane % 16, lane / 16 * 8));
  const uint32_t k_addr =
      smem_addr(sK + TileQK::swz(lane % 8 + lane / 16 * 8, (lane / 8) % 2 * 8));
  const uint32_t v_addr = smem_addr(sV + TileVO::swz(lane % 16, lane / 16 * 8));
  for (int stage = 0; n0 < key_hi; stage ^= 1) {
    // Tile n0 has landed for every thread, and every warp is done with the other stage.
    cp_async_wait<0>();
    __syncthreads();
    int next = n0 + kBlockN;
    if constexpr (kVariants) next = vs.next_live(p, next, lane);
    if (next < key_hi) {
      TileQK::template load_tile<kBlockN>(sK + (stage ^ 1) * Cfg::kTileK,
                                          gK + next * p.k_row_stride, p.k_row_stride,
                                          kv_end - next - row_qk, chunks_qk, tid);
      TileVO::template load_tile<kBlockN>(sV + (stage ^ 1) * Cfg::kTileV,
                                          gV + next * p.v_row_stride, p.v_row_stride,
                                          kv_end - next - row_v, chunks_v, tid);
    }
    cp_async_commit();

    // S = Q K^T: (kWarpRows, kBlockN) per warp
    float acc_s[kMTiles][kNTilesS][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_s[mi][nt][c] = 0.f;
    // Stage offsets are multiples of 128 bytes, as step16 needs.
    const uint32_t k_addr_j = k_addr + stage * Cfg::kTileK * sizeof(T);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t rQ[kMTiles][4];  // A fragments of the k16 step kk
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
        ldmatrix_x4(rQ[mi], Cfg::step16(q_addr, kk) + mi * 16 * kRowBytes);
#pragma unroll
      for (int nj = 0; nj < kBlockN / 16; ++nj) {
        // B fragments (K^T) of key n8 tiles 2nj and 2nj+1
        uint32_t rK[4];
        ldmatrix_x4(rK, Cfg::step16(k_addr_j, kk) + nj * 16 * kRowBytes);
        const uint32_t b0[2] = {rK[0], rK[1]}, b1[2] = {rK[2], rK[3]};
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          mma_16816<T>(acc_s[mi][2 * nj], rQ[mi], b0);
          mma_16816<T>(acc_s[mi][2 * nj + 1], rQ[mi], b1);
        }
      }
    }

    // Logits in log2 units; keys >= S, and under causal keys s > t, become -inf. Only
    // tiles that reach past S or straddle the diagonal pay for the mask.
    if constexpr (kVariants) {
      vs.logits(p, acc_s, n0, warp_row, g, tig);
    } else {
      const bool need_mask = n0 + kBlockN > s_len || (kCausal && n0 + kBlockN - 1 > m0);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_s[mi][nt][c] *= p.scale_log2;
      if (need_mask) {
        const int kv_limit = s_len - n0;  // tile-relative key bound
        const int diag = m0 - n0;         // key col is hidden from row r when col - r > diag
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
          for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int col = nt * 8 + tig * 2 + c % 2;
              const int row = warp_row + mi * 16 + g + c / 2 * 8;
              if (col >= kv_limit || (kCausal && col - row > diag)) acc_s[mi][nt][c] = -INFINITY;
            }
      }
    }

    // Online softmax: new running max, rescale l and O by 2^(m_old - m_new), P = 2^(S - m).
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[mi][h];
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
          mx = fmaxf(mx, fmaxf(acc_s[mi][nt][2 * h], acc_s[mi][nt][2 * h + 1]));
        mx = quad_max(mx);
        // A row with no visible key so far keeps m = -inf; subtracting 0 then gives P = 0.
        const float m_use = mx == -INFINITY ? 0.f : mx;
        const float corr = exp2_approx(row_max[mi][h] - m_use);
        row_max[mi][h] = mx;
        row_sum[mi][h] *= corr;
#pragma unroll
        for (int dt = 0; dt < kNTilesO; ++dt) {
          acc_o[mi][dt][2 * h] *= corr;
          acc_o[mi][dt][2 * h + 1] *= corr;
        }
#pragma unroll
        for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
          for (int c = 2 * h; c < 2 * h + 2; ++c) {
            acc_s[mi][nt][c] = exp2_approx(acc_s[mi][nt][c] - m_use);
            row_sum[mi][h] += acc_s[mi][nt][c];
          }
        // Dropout scales P after the row sum: lse and the normaliser ignore it.
        if constexpr (kVariants) {
          if (p.dropout_seeds) {
            const uint32_t row_hash = vs.drop_row(warp_row + mi * 16 + g + h * 8);
#pragma unroll
            for (int nt = 0; nt < kNTilesS; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                acc_s[mi][nt][2 * h + e] *= vs.keep(p, row_hash, n0 + nt * 8 + tig * 2 + e);
          }
        }
      }

    // O += P V: P's accumulator tiles 2kk, 2kk+1 are the A fragment of k16 step kk. For
    // o_f32 (the backward's delta) P is split into P_hi + P_lo, both in T, and the GEMM run on
    // each, so that O carries P to ~16 bits and delta = rowsum(dO O) matches the backward's
    // fp32 P; one rounding of P in T misses it by dO (P~ - P) V, summed by dbias over rows.
    const uint32_t v_addr_j = v_addr + stage * Cfg::kTileV * sizeof(T);
    const int p_parts = kVariants && p.o_f32 ? 2 : 1;
#pragma unroll 1
    for (int part = 0; part < p_parts; ++part) {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t rP[kMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
          for (int r = 0; r < 4; ++r) {  // r: (row g | g+8) x (k 0..7 | 8..15)
            float (&pt)[4] = acc_s[mi][2 * kk + r / 2];
            const float x0 = pt[(r % 2) * 2], x1 = pt[(r % 2) * 2 + 1];
            rP[mi][r] = part == 0 ? pack2<T>(x0, x1)
                                  : pack2<T>(rounding_residue<T>(x0), rounding_residue<T>(x1));
          }
#pragma unroll
        for (int dj = 0; dj < kHeadDimV / 16; ++dj) {
          // B fragments (V, transposed on load) of head-dim n8 tiles 2dj and 2dj+1
          uint32_t rV[4];
          ldmatrix_x4_trans(rV, Cfg::step16(v_addr_j, dj) + kk * 16 * kRowBytesV);
          const uint32_t b0[2] = {rV[0], rV[1]}, b1[2] = {rV[2], rV[3]};
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            mma_16816<T>(acc_o[mi][2 * dj], rP[mi], b0);
            mma_16816<T>(acc_o[mi][2 * dj + 1], rP[mi], b1);
          }
        }
      }
    }
    n0 = next;
  }

  // Epilogue: O = acc / l and lse = (m + log2 l) ln 2; l == 0 (no visible key) gives O = 0,
  // lse = -inf. O is staged through this warp's own rows of sQ (their first Hv columns, in
  // sQ's layout, so no other warp's Q is touched) for 16-byte global stores. The variant
  // kernel also stores O in fp32 from the accumulators when p.o_f32 is set (for the backward).
  // Every thread's Q copies have landed before a warp stages O in its rows of sQ (with no key
  // tile, other threads' copies into them may still be in flight).
  cp_async_wait<0>();
  __syncthreads();
  const int64_t o_offset = b * p.o_batch_stride + n * p.o_head_stride;
  T* gO = static_cast<T*>(p.o) + o_offset;
  float* gLse = p.lse + bn * p.t;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(row_sum[mi][h]);
      const float inv = l == 0.f ? 0.f : 1.f / l;
      const int row = warp_row + mi * 16 + g + h * 8;
#pragma unroll
      for (int dt = 0; dt < kNTilesO; ++dt) {
        *reinterpret_cast<uint32_t*>(sQ + TileQK::swz(row, dt * 8 + tig * 2)) =
            pack2<T>(acc_o[mi][dt][2 * h] * inv, acc_o[mi][dt][2 * h + 1] * inv);
      }
      if (tig == 0 && m0 + row < t_len)
        gLse[m0 + row] = l == 0.f ? -INFINITY : (row_max[mi][h] + log2f(l)) * 0.6931471805599453f;
      if constexpr (kVariants) {
        if (p.o_f32 && m0 + row < t_len) {
          float* gOf = p.o_f32 + o_offset + static_cast<int64_t>(m0 + row) * p.o_row_stride;
#pragma unroll
          for (int dt = 0; dt < kNTilesO; ++dt)
            if (dt * 8 < p.hv)  // (row, dt * 8 + 2 tig .. + 1): a quad stores 8 columns
              *reinterpret_cast<float2*>(gOf + dt * 8 + tig * 2) =
                  make_float2(acc_o[mi][dt][2 * h] * inv, acc_o[mi][dt][2 * h + 1] * inv);
        }
      }
    }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < kWarpRows * TileVO::kChunks / 32; ++it) {
    const int i = it * 32 + lane;
    const int row = warp_row + i / TileVO::kChunks, c = i % TileVO::kChunks;
    if (m0 + row < t_len && c < chunks_v)  // the columns past Hv are padding
      *reinterpret_cast<uint4*>(gO + static_cast<int64_t>(m0 + row) * p.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + TileQK::swz(row, c * 8));
  }
}

template <typename T, int kHeadDim, int kHeadDimV, bool kCausal, bool kVariants>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdCfg<T, kHeadDim, kHeadDimV, kVariants>;
  const int64_t num_m_blocks = (p.t + Cfg::kBlockM - 1) / Cfg::kBlockM;
  // Fits grid.x (< 2^31) for any tensor that fits in memory: lse alone would need > 1 TB.
  const int64_t grid = num_m_blocks * p.n * p.b;
  if (grid == 0) return;
  auto kernel = flash_fwd_kernel<T, kHeadDim, kHeadDimV, kCausal, kVariants>;
  if (Cfg::kSmemBytes > 48 * 1024) {
    // Per device and cheap; a failure shows up in the caller's cudaGetLastError().
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Cfg::kSmemBytes) != cudaSuccess)
      return;
  }
  kernel<<<static_cast<unsigned>(grid), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
      p, static_cast<int>(num_m_blocks));
}

// The variant kernel covers causal too (p.is_causal), so each file compiles it once; it also
// runs a plain call that asks for o_f32.
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_fwd(const FwdParams& p, cudaStream_t stream) {
  if (live_variant(p) || p.o_f32)  // only the variant kernel writes o_f32
    launch_fwd<T, kHeadDim, kHeadDimV, false, true>(p, stream);
  else
    launch_fwd<T, kHeadDim, kHeadDimV, kCausal, false>(p, stream);
}

}  // namespace jaxflash::cuda
