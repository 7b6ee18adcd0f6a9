// FlashAttention-2 backward for sm80+ (mma.sync m16n8k16, ldmatrix, cp.async), in three kernels:
//   1. preprocess: delta = rowsum(dO * O) - dlse (B, N, T) and dq_accum = 0 (B, T, N, H);
//   2. main, K/V-stationary: one CTA per (key tile, kv head, batch) keeps its K, V tile and its
//      dK, dV accumulators on chip and loops over the G query heads of its group and over the
//      query tiles; dQ is accumulated with fp32 atomics into dq_accum;
//   3. convert: dq = scale * dq_accum, cast to T.
// Math per query tile (the CPU bwd_typed, tile by tile; P is the forward's softmax, recomputed):
//   S = Q K^T, P = exp2(S * scale_log2 - lse * log2e), dP = dO V^T, dS = P * (dP - delta),
//   dQ += dS K, dV += P^T dO, dK += dS^T Q;
//   the softmax scale is applied to dK at the end and to dQ in the convert kernel.
// Variants (bias, mask, lengths, segment ids, window, alignment, soft cap, ALiBi, dropout) and
// the deterministic mode live in a second instantiation of the main kernel, kVariants, chosen
// at launch, so that the tuned plain kernel keeps its registers. It applies the forward's rules
// (FwdVariants::logits) to its S fragments, visits per key tile only the query tiles that can
// see it, and with Z the logits (after cap, bias, ALiBi) and keep the dropout factor computes
//   dV += (P keep)^T dO, dZ = P * (dP keep - delta), dbias = dZ, dalibi = -sum dZ |s - t - shift|,
//   dS = dZ * cap'(.), dQ += dS K, dK += dS^T Q.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "flash_fwd.cuh"
#include "launch.h"
#include "mma.cuh"
#include "pdl.cuh"

namespace jaxflash::cuda {
namespace bwd {

// Tiles. The kernel is bound by shared-memory (ldmatrix) bandwidth, so every GEMM is split over
// the 8 warps in 2D: each warp owns a 32 x 32 (or 64 x 32) block of its output and every
// ldmatrix'd fragment feeds 2 or more mmas. P and dS go through shared memory once, (M, N)
// row-major, and are read back as the A operands of dV = P^T dO, dK = dS^T Q and dQ = dS K.
// Warp layouts at H <= 128 (kBlockN = 128 keys; output rows x cols per warp):
//  * S = Q K^T, dP = dO V^T: (M, N) over 2 x 4 warps of (M / 2, 32);
//  * dV, dK: (N, H) over 4 x 2 warps of (32, H / 2), private accumulators (no reduction);
//  * dQ: (M, H) over (M / 32) x (H / 32) warps of (32, 32).
// ldmatrix bytes per CTA and query tile fall from 816 KB (one 16-key m-tile per warp) to
// 608 KB at H = 128 and from 832 KB to 640 KB at H = 64, for the same FLOPs.
// fp32 accumulators per thread: dK + dV = 2 * N * H / 256 = H, S + dP = 2 * M * N / 256:
// 192 at both head dims, which with the fragments fits 255 registers.
// Shared memory (K, V, 2 x Q, 2 x dO, P, dS, 2 x lse, 2 x delta), one CTA of 8 warps per SM:
//  * H = 128: kBlockM = 64: (2*128*128 + 4*64*128 + 2*64*128) * 2 B + 1 KB = 161 KB;
//  * H = 64: kBlockM = 128 (halves the barriers per FLOP):
//    (2*128*64 + 4*128*64 + 2*128*128) * 2 B + 2 KB = 162 KB;
//  both under the A100's 163 KB.
// H = 192, 256: with 128 keys dK + dV alone would take 192 | 256 registers per thread, so a CTA
// keeps kBlockN = 64 keys (kBlockM = 64), and the warps split D wider instead:
//  * S, dP: (64, 64) over 4 x 2 warps of (16, 32); dV, dK: (64, D) over 2 x 4 warps of
//    (32, D / 4), 96 | 128 accumulator registers; dQ: (64, D) over 2 x 4 warps of (32, D / 4).
//  * shared memory (2*64*D + 4*64*D + 2*64*64) * 2 B + 1 KB: 161 KB at 192 (under the A100's
//    163 KB), 209 KB at 256 (sm90's 227 KB only, the CUDA handler checks: at kBlockM = 32
//    the 8 warps would not each have an m16 tile of S).
// Other head dims run on the next width of these (bwd_width: 32 on 64, 96 on 128) with their
// Q, K columns past H zero-filled on load and their dQ, dK columns past H never stored: the
// zeros add nothing to q.k, and 32 | 96 columns are too narrow for the 64-column swizzle (swz)
// and the 32-column warp blocks. V, dO (Hv columns) are padded to the same width when Hv < H
// (the MLA pair 192/128): dP = dO V^T needs equal widths, and dV's columns past Hv are not stored.
template <int kHeadDim>
struct Tiles {
  static constexpr int kWidth = bwd_width(kHeadDim);       // D: columns of Q, K, V, dO tiles
  static constexpr int kBlockN = bwd_block_n(kHeadDim);    // keys per CTA: 128 | 64
  static constexpr int kBlockM = bwd_block_m(kHeadDim);    // queries per step: 128 | 64
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // S, dP: (M, N) over (kWarps / kWarpsKeys) x kWarpsKeys warps of (kRowsS, 32).
  static constexpr int kWarpsKeys = kBlockN / 32;
  static constexpr int kRowsS = kBlockM * kWarpsKeys / kWarps;
  static constexpr int kMiS = kRowsS / 16;                  // S, dP: m16 tiles per warp
  // dV, dK: (N, D) over kWarpsKeys x (kWarps / kWarpsKeys) warps of (32, kColsKV).
  static constexpr int kColsKV = kWidth * kWarpsKeys / kWarps;
  static constexpr int kNjKV = kColsKV / 8;                 // dV, dK: n8 tiles per warp
  // dQ: (M, D) over kWarpsMdQ x (kWarps / kWarpsMdQ) warps of (32, kColsdQ).
  static constexpr int kWarpsMdQ = kBlockM / 32;
  static constexpr int kColsdQ = kWidth * kWarpsMdQ / kWarps;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= kWidth && kWidth % 64 == 0, "head dims");
  static_assert(kRowsS % 16 == 0 && kColsKV % 16 == 0 && kColsdQ % 16 == 0, "warp layouts");
  static_assert(kBlockM * kWidth / 8 % kThreads == 0 && kBlockN * kWidth / 8 % kThreads == 0 &&
                    kBlockM <= kThreads,
                "copy loops");

  static constexpr int kSmemBytes = bwd_smem_bytes(kHeadDim);
};

// Whether column col of a tile kWidth wide holds data of a row kCols wide (the rest is
// padding); a constant true where the widths match, so that those kernels keep no test.
template <int kCols, int kWidth>
__device__ __forceinline__ bool in_cols(int col) {
  return kCols == kWidth || col < kCols;
}

// Element offset of (row, col) in a row-major (rows, kCols) smem tile of 16-bit values whose
// 16-byte chunks are XOR-swizzled by row % 8: the 8 rows an ldmatrix reads, or a warp stores
// from an mma fragment, fall in 8 different bank groups (no bank conflicts).
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(kCols % 64 == 0, "a row must span at least 8 chunks");
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// dst[0..1] += (x, y) in global fp32 memory; one vector atomic on sm90.
__device__ __forceinline__ void atomic_add2(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// Rows (b, t, n) of a BTNH tensor handled by 8-element (16-byte) chunks: kLanes adjacent lanes
// of one warp per row, lane c holding chunks c + kLanes i (i < kPerLane) of a row of up to
// kWidth columns. kLanes is a power of 2 (the row's lanes reduce by shuffles): the chunks past
// kWidth / 8 (at 192) idle.
template <int kWidth, int kChunksPerLane = 1>
struct RowChunks {
  static constexpr int kPerLane = kChunksPerLane;
  static constexpr int kLanes = [] {
    int lanes = 1;
    while (lanes * kPerLane * 8 < kWidth) lanes *= 2;
    return lanes;
  }();
  static constexpr int kThreads = 256;
  static_assert(kLanes <= 32, "a row's lanes in one warp");
  __host__ __device__ static int64_t blocks(int64_t rows) {
    return (rows * kLanes + kThreads - 1) / kThreads;
  }
};

// A dQ ticket's bit once the query tile's first contribution is stored in dq_accum
// (sm90/flash_bwd_sm90.cuh, kFirstStore).
constexpr int kDqTicketDone = 1 << 30;

// lse in log2 units, +inf where P = 0 (a row that sees no key: 2^(s - inf) = 0).
__device__ __forceinline__ float lse_log2_of(float lse) {
  constexpr float kLog2e = 1.4426950408889634f;
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// The sm90 backward's padded rows (BwdParams::t_pad), element idx of (B, N, t_pad) in address
// order: lse_log2[b, n, t] = lse * log2(e), +inf where P = 0 (no visible key, t past T or the
// query length: sm90/rules.cuh), and delta = 0 at t past T.
__device__ __forceinline__ void lse_row(const BwdParams& p, int64_t idx) {
  if (idx >= p.b * p.n * p.t_pad) return;
  const int64_t bn = idx / p.t_pad, t = idx % p.t_pad, b = bn / p.n;
  const int64_t q_len = p.q_lengths ? max(int64_t{0}, min(int64_t{p.q_lengths[b]}, p.t)) : p.t;
  const float lse = t < q_len ? p.lse[bn * p.t + t] : -INFINITY;
  p.lse_log2[idx] = lse_log2_of(lse);
  if (t >= p.t) p.delta[idx] = 0.f;
}

// delta[b, n, t] = sum_d dout[b, t, n, d] * o[b, t, n, d] - dlse[b, n, t] (Hv columns), with
// the forward's fp32 o (p.o_f32) when given, else the stored one;
// dq_accum[b, t, n, :H] = 0 (rows bwd_width(H) wide; the padding is never read), or with
// p.dq_first_store the dQ tickets = 0 instead. With p.t_pad (the sm90 backward) delta's rows
// are t_pad long, and the blocks past the rows' (PreRows::blocks) write the padded rows
// (lse_row) in one launch with them. A lane takes 2 chunks of its row, so that the row's index
// arithmetic is shared by 64 bytes of dout and o: at one chunk a lane the pass ran at half the
// DRAM's rate where dq_accum takes no zeros (H200, ncu, D=128 at 16k tokens: 61 -> 37 us; the
// D=128 1k causal backward +3%). With the zeros it is level (68 us); 4 chunks a lane were
// slower there (NOTES.md, fortieth session).
template <int kHeadDim>
using PreRows = RowChunks<Tiles<kHeadDim>::kWidth, 2>;

// This lane's part of delta's row sum (kOF32: from p.o_f32), after its part of dq_accum's zeros
// (the row's lanes on adjacent 16-byte pieces; stores first, so that no wait for the loads
// holds them back).
template <typename T, int kHeadDim, int kHeadDimV, bool kOF32>
__device__ __forceinline__ float delta_lane(const BwdParams& p, int64_t row, int lane,
                                            int64_t o_at, const T* dout) {
  using Rows = PreRows<kHeadDim>;
  constexpr int kWidth = Tiles<kHeadDim>::kWidth;
  constexpr int kLanes = Rows::kLanes, kPerLane = Rows::kPerLane;
  if (!p.dq_first_store) {
    float4* dqa = reinterpret_cast<float4*>(p.dq_accum + row * kWidth);
#pragma unroll
    for (int u = lane; u < kHeadDim / 4; u += kLanes) dqa[u] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // The row's chunks lane + kLanes i (8 columns each of dout and o): all loads, then the sums.
  uint4 d[kPerLane];
  std::conditional_t<kOF32, float4[kPerLane][2], uint4[kPerLane]> o;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + kLanes * i;
    if (c >= kHeadDimV / 8) continue;
    d[i] = *reinterpret_cast<const uint4*>(dout + c * 8);
    if constexpr (kOF32) {
      o[i][0] = reinterpret_cast<const float4*>(p.o_f32 + o_at + c * 8)[0];
      o[i][1] = reinterpret_cast<const float4*>(p.o_f32 + o_at + c * 8)[1];
    } else {
      o[i] = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + o_at + c * 8);
    }
  }
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (lane + kLanes * i >= kHeadDimV / 8) continue;
    const uint32_t dw[4] = {d[i].x, d[i].y, d[i].z, d[i].w};
    float2 of[4];  // 8 columns of o
    if constexpr (kOF32) {
      of[0] = make_float2(o[i][0].x, o[i][0].y), of[1] = make_float2(o[i][0].z, o[i][0].w);
      of[2] = make_float2(o[i][1].x, o[i][1].y), of[3] = make_float2(o[i][1].z, o[i][1].w);
    } else {
      const uint32_t ow[4] = {o[i].x, o[i].y, o[i].z, o[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) of[k] = unpack2<T>(ow[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 df = unpack2<T>(dw[k]);
      acc += of[k].x * df.x + of[k].y * df.y;
    }
  }
  return acc;
}

template <typename T, int kHeadDim, int kHeadDimV>
__global__ void __launch_bounds__(PreRows<kHeadDim>::kThreads)
    preprocess_kernel(const BwdParams p) {
  using Rows = PreRows<kHeadDim>;
  constexpr int kLanes = Rows::kLanes;
  pdl_trigger();
  const int64_t rows = p.b * p.t * p.n;
  const int64_t row_blocks = Rows::blocks(rows);
  if (blockIdx.x >= row_blocks) {
    lse_row(p, (blockIdx.x - row_blocks) * Rows::kThreads + threadIdx.x);
    return;
  }
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / kLanes;  // (b * T + t) * N + n
  const int lane = static_cast<int>(idx % kLanes);
  const bool valid = row < rows;
  const int64_t n = row % p.n, t = (row / p.n) % p.t, b = row / (p.n * p.t);
  // dq_first_store: the kernel stores each query tile's first contribution (tickets, sm90/
  // flash_bwd_sm90.cuh), so dq_accum needs no zeros.
  if (p.dq_first_store && idx < dq_tickets(p)) p.dq_ticket[idx] = 0;
  float acc = 0.f;
  if (valid) {
    const int64_t o_at = b * p.o_batch_stride + t * p.o_row_stride + n * p.o_head_stride;
    const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride +
                    t * p.do_row_stride + n * p.do_head_stride;
    acc = p.o_f32 ? delta_lane<T, kHeadDim, kHeadDimV, true>(p, row, lane, o_at, dout)
                  : delta_lane<T, kHeadDim, kHeadDimV, false>(p, row, lane, o_at, dout);
  }
  // Every lane takes part in the shuffles; kLanes divides 32, so a row never straddles warps.
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && lane == 0)
    p.delta[(b * p.n + n) * (p.t_pad ? p.t_pad : p.t) + t] =
        acc - (p.dlse ? p.dlse[(b * p.n + n) * p.t + t] : 0.f);
}

// dq[b, t, n] = scale * dq_accum[b, t, n, :H], cast to T (or kept in fp32: grads_f32).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(RowChunks<Tiles<kHeadDim>::kWidth>::kThreads)
    convert_dq_kernel(const BwdParams p) {
  constexpr int kWidth = Tiles<kHeadDim>::kWidth;
  constexpr int kLanes = RowChunks<kWidth>::kLanes;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / kLanes;
  const int c = static_cast<int>(idx % kLanes);
  pdl_wait();
  if (row >= p.b * p.t * p.n || c >= kHeadDim / 8) return;
  const int64_t n = row % p.n, t = (row / p.n) % p.t, b = row / (p.n * p.t);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row * kWidth + c * 8);
  const float4 x = src[0], y = src[1];
  const float s = p.scale;
  const int64_t at = b * p.dq_batch_stride + t * p.dq_row_stride + n * p.dq_head_stride + c * 8;
  if (p.grads_f32) {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.dq) + at);
    dst[0] = make_float4(x.x * s, x.y * s, x.z * s, x.w * s);
    dst[1] = make_float4(y.x * s, y.y * s, y.z * s, y.w * s);
    return;
  }
  uint4 out;
  out.x = pack2<T>(x.x * s, x.y * s);
  out.y = pack2<T>(x.z * s, x.w * s);
  out.z = pack2<T>(y.x * s, y.y * s);
  out.w = pack2<T>(y.z * s, y.w * s);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + at) = out;
}

__device__ __forceinline__ void sts_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}

// The row and 8-column chunk (0 or 1) of a 16x16 block whose address a lane hands to an
// ldmatrix.x4 (lane i addresses row i % 8 of matrix i / 8), for the two orders of the 4 matrices:
//  * kA: matrices (rows 0-7, 8-15) x (cols 0-7, 8-15) in column order: an A fragment (m16 x k16)
//    from (m, k) storage, or with .trans two B fragments (k16 x n8) from (k, n) storage;
//  * kB: the same in row order: two B fragments from (n, k) storage, or with .trans an A
//    fragment from (k, m) storage.
// Register order is matrix order: A = {a0, a1, a2, a3}; two B = {b0, b1} of n-tile 0, then 1.
enum class Ldsm { kA, kB };
template <Ldsm kOrder>
__device__ __forceinline__ int ldsm_row(int lane) {
  return kOrder == Ldsm::kA ? lane % 16 : lane % 8 + lane / 16 * 8;
}
template <Ldsm kOrder>
__device__ __forceinline__ int ldsm_chunk(int lane) {
  return kOrder == Ldsm::kA ? lane / 16 : lane / 8 % 2;
}

// Byte offsets in a swizzled (rows, kCols) tile (see swz) of the lane's ldmatrix row in the
// 16x16 blocks at columns 16 * v, v = 0..3. As the block's first row r0 is a multiple of 8
// the swizzle is periodic: the block at (r0, c0) is at bytes r0 * kCols * 2 + off(c0), below.
template <int kCols, Ldsm kOrder>
struct LdsmOffsets {
  uint32_t v[4];
  __device__ __forceinline__ explicit LdsmOffsets(int lane) {
    const int row = ldsm_row<kOrder>(lane), chunk = ldsm_chunk<kOrder>(lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (row * kCols + (((2 * i + chunk) ^ (row & 7)) << 3)) * 2;
  }
  // c0 % 16 == 0, known at compile time after unrolling (it indexes registers).
  __device__ __forceinline__ uint32_t operator()(int c0) const {
    return c0 / 64 * 128 + v[c0 / 16 % 4];
  }
};


// Byte offsets in a swizzled (rows, kCols) tile (see swz) of the lane's ldmatrix row in the
// kCount 16x16 blocks at columns col0 + 16 * i (col0 % 16 == 0, set per warp at run time); the
// block's first row is a multiple of 8 and is added as a plain row offset.
template <int kCols, Ldsm kOrder, int kCount>
struct LdsmCols {
  uint32_t v[kCount];
  __device__ __forceinline__ LdsmCols(int lane, int col0) {
    const int row = ldsm_row<kOrder>(lane), chunk = ldsm_chunk<kOrder>(lane);
#pragma unroll
    for (int i = 0; i < kCount; ++i)
      v[i] = (row * kCols + (((col0 / 8 + 2 * i + chunk) ^ (row & 7)) << 3)) * 2;
  }
};

// acc[i][2 j], acc[i][2 j + 1] += the A fragment ra[i] times the two n8 B fragments in rb[j]:
// the mma step of every GEMM below once its k16 fragments are loaded.
template <typename T, int kMi, int kNj2>
__device__ __forceinline__ void mma_frags(float (&acc)[kMi][2 * kNj2][4],
                                          const uint32_t (&ra)[kMi][4],
                                          const uint32_t (&rb)[kNj2][4]) {
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int j = 0; j < kNj2; ++j) {
      mma_16816<T>(acc[i][2 * j], ra[i], {rb[j][0], rb[j][1]});
      mma_16816<T>(acc[i][2 * j + 1], ra[i], {rb[j][2], rb[j][3]});
    }
  }
}

// acc (kMi m16 x 4 n8 tiles) += A B^T with A (16 kMi, kK) and B (32, kK) both row-major in
// swizzled (rows, kCols) tiles at byte addresses a, b (the warp's first rows).
template <typename T, int kMi, int kK, int kCols>
__device__ __forceinline__ void gemm_abt(float (&acc)[kMi][4][4], uint32_t a, uint32_t b,
                                         const LdsmOffsets<kCols, Ldsm::kA>& off_a,
                                         const LdsmOffsets<kCols, Ldsm::kB>& off_b) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t ra[kMi][4], rb[2][4];
#pragma unroll
    for (int i = 0; i < kMi; ++i) ldmatrix_x4(ra[i], a + i * 16 * kCols * 2 + off_a(kk * 16));
#pragma unroll
    for (int j = 0; j < 2; ++j) ldmatrix_x4(rb[j], b + j * 16 * kCols * 2 + off_b(kk * 16));
    mma_frags<T>(acc, ra, rb);
  }
}

// acc (2 m16 x kNj n8 tiles) += A^T B with A (kK, 32) and B (kK, 8 kNj) both row-major in
// swizzled tiles at byte addresses a, b (row 0), the warp's columns folded into off_a, off_b.
template <typename T, int kNj, int kK, int kColsA, int kColsB>
__device__ __forceinline__ void gemm_atb(float (&acc)[2][kNj][4], uint32_t a, uint32_t b,
                                         const LdsmCols<kColsA, Ldsm::kB, 2>& off_a,
                                         const LdsmCols<kColsB, Ldsm::kA, kNj / 2>& off_b) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t ra[2][4], rb[kNj / 2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) ldmatrix_x4_trans(ra[i], a + kk * 16 * kColsA * 2 + off_a.v[i]);
#pragma unroll
    for (int j = 0; j < kNj / 2; ++j)
      ldmatrix_x4_trans(rb[j], b + kk * 16 * kColsB * 2 + off_b.v[j]);
    mma_frags<T>(acc, ra, rb);
  }
}

// acc (2 m16 x kNj n8 tiles) += A B with A (32, kK) row-major in a swizzled (rows, kColsA) tile
// at byte address a (the warp's first row) and B (kK, 8 kNj) row-major in a swizzled tile at b
// (row 0), the warp's columns folded into off_b.
template <typename T, int kNj, int kK, int kColsA, int kColsB>
__device__ __forceinline__ void gemm_ab(float (&acc)[2][kNj][4], uint32_t a, uint32_t b,
                                        const LdsmOffsets<kColsA, Ldsm::kA>& off_a,
                                        const LdsmCols<kColsB, Ldsm::kA, kNj / 2>& off_b) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t ra[2][4], rb[kNj / 2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) ldmatrix_x4(ra[i], a + i * 16 * kColsA * 2 + off_a(kk * 16));
#pragma unroll
    for (int j = 0; j < kNj / 2; ++j)
      ldmatrix_x4_trans(rb[j], b + kk * 16 * kColsB * 2 + off_b.v[j]);
    mma_frags<T>(acc, ra, rb);
  }
}

// x, opaque to the compiler: values derived from it are recomputed where used, not hoisted.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// A thread's coordinates: warp, lane, mma fragment row g (and g + 8) and column pair 2 * tq.
// The main loop rebuilds them, and the per-lane offsets derived from them, in each phase from
// an opaque copy of the thread index: kept live across the loop they spilled registers.
struct Thread {
  int warp, lane, g, tq;
  __device__ __forceinline__ explicit Thread(int tid)
      : warp(tid / 32), lane(tid % 32), g(tid % 32 / 4), tq(tid % 4) {}
};

__device__ __forceinline__ void sts_u16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(v));
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// P kept for dS as sP's T(P keep) and a residue in fp16: P - T(P keep) / keep, or -P where
// dropout drops the element (keep 0, sP 0), so that sP / keep + residue is P, signed as dz_of
// reads it. keep = inv_keep = 1 without dropout.
template <typename T>
__device__ __forceinline__ float p_residue(float p, float keep, float inv_keep) {
  return keep == 0.f ? -p : p - static_cast<float>(static_cast<T>(p * keep)) * inv_keep;
}

template <typename T>
__device__ __forceinline__ uint32_t p_residue2(float p0, float p1, float keep0 = 1.f,
                                               float keep1 = 1.f, float inv_keep = 1.f) {
  return pack2<__half>(p_residue<T>(p0, keep0, inv_keep), p_residue<T>(p1, keep1, inv_keep));
}

template <typename T>
__device__ __forceinline__ float2 kept_p(uint32_t p_kept, uint32_t residue, float inv_keep = 1.f) {
  const float2 hi = unpack2<T>(p_kept), lo = unpack2<__half>(residue);
  return make_float2(fmaf(hi.x, inv_keep, lo.x), fmaf(hi.y, inv_keep, lo.y));
}

__device__ __forceinline__ int ld_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// A length operand clamped to [0, full] (lengths past the array mean the whole of it).
__device__ __forceinline__ int64_t valid_len(const int32_t* lengths, int64_t b, int64_t full) {
  return lengths ? max(int64_t{0}, min(int64_t{lengths[b]}, full)) : full;
}

// Min and max of ids[begin, end), reduced over the warp; (INT_MAX, INT_MIN) when empty.
__device__ __forceinline__ int2 seg_id_range(const int32_t* ids, int begin, int end, int lane) {
  int lo = INT_MAX, hi = INT_MIN;
  for (int i = begin + lane; i < end; i += 32) {
    lo = min(lo, ids[i]);
    hi = max(hi, ids[i]);
  }
  return make_int2(__reduce_min_sync(0xffffffffu, lo), __reduce_max_sync(0xffffffffu, hi));
}

// Two tiles whose segment id ranges are disjoint share no id: no query sees a key.
__device__ __forceinline__ bool seg_meet(int2 a, int2 b) { return a.y >= b.x && a.x <= b.y; }

// Segment ids of the valid keys [n0, min(n0 + N, kv_len)) of a key tile of batch b: the CTA of
// the tile and the deterministic ranks of the other CTAs (kv_seg_range) read the same ids.
template <int N>
__device__ __forceinline__ int2 key_tile_seg(const BwdParams& p, int64_t b, int n0, int lane) {
  const int64_t kv_len = valid_len(p.kv_lengths, b, p.s);
  const int end = static_cast<int>(max(int64_t{n0}, min(int64_t{n0} + N, kv_len)));
  return seg_id_range(p.kv_segment_ids + b * p.s, n0, end, lane);
}

// Whether the mask's tile summary (MaskTiles) of a batch and head, `slab`, has a true element
// where query tile m0 meets key tile n0: the main kernel's step skip and the deterministic dQ
// order (dq_rank) take the same test. Rows past q_len and keys past S are not the tiles'.
template <int M, int N>
__device__ __forceinline__ bool mask_meets(const BwdParams& p, const uint8_t* slab, int m0,
                                           int q_len, int n0) {
  return MaskTiles(p).bits(slab, m0, min(m0 + M, q_len), n0,
                           static_cast<int>(min(int64_t{n0} + N, p.s))) &
         kMaskVisible;
}

// The variant kernel's view of its CTA (batch b, key tile at n0), in shared memory (written by
// warp 0): the query tiles [m_first, m_first + n_m) holding a query that sees a key of the
// tile through lengths, causal and window (the CPU kernel's query_range, tile by tile; exactly
// the query tiles whose FwdVariants key range meets this tile), and the keys' segment ids.
template <int M, int N>
struct KeyTile {
  int m_first, n_m;
  int q_len;    // valid query rows of batch b
  int2 kv_seg;  // segment id range of the tile's valid keys
  int n0, head0;  // the tile's first key; the first query head of its kv head
  int next[2];    // the live step after the one whose rules are in FwdVariants buffer i

  __device__ void init(const BwdParams& p, int64_t b, int head0_, int n0_, int lane) {
    n0 = n0_;
    head0 = head0_;
    const int64_t q_raw = p.q_lengths ? p.q_lengths[b] : p.t;
    const int64_t kv_raw = p.kv_lengths ? p.kv_lengths[b] : p.s;
    const int64_t kv_len = valid_len(p.kv_lengths, b, p.s);
    q_len = static_cast<int>(valid_len(p.q_lengths, b, p.t));
    const int64_t shift = p.bottom_right ? kv_raw - q_raw : 0;
    const int64_t wl = min(p.window_left, int64_t{1} << 31);  // keeps the sums in int64
    const int64_t wr = min(p.window_right, int64_t{1} << 31);
    const int64_t last = min(int64_t{n0} + N, kv_len) - 1;  // last valid key of the tile
    int64_t lo = 0, hi = last < n0 ? 0 : q_len;
    if (p.is_causal) lo = max(lo, n0 - shift);
    if (wr >= 0) lo = max(lo, n0 - shift - wr);
    if (wl >= 0) hi = min(hi, last - shift + wl + 1);
    m_first = lo < hi ? static_cast<int>(lo / M) : 0;
    n_m = lo < hi ? static_cast<int>((hi + M - 1) / M) - m_first : 0;
    if (p.q_segment_ids) kv_seg = key_tile_seg<N>(p, b, n0, lane);
  }

  // The first step at or after st (of iters; step = head * n_m + query tile) whose queries
  // may see a key of the tile: the mask has a true element where they meet (its tile summary)
  // and the query tile's segment ids can meet the keys'. Query tiles repeat per head: unless
  // the mask differs between heads, a round of n_m dead steps means that every later one is
  // dead too. Every warp computes the same answer.
  __device__ int next_live(const BwdParams& p, int64_t b, int st, int iters, int lane) const {
    if (!p.q_segment_ids && !p.mask_tiles) return st;
    const int32_t* q_seg = p.q_segment_ids + b * p.t;
    const int end = p.mask_tiles && p.mask_strides.head ? iters : min(iters, st + n_m);
    for (; st < end; ++st) {
      // One step at a time: a warp-wide search (first_live) spilled registers of the main loop.
      const int m0 = (m_first + st % n_m) * M;
      if (p.mask_tiles &&
          !mask_meets<M, N>(p, p.mask_tiles + MaskTiles(p).slab(p, b, head0 + st / n_m), m0,
                            q_len, n0))
        continue;
      if (!p.q_segment_ids ||
          seg_meet(seg_id_range(q_seg, m0, min(m0 + M, q_len), lane), kv_seg))
        return st;
    }
    return iters;
  }

  // Run by warp 0: buffer i, v, gets the rules of step st, and next[i] the live step after it
  // (found here, by one warp, rather than by every thread at the top of the step).
  template <typename T>
  __device__ void ready(const BwdParams& p, FwdVariants<T, M, N>& v, int i, int64_t b, int st,
                        int iters, int lane) {
    v.init(p, b, head0 + st / n_m, (m_first + st % n_m) * M, lane);
    v.settle_mask(p, n0, n0 + N);
    next[i] = next_live(p, b, st + 1, iters, lane);
  }
};

// dZ = P * (dP keep - delta) of one element, from P signed as the variant kernels keep it:
// negative where dropout drops the element (keep 0), else kept (keep = keep_scale, 1 without
// dropout).
__device__ __forceinline__ float dz_of(float p_signed, float dp, float keep_scale, float dl) {
  return fabsf(p_signed) * (dp * (signbit(p_signed) ? 0.f : keep_scale) - dl);
}

// Deterministic dQ: the CTAs of the key tiles that a query tile's FwdVariants v (of batch b,
// head n) sees, from its first one (v.key_lo / N) on, add to its dq_accum rows one after the
// other. The rank of key tile j is the number of such tiles before it that the mask and the
// segment ids leave live (the same tests as KeyTile::next_live: mask_meets, and the ids'
// ranges in kv_seg_range). Warp-wide.
template <typename T, int M, int N>
__device__ int dq_rank(const BwdParams& p, const FwdVariants<T, M, N>& v, int64_t b, int n,
                       int j, int n_key_tiles, int lane) {
  const int j_lo = v.key_lo / N;
  if (!p.q_segment_ids && !p.mask_tiles) return j - j_lo;
  const uint8_t* slab = p.mask_tiles ? p.mask_tiles + MaskTiles(p).slab(p, b, n) : nullptr;
  const int2 q_seg = make_int2(v.q_seg_min, v.q_seg_max);
  int live = 0;
  for (int jj = j_lo + lane; jj < j; jj += 32) {
    bool meets = !slab || mask_meets<M, N>(p, slab, v.m0, v.m0 + v.q_rows, jj * N);
    if (meets && p.q_segment_ids) {
      const int* r = p.kv_seg_range + (b * n_key_tiles + jj) * 2;
      meets = seg_meet(make_int2(r[0], r[1]), q_seg);
    }
    live += meets;
  }
  return __reduce_add_sync(0xffffffffu, live);
}

// dbias from one warp's (16 kMi, 32) block of dZ in the S fragment layout: element c of tile
// (i, j) is block row 16 i + 8 (c / 2) + g, key 8 j + 2 tq + c % 2; the block's bias element
// (row r, key k) is at r * row + k * col from `base` (dbias has the bias's layout). A bias
// with no broadcast dim gets each element written once. Otherwise dZ is summed into the fp32
// dbias_accum, first over the block's rows and/or keys where the bias broadcasts over them,
// so that one atomic carries a row or a column; exact zeros (masked) are not added.
template <typename T, int kMi>
__device__ void dbias_block(const BwdParams& p, const float (&dz)[kMi][4][4], int64_t base,
                            int rows_left, int keys_left, int g, int tq) {
  const BcastStrides& st = p.bias_strides;
  // f(dz, i, j, c, r, k) for every element of the block that exists (none past T or S).
  const auto each = [&](auto&& f) {
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = 16 * i + 8 * (c / 2) + g, k = 8 * j + 2 * tq + c % 2;
          if (r < rows_left && k < keys_left) f(dz[i][j][c], i, j, c, r, k);
        }
  };
  if (!p.dbias_accum) {
    T* dst = static_cast<T*>(p.dbias) + base;
    each([&](float x, int, int, int, int r, int k) {
      dst[r * st.row + k * st.col] = static_cast<T>(x);
    });
    return;
  }
  float* acc = p.dbias_accum + base;
  if (st.row == 0) {  // one bias row: sum the block's rows (over i, c / 2, then the 8 g lanes)
    float col_sum[4][2] = {};
    each([&](float x, int, int j, int c, int, int) { col_sum[j][c % 2] += x; });
    float all = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = col_sum[j][e];
        for (int off = 4; off < 32; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
        col_sum[j][e] = x;
        all += x;
      }
    if (st.col == 0) {  // one bias element: also sum the keys (over j, e, then the 4 tq lanes)
      all += __shfl_xor_sync(0xffffffffu, all, 1);
      all += __shfl_xor_sync(0xffffffffu, all, 2);
      if (g == 0 && tq == 0 && all != 0.f) atomicAdd(acc, all);
      return;
    }
    if (g == 0)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = 8 * j + 2 * tq + e;
          if (k < keys_left && col_sum[j][e] != 0.f) atomicAdd(acc + k * st.col, col_sum[j][e]);
        }
    return;
  }
  if (st.col == 0) {  // one bias column: sum the block's keys (over j, c % 2, then the 4 tq lanes)
    float row_sum[kMi][2] = {};
    each([&](float x, int i, int, int c, int, int) { row_sum[i][c / 2] += x; });
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x = row_sum[i][h];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const int r = 16 * i + 8 * h + g;
        if (tq == 0 && r < rows_left && x != 0.f) atomicAdd(acc + r * st.row, x);
      }
    return;
  }
  each([&](float x, int, int, int, int r, int k) {
    if (x != 0.f) atomicAdd(acc + r * st.row + k * st.col, x);
  });
}

// kVariants: the variant rules of p apply, causal included (kCausal is false), and so does
// p.deterministic. (kHeadDim, kHeadDimV) = (H, Hv); the tiles are D = Tiles::kWidth wide.
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal, bool kVariants>
__global__ void __launch_bounds__(Tiles<kHeadDim>::kThreads, 1) main_kernel(const BwdParams p) {
  static_assert(!(kCausal && kVariants), "the variant kernel reads is_causal from p");
  static_assert(kHeadDimV <= kHeadDim, "V, dO are padded to the width of Q, K");
  using Cfg = Tiles<kHeadDim>;
  constexpr int D = Cfg::kWidth, M = Cfg::kBlockM, N = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kMi = Cfg::kMiS, kNjKV = Cfg::kNjKV, kWarpsKeys = Cfg::kWarpsKeys;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row of Q, dO, K, V tiles

  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // (N, D)
  T* sV = sK + N * D;                  // (N, D)
  T* sQ = sV + N * D;                  // 2 x (M, D): double buffer
  T* sdO = sQ + 2 * M * D;             // 2 x (M, D)
  T* sP = sdO + 2 * M * D;             // (M, N): P of the current query tile
  T* sdS = sP + M * N;                 // (M, N): dS
  float* sLse = reinterpret_cast<float*>(sdS + M * N);  // 2 x (M)
  float* sDelta = sLse + 2 * M;                         // 2 x (M)
  // The same tiles as shared-memory byte addresses, for ldmatrix.
  const uint32_t aK = smem_addr(sK), aV = smem_addr(sV), aQ = smem_addr(sQ),
                 adO = smem_addr(sdO), aP = smem_addr(sP), adS = smem_addr(sdS);

  const int tid = threadIdx.x;
  const int seq_t = static_cast<int>(p.t), seq_s = static_cast<int>(p.s);
  const int n_key_tiles = (seq_s + N - 1) / N;
  // Key tiles of one (b, kh) are adjacent in launch order (they share Q, dO in L2); key tile 0,
  // the longest under causal, goes first.
  const int key_tile = static_cast<int>(blockIdx.x % n_key_tiles);
  // 32-bit indices (the grid is < 2^31 CTAs); 64-bit only in the offsets they feed.
  const int bk = static_cast<int>(blockIdx.x) / n_key_tiles;
  const int kh = bk % static_cast<int>(p.kh), b = bk / static_cast<int>(p.kh);
  const int G = static_cast<int>(p.n / p.kh);  // query heads per kv head (group() is host-only)
  const int n0 = key_tile * N;

  // Causal: query tiles whose rows all precede key n0 see nothing of this tile. With variants,
  // the query tiles of KeyTile, and of those only the steps that next_live finds.
  int m_first = kCausal ? n0 / M : 0;
  int n_m = max(0, (seq_t + M - 1) / M - m_first);
  __shared__ std::conditional_t<kVariants, KeyTile<M, N>, NoVariants> kt;
  if constexpr (kVariants) {
    if (tid < 32) kt.init(p, b, kh * G, n0, tid);
    __syncthreads();
    m_first = kt.m_first;
    n_m = kt.n_m;
  }
  const int iters = static_cast<int>(G) * n_m;  // (query head, query tile) pairs
  // The rules of the current step's (head, query tile) and of the next one, written by warp 0
  // (it reads their operands from global memory once per step) and published by the barrier
  // at the top of the step; a dalibi partial per warp.
  __shared__ std::conditional_t<kVariants, FwdVariants<T, M, N>, NoVariants> vs[2];
  __shared__ float sAlibi[kVariants ? Cfg::kWarps : 1];
  int cur = 0;  // variants: the current step
  if constexpr (kVariants) {
    cur = kt.next_live(p, b, 0, iters, tid % 32);
    if (tid < 32 && cur < iters) kt.ready(p, vs[0], 0, b, cur, iters, tid);
  }

  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + kh * p.k_head_stride +
                n0 * p.k_row_stride;  // (N, D)
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + kh * p.v_head_stride +
                n0 * p.v_row_stride;  // (N, D)

  // Issues the cp.async loads of step `it` (query head, query tile) into buffer `buf`.
  auto load_step = [&](int it, int buf) {
    const int n = kh * G + it / n_m;
    const int m0 = (m_first + it % n_m) * M;
    const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride +
                  m0 * p.q_row_stride;  // (M, D)
    const T* gdO = static_cast<const T*>(p.dout) + b * p.do_batch_stride +
                   n * p.do_head_stride + m0 * p.do_row_stride;  // (M, D)
    T* tQ = sQ + buf * M * D;
    T* tdO = sdO + buf * M * D;
    // Recomputed each step: hoisting the per-thread 64-bit row offsets out of the main loop
    // would hold a dozen registers for a few integer ops.
    int t0 = tid;
    asm volatile("" : "+r"(t0));
#pragma unroll
    for (int k = 0; k < M * kChunks / kThreads; ++k) {
      const int i = t0 + k * kThreads, row = i / kChunks, col = i % kChunks * 8;
      const bool ok = m0 + row < seq_t;  // rows past T are zero-filled and masked
      const bool ok_q = ok && in_cols<kHeadDim, D>(col);  // and columns past H, Hv
      const bool ok_do = ok && in_cols<kHeadDimV, D>(col);
      cp_async_16(&tQ[swz<D>(row, col)], gQ + (ok_q ? row * p.q_row_stride + col : 0), ok_q);
      cp_async_16(&tdO[swz<D>(row, col)], gdO + (ok_do ? row * p.do_row_stride + col : 0), ok_do);
    }
    const int64_t bnt = (b * p.n + n) * p.t + m0;  // (B, N, T) row statistics
    if (tid < M) {
      const bool ok = m0 + tid < seq_t;
      cp_async_4(&sLse[buf * M + tid], p.lse + bnt + (ok ? tid : 0), ok);
      cp_async_4(&sDelta[buf * M + tid], p.delta + bnt + (ok ? tid : 0), ok);
    }
  };

  if (cur < iters) {
#pragma unroll
    for (int k = 0; k < N * kChunks / kThreads; ++k) {
      const int i = tid + k * kThreads, row = i / kChunks, col = i % kChunks * 8;
      const bool ok = n0 + row < seq_s;  // keys past S are zero-filled and masked
      const bool ok_k = ok && in_cols<kHeadDim, D>(col), ok_v = ok && in_cols<kHeadDimV, D>(col);
      cp_async_16(&sK[swz<D>(row, col)], gK + (ok_k ? row * p.k_row_stride + col : 0), ok_k);
      cp_async_16(&sV[swz<D>(row, col)], gV + (ok_v ? row * p.v_row_stride + col : 0), ok_v);
    }
    load_step(cur, 0);  // the first live step: 0 in the plain kernel, not always with ids
    cp_async_commit();
  }

  // The warp's blocks (first row, first column) of each GEMM's output (Tiles):
  //  S, dP: (kRowsS, 32) at (warp / kWarpsKeys * kRowsS, warp % kWarpsKeys * 32);
  //  dV, dK: (32, kColsKV) at (warp % kWarpsKeys * 32, warp / kWarpsKeys * kColsKV);
  //  dQ: (32, kColsdQ) at (warp % kWarpsMdQ * 32, warp / kWarpsMdQ * kColsdQ).
  float acc_dk[2][kNjKV][4] = {};  // the warp's (32, kColsKV) block of dK
  float acc_dv[2][kNjKV][4] = {};  // (32, kColsKV) of dV
  float dslope = 0.f;              // variants: this thread's share of dalibi of the current head

  for (int it = 0; kVariants ? cur < iters : it < iters; ++it) {
    const int buf = it & 1;
    // Step `it` has landed, and every warp is done with step it - 1 (sP, sdS are free).
    cp_async_wait<0>();
    __syncthreads();

    const int st = kVariants ? cur : it;  // the step: (query head, query tile)
    const int n = kh * G + st / n_m;
    const int m0 = (m_first + st % n_m) * M;
    int next = st + 1;
    if constexpr (kVariants) next = kt.next[buf];
    // The last step of head n in this CTA hands on its dalibi.
    const bool head_done = next >= iters || next / n_m != st / n_m;
    const uint32_t aQt = aQ + buf * M * D * 2, adOt = adO + buf * M * D * 2;  // (M, D) tiles
    const bool need_mask = (kCausal && m0 < n0 + N - 1) || m0 + M > seq_t || n0 + N > seq_s;
    const float* tLse = sLse + buf * M;
    const float* tDelta = sDelta + buf * M;

    {
      const Thread th(opaque(tid));
      const int g = th.g, tq = th.tq;
      const int s_q0 = th.warp / kWarpsKeys * Cfg::kRowsS, s_k0 = th.warp % kWarpsKeys * 32;
      const LdsmOffsets<D, Ldsm::kA> offA(th.lane);  // Q, dO as A
      const LdsmOffsets<D, Ldsm::kB> offB(th.lane);  // K, V as B
      // The lane's 32-bit slot of sP, sdS (M, N) in n8 tile j of m16 tile 0 is at row s_q0 + g,
      // column s_k0 + 8 j + 2 tq; rows + 8 and + 16 i keep the swizzle g.
      const uint32_t st_row = (s_q0 + g) * N * 2 + 4 * tq;
      // Element e of tile (i, j): query s_q0 + 16 i + g + 8 (e / 2), key s_k0 + 8 j + 2 tq + e % 2.

      // S = Q K^T: (kRowsS, 32) per warp; then P = exp2(S * scale_log2 - lse * log2e), masked,
      // to sP as T. For dS, P is read back from this thread's own sP slots plus the residue
      // kept as fp16 pairs in rP (p_residue: ~19 bits at 16 bits a register, where fp32 P next
      // to dP and the dK, dV accumulators spills). dS from a once-rounded P would miss
      // delta = rowsum(P dP) by a row-wise bias, which dbias sums over rows.
      // lse == -inf (no visible key) becomes +inf: P = 0.
      uint32_t rP[kMi][4][2];
      if constexpr (kVariants) {
        // Logits by the forward's rules (log2 units, -inf where invisible), P, and P keep to sP;
        // rP holds P's residue, -P where dropout drops it (p_residue), for dZ. The soft cap's
        // derivative waits as fp16 in this thread's own slots of sdS until dS replaces it.
        const FwdVariants<T, M, N>& v = vs[buf];
        const float inv_keep = 1.f / v.keep_scale;  // 1 without dropout
        float acc_s[kMi][4][4] = {};
        gemm_abt<T, kMi, D, D>(acc_s, aQt + s_q0 * D * 2, aK + s_k0 * D * 2, offA, offB);
        v.logits(p, acc_s, n0 + s_k0, s_q0, g, tq, [&](int i, int j, int c, float dcap) {
          sts_u16(adS + st_row + (16 * i + 8 * (c / 2)) * N * 2 + (((s_k0 / 8 + j) ^ g) << 4) +
                      2 * (c % 2),
                  __half_as_ushort(__float2half_rn(dcap)));
        });
#pragma unroll
        for (int i = 0; i < kMi; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int qr = s_q0 + 16 * i + 8 * h + g;
            const float lse = tLse[qr];
            const float lse_log2 = lse_log2_of(lse);
            const uint32_t row_hash = p.dropout_seeds ? v.drop_row(qr) : 0u;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              float pv[2], keep[2];
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                pv[c] = exp2_approx(acc_s[i][j][2 * h + c] - lse_log2);
                keep[c] = p.dropout_seeds ? v.keep(p, row_hash, n0 + s_k0 + 8 * j + 2 * tq + c) : 1.f;
              }
              const uint32_t at = st_row + (16 * i + 8 * h) * N * 2 + (((s_k0 / 8 + j) ^ g) << 4);
              sts_u32(aP + at, pack2<T>(pv[0] * keep[0], pv[1] * keep[1]));
              rP[i][j][h] = p_residue2<T>(pv[0], pv[1], keep[0], keep[1], inv_keep);
            }
          }
        }
      } else {
        float acc_s[kMi][4][4] = {};
        gemm_abt<T, kMi, D, D>(acc_s, aQt + s_q0 * D * 2, aK + s_k0 * D * 2, offA, offB);
#pragma unroll
        for (int i = 0; i < kMi; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int qr = s_q0 + 16 * i + 8 * h + g;
            const float lse = tLse[qr];
            const float lse_log2 = lse_log2_of(lse);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              float pv[2];
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                pv[c] = exp2_approx(acc_s[i][j][2 * h + c] * p.scale_log2 - lse_log2);
                if (need_mask) {
                  const int key = n0 + s_k0 + 8 * j + 2 * tq + c, query = m0 + qr;
                  const bool vis = key < seq_s && query < seq_t && (!kCausal || key <= query);
                  pv[c] = vis ? pv[c] : 0.f;
                }
              }
              const uint32_t at = st_row + (16 * i + 8 * h) * N * 2 + (((s_k0 / 8 + j) ^ g) << 4);
              sts_u32(aP + at, pack2<T>(pv[0], pv[1]));
              rP[i][j][h] = p_residue2<T>(pv[0], pv[1]);
            }
          }
        }
      }
      // dP = dO V^T: (kRowsS, 32) per warp; dS = P * (dP - delta) to sdS as T. Masked P are
      // 0, and so are their dS (dP, delta are finite: padded rows are zero-filled).
      if constexpr (kVariants) {
        // dZ = P * (dP keep - delta) in place of dP; dS = dZ * cap' to sdS; dZ feeds dalibi
        // (d Z / d slope = -|s - t - shift| = -|key - row - diag| in tile terms, as in logits)
        // and dbias.
        const FwdVariants<T, M, N>& v = vs[buf];
        const float inv_keep = 1.f / v.keep_scale;  // 1 without dropout
        float acc_dp[kMi][4][4] = {};
        gemm_abt<T, kMi, D, D>(acc_dp, adOt + s_q0 * D * 2, aV + s_k0 * D * 2, offA, offB);
        const int diag = clamp_diag(int64_t{m0} - (n0 + s_k0) + v.shift);
#pragma unroll
        for (int i = 0; i < kMi; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int qr = s_q0 + 16 * i + 8 * h + g;
            const float dl = tDelta[qr];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t at = st_row + (16 * i + 8 * h) * N * 2 + (((s_k0 / 8 + j) ^ g) << 4);
              const float2 pv = kept_p<T>(lds_u32(aP + at), rP[i][j][h], inv_keep);
              float2 cap = make_float2(1.f, 1.f);
              if (p.softcap > 0.f) {
                const uint32_t c2 = lds_u32(adS + at);
                cap = __half22float2(*reinterpret_cast<const __half2*>(&c2));
              }
              float ds[2];
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                float& dz = acc_dp[i][j][2 * h + c];
                dz = dz_of(c ? pv.y : pv.x, dz, v.keep_scale, dl);
                if (p.alibi_slopes)
                  dslope -= dz * fabsf(static_cast<float>(8 * j + 2 * tq + c - qr - diag));
                ds[c] = dz * (c ? cap.y : cap.x);
              }
              sts_u32(adS + at, pack2<T>(ds[0], ds[1]));
            }
          }
        }
        if (p.dbias)
          dbias_block<T, kMi>(p, acc_dp,
                              (v.bias - static_cast<const T*>(p.bias)) +
                                  s_q0 * p.bias_strides.row + (n0 + s_k0) * p.bias_strides.col,
                              seq_t - m0 - s_q0, seq_s - n0 - s_k0, g, tq);
        if (p.alibi_slopes && head_done) {
          float x = dslope;
          for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
          if (th.lane == 0) sAlibi[th.warp] = x;
          dslope = 0.f;
        }
      } else {
        float acc_dp[kMi][4][4] = {};
        gemm_abt<T, kMi, D, D>(acc_dp, adOt + s_q0 * D * 2, aV + s_k0 * D * 2, offA, offB);
#pragma unroll
        for (int i = 0; i < kMi; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float dl = tDelta[s_q0 + 16 * i + 8 * h + g];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t at = st_row + (16 * i + 8 * h) * N * 2 + (((s_k0 / 8 + j) ^ g) << 4);
              const float2 pv = kept_p<T>(lds_u32(aP + at), rP[i][j][h]);
              sts_u32(adS + at, pack2<T>(pv.x * (acc_dp[i][j][2 * h] - dl),
                                         pv.y * (acc_dp[i][j][2 * h + 1] - dl)));
            }
          }
        }
      }
    }
    __syncthreads();  // sP, sdS complete; every warp is done with the Q, dO of step it - 1

    // Prefetch the next step into the other buffer (last read by step it - 1's dV, dK).
    if (kVariants ? next < iters : it + 1 < iters) {  // the same, in the plain kernel's words
      load_step(kVariants ? next : it + 1, buf ^ 1);
      cp_async_commit();
    }
    if constexpr (kVariants) {
      if (tid < 32 && next < iters)  // buffer buf ^ 1 was last read by step it - 1
        kt.ready(p, vs[buf ^ 1], buf ^ 1, b, next, iters, tid);
      if (p.alibi_slopes && head_done && tid == 0) {  // the warps' partials, in a fixed order
        float x = 0.f;
        for (int w = 0; w < Cfg::kWarps; ++w) x += sAlibi[w];
        p.dalibi_accum[(int64_t{b} * p.n + n) * n_key_tiles + key_tile] = x;
      }
    }

    // dQ += dS K: (32, kColsdQ) per warp; k runs over the N keys, A = dS from (M, N) storage,
    // B = K from (N, D) storage (.trans).
    {
      constexpr int kNjdQ = Cfg::kColsdQ / 8;  // n8 tiles per warp
      const Thread th(opaque(tid));
      const int dq_q0 = th.warp % Cfg::kWarpsMdQ * 32;
      const int dq_d0 = th.warp / Cfg::kWarpsMdQ * Cfg::kColsdQ;
      const LdsmOffsets<N, Ldsm::kA> offdS(th.lane);                   // dS as A
      const LdsmCols<D, Ldsm::kA, kNjdQ / 2> offdQ(th.lane, dq_d0);  // K as B
      float acc_dq[2][kNjdQ][4] = {};
      gemm_ab<T, kNjdQ, N, N, D>(acc_dq, adS + dq_q0 * N * 2, aK, offdS, offdQ);
      // Deterministic: this query tile's earlier key tiles add first (dq_rank), each of them
      // one add per element, so every element sums in key tile order. CTAs wait only on CTAs
      // of lower index, which the hardware starts no later than them.
      int* turn = nullptr;
      if constexpr (kVariants) {
        if (p.deterministic) {
          turn = p.dq_turn + (int64_t{b} * p.n + n) * ((seq_t + M - 1) / M) + m0 / M;
          if (th.warp == 0) {
            const int rank = dq_rank(p, vs[buf], b, n, key_tile, n_key_tiles, th.lane);
            if (th.lane == 0)
              while (ld_acquire(turn) != rank) __nanosleep(64);
          }
          __syncthreads();
        }
      }
      // dq_accum is contiguous (B, T, N, D); rows past T and columns past H are not written.
      const int64_t row8 = 8 * p.n * D;  // 8 query rows further
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int q = m0 + dq_q0 + 16 * i + th.g;
        float* dqa = p.dq_accum + ((b * p.t + q) * p.n + n) * D + dq_d0 + 2 * th.tq;
#pragma unroll
        for (int j = 0; j < kNjdQ; ++j) {
          if (!in_cols<kHeadDim, D>(dq_d0 + 8 * j)) continue;
          if (q < seq_t) atomic_add2(dqa + j * 8, acc_dq[i][j][0], acc_dq[i][j][1]);
          if (q + 8 < seq_t) atomic_add2(dqa + row8 + j * 8, acc_dq[i][j][2], acc_dq[i][j][3]);
        }
      }
      if constexpr (kVariants) {
        if (p.deterministic) {  // every thread's adds, then the next key tile's turn
          __syncthreads();
          if (tid == 0) {
            __threadfence();
            atomicAdd(turn, 1);
          }
        }
      }
    }

    // dV += P^T dO, dK += dS^T Q: (32, kColsKV) per warp; k runs over the M queries.
    {
      const Thread th(opaque(tid));
      // P^T, dS^T as A; dO, Q as B
      const LdsmCols<N, Ldsm::kB, 2> offPt(th.lane, th.warp % kWarpsKeys * 32);
      const LdsmCols<D, Ldsm::kA, kNjKV / 2> offKV(th.lane, th.warp / kWarpsKeys * Cfg::kColsKV);
      gemm_atb<T, kNjKV, M, N, D>(acc_dv, aP, adOt, offPt, offKV);
      gemm_atb<T, kNjKV, M, N, D>(acc_dk, adS, aQt, offPt, offKV);
    }
    if constexpr (kVariants) cur = next;
  }

  // Epilogue: stage dK (scaled), dV as T through sK, sV, then 16-byte stores of the rows < S.
  // With no step at all (T == 0, or causal with every query before n0) they are zeros.
  cp_async_wait<0>();
  __syncthreads();
  const Thread th(tid);
  const int g = th.g, tq = th.tq, kv_k0 = th.warp % kWarpsKeys * 32;
  const int kv_d0 = th.warp / kWarpsKeys * Cfg::kColsKV;
  if (p.grads_f32) {  // fp32 pairs straight from the fragments (ring attention's partials)
    float* gdK = static_cast<float*>(p.dk) + b * p.dk_batch_stride + kh * p.dk_head_stride;
    float* gdV = static_cast<float*>(p.dv) + b * p.dv_batch_stride + kh * p.dv_head_stride;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = n0 + kv_k0 + 16 * i + 8 * h;
        if (key + g >= seq_s) continue;
#pragma unroll
        for (int j = 0; j < kNjKV; ++j) {
          const int col = kv_d0 + j * 8 + 2 * tq;
          const float* dk = acc_dk[i][j] + 2 * h;
          const float* dv = acc_dv[i][j] + 2 * h;
          if (in_cols<kHeadDim, D>(col))
            *reinterpret_cast<float2*>(gdK + (key + g) * p.dk_row_stride + col) =
                make_float2(dk[0] * p.scale, dk[1] * p.scale);
          if (in_cols<kHeadDimV, D>(col))
            *reinterpret_cast<float2*>(gdV + (key + g) * p.dv_row_stride + col) =
                make_float2(dv[0], dv[1]);
        }
      }
    return;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < kNjKV; ++j) {
      const int row = kv_k0 + 16 * i + g, col = kv_d0 + j * 8 + 2 * tq;
      *reinterpret_cast<uint32_t*>(&sK[swz<D>(row, col)]) =
          pack2<T>(acc_dk[i][j][0] * p.scale, acc_dk[i][j][1] * p.scale);
      *reinterpret_cast<uint32_t*>(&sK[swz<D>(row + 8, col)]) =
          pack2<T>(acc_dk[i][j][2] * p.scale, acc_dk[i][j][3] * p.scale);
      *reinterpret_cast<uint32_t*>(&sV[swz<D>(row, col)]) =
          pack2<T>(acc_dv[i][j][0], acc_dv[i][j][1]);
      *reinterpret_cast<uint32_t*>(&sV[swz<D>(row + 8, col)]) =
          pack2<T>(acc_dv[i][j][2], acc_dv[i][j][3]);
    }
  }
  __syncthreads();
  T* gdK = static_cast<T*>(p.dk) + b * p.dk_batch_stride + kh * p.dk_head_stride +
           n0 * p.dk_row_stride;  // (N, D)
  T* gdV = static_cast<T*>(p.dv) + b * p.dv_batch_stride + kh * p.dv_head_stride +
           n0 * p.dv_row_stride;  // (N, D)
#pragma unroll
  for (int k = 0; k < N * kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads, row = i / kChunks, col = i % kChunks * 8;
    if (n0 + row < seq_s) {  // the padding columns of dK, dV are not stored
      if (in_cols<kHeadDim, D>(col))
        *reinterpret_cast<uint4*>(gdK + row * p.dk_row_stride + col) =
            *reinterpret_cast<const uint4*>(&sK[swz<D>(row, col)]);
      if (in_cols<kHeadDimV, D>(col))
        *reinterpret_cast<uint4*>(gdV + row * p.dv_row_stride + col) =
            *reinterpret_cast<const uint4*>(&sV[swz<D>(row, col)]);
    }
  }
}

// cp.async of a (kRows, D) tile of 16-bit rows of kCols columns (row stride in elements) into
// the swizzled sX; rows at or past rows_left and columns at or past kCols are zero-filled.
template <int D, int kCols, int kRows, int kThreads, typename T>
__device__ __forceinline__ void load_rows(T* sX, const T* gX, int64_t row_stride, int rows_left,
                                          int tid) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int k = 0; k < kRows * kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads, row = i / kChunks, col = i % kChunks * 8;
    const bool ok = row < rows_left && in_cols<kCols, D>(col);
    cp_async_16(&sX[swz<D>(row, col)], gX + (ok ? row * row_stride + col : 0), ok);
  }
}

// Deterministic dbias of a bias with broadcast dims, where the main kernel's atomics would sum
// in an order that varies between runs. A CTA owns a tile of dbias, (M | 1, N | 1) elements of
// one (outer, batch | 1, head | 1), and visits the (b, n, query tile, key tile) blocks that add
// to it in a fixed order, recomputing P and dP (S = Q K^T, dP = dO V^T; the main kernel leaves
// dbias alone in this mode). Each thread sums its dZ fragment over the blocks; the CTA then
// reduces the tile over the broadcast rows and keys through shared memory, in a fixed order.
// Same tiles and warp layout as the main kernel's S and dP.
template <typename T, int kHeadDim, int kHeadDimV>
__global__ void __launch_bounds__(Tiles<kHeadDim>::kThreads, 1) dbias_kernel(const BwdParams p) {
  using Cfg = Tiles<kHeadDim>;
  constexpr int D = Cfg::kWidth, M = Cfg::kBlockM, N = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kMi = Cfg::kMiS;

  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // (N, D)
  T* sV = sK + N * D;                  // (N, D)
  T* sQ = sV + N * D;                  // (M, D)
  T* sdO = sQ + M * D;                 // (M, D)
  float* sLse = reinterpret_cast<float*>(sdO + M * D);  // (M)
  float* sDelta = sLse + M;                             // (M)
  float* sAcc = sDelta + M;  // (M, N): the threads' dZ sums, for the final reduction
  const uint32_t aK = smem_addr(sK), aV = smem_addr(sV), aQ = smem_addr(sQ), adO = smem_addr(sdO);

  const int tid = threadIdx.x;
  const Thread th(tid);
  const int g = th.g, tq = th.tq;
  const int s_q0 = th.warp / Cfg::kWarpsKeys * Cfg::kRowsS;  // the warp's S block
  const int s_k0 = th.warp % Cfg::kWarpsKeys * 32;
  const LdsmOffsets<D, Ldsm::kA> offA(th.lane);
  const LdsmOffsets<D, Ldsm::kB> offB(th.lane);
  const int seq_t = static_cast<int>(p.t), seq_s = static_cast<int>(p.s);
  const int q_tiles = (seq_t + M - 1) / M, key_tiles = (seq_s + N - 1) / N;
  const int G = static_cast<int>(p.n / p.kh);

  // The dbias tile: blockIdx.x enumerates (outer, batch, head, row tile, key tile), each dim
  // of size 1 where the bias broadcasts (a 0 stride).
  const BcastStrides& st = p.bias_strides;
  const int t_tiles = st.row ? q_tiles : 1, s_tiles = st.col ? key_tiles : 1;
  const int nb = st.batch ? static_cast<int>(p.batch_inner) : 1, nh = st.head ? static_cast<int>(p.n) : 1;
  int64_t rest = blockIdx.x;
  const int jt = static_cast<int>(rest % s_tiles);
  rest /= s_tiles;
  const int mt = static_cast<int>(rest % t_tiles);
  rest /= t_tiles;
  const int hn = static_cast<int>(rest % nh);
  rest /= nh;
  const int bb = static_cast<int>(rest % nb);
  const int64_t ov = rest / nb;
  // Its contributors: every batch, head, query tile, key tile the bias broadcasts over.
  const int cb = st.batch ? 1 : static_cast<int>(p.batch_inner), cn = st.head ? 1 : static_cast<int>(p.n);
  const int cm = st.row ? 1 : q_tiles, cj = st.col ? 1 : key_tiles;
  const int64_t count = int64_t{cb} * cn * cm * cj;

  __shared__ FwdVariants<T, M, N> vs[2];
  float acc_db[kMi][4][4] = {};
  for (int64_t c = 0; c < count; ++c) {
    const int j = st.col ? jt : static_cast<int>(c % cj);
    const int m = st.row ? mt : static_cast<int>(c / cj % cm);
    const int n = st.head ? hn : static_cast<int>(c / (int64_t{cj} * cm) % cn);
    const int bi = st.batch ? bb : static_cast<int>(c / (int64_t{cj} * cm * cn));
    const int64_t b = ov * p.batch_inner + bi;
    const int m0 = m * M, n0 = j * N;
    // vs[c % 2] was last read in step c - 2, before the barrier that ended step c - 1.
    FwdVariants<T, M, N>& v = vs[c % 2];
    if (tid < 32) v.init(p, b, n, m0, tid);
    __syncthreads();  // v is set; every warp is done with the previous block's tiles
    bool live = n0 < v.key_hi && n0 + N > v.key_lo;  // the exact key range of the query tile
    if (live && p.q_segment_ids) {
      const int* r = p.kv_seg_range + (b * key_tiles + j) * 2;
      live = seg_meet(make_int2(r[0], r[1]), make_int2(v.q_seg_min, v.q_seg_max));
    }
    if (!live) continue;
    const int64_t kvh = n / G;
    const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride;
    const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride;
    const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
    const T* gdO = static_cast<const T*>(p.dout) + b * p.do_batch_stride + n * p.do_head_stride;
    load_rows<D, kHeadDim, N, kThreads>(sK, gK + n0 * p.k_row_stride, p.k_row_stride,
                                        seq_s - n0, tid);
    load_rows<D, kHeadDimV, N, kThreads>(sV, gV + n0 * p.v_row_stride, p.v_row_stride,
                                         seq_s - n0, tid);
    load_rows<D, kHeadDim, M, kThreads>(sQ, gQ + m0 * p.q_row_stride, p.q_row_stride,
                                        seq_t - m0, tid);
    load_rows<D, kHeadDimV, M, kThreads>(sdO, gdO + m0 * p.do_row_stride, p.do_row_stride,
                                         seq_t - m0, tid);
    if (tid < M) {
      const int64_t bnt = (b * p.n + n) * p.t + m0;
      const bool ok = m0 + tid < seq_t;
      cp_async_4(&sLse[tid], p.lse + bnt + (ok ? tid : 0), ok);
      cp_async_4(&sDelta[tid], p.delta + bnt + (ok ? tid : 0), ok);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // S -> logits -> P, signed as in the main kernel (negative where dropout drops it).
    float acc_s[kMi][4][4] = {};
    gemm_abt<T, kMi, D, D>(acc_s, aQ + s_q0 * D * 2, aK + s_k0 * D * 2, offA, offB);
    v.logits(p, acc_s, n0 + s_k0, s_q0, g, tq);
    float acc_dp[kMi][4][4] = {};
    gemm_abt<T, kMi, D, D>(acc_dp, adO + s_q0 * D * 2, aV + s_k0 * D * 2, offA, offB);
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qr = s_q0 + 16 * i + 8 * h + g;
        const float lse = sLse[qr], dl = sDelta[qr];
        const float lse_log2 = lse_log2_of(lse);
        const uint32_t row_hash = p.dropout_seeds ? v.drop_row(qr) : 0u;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = s_k0 + 8 * jj + 2 * tq + e;
            const float pv = exp2_approx(acc_s[i][jj][2 * h + e] - lse_log2);
            const float keep = p.dropout_seeds ? v.keep(p, row_hash, n0 + key) : 1.f;
            // elements past T or S do not exist (their dZ may be NaN: 0 * (NaN dP))
            if (m0 + qr < seq_t && n0 + key < seq_s)
              acc_db[i][jj][2 * h + e] += dz_of(keep == 0.f ? -pv : pv, acc_dp[i][jj][2 * h + e],
                                                v.keep_scale, dl);
          }
      }
  }

  // Reduce the tile over the broadcast keys (a row sum per query row) and rows, in order.
#pragma unroll
  for (int i = 0; i < kMi; ++i)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sAcc[(s_q0 + 16 * i + 8 * (e / 2) + g) * N + s_k0 + 8 * jj + 2 * tq + e % 2] = acc_db[i][jj][e];
  __syncthreads();
  if (!st.col) {  // row r's sum to sAcc[r, 0]
    if (tid < M) {
      float x = 0.f;
      for (int k = 0; k < N; ++k) x += sAcc[tid * N + k];
      sAcc[tid * N] = x;
    }
    __syncthreads();
  }
  const int keys_out = st.col ? N : 1, rows_out = st.row ? M : 1;
  if (!st.row) {  // key k's sum to sAcc[0, k]
    if (tid < keys_out) {
      float x = 0.f;
      for (int r = 0; r < M; ++r) x += sAcc[r * N + tid];
      sAcc[tid] = x;
    }
    __syncthreads();
  }
  const int m0t = mt * M, n0t = jt * N;
  T* dst = static_cast<T*>(p.dbias) + ov * st.outer + bb * st.batch + hn * st.head +
           m0t * st.row + n0t * st.col;
  for (int i = tid; i < rows_out * keys_out; i += kThreads) {
    const int r = i / keys_out, k = i % keys_out;
    if (m0t + r < seq_t && n0t + k < seq_s)
      dst[r * st.row + k * st.col] = static_cast<T>(sAcc[r * N + k]);
  }
}

// kv_seg_range[b, j] = key_tile_seg of key tile j, one warp per (b, j).
template <int N>
__global__ void __launch_bounds__(256) key_tile_seg_kernel(const BwdParams p, int n_key_tiles) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (idx >= p.b * n_key_tiles) return;  // whole warps
  const int64_t b = idx / n_key_tiles;
  const int j = static_cast<int>(idx % n_key_tiles);
  const int2 r = key_tile_seg<N>(p, b, j * N, threadIdx.x % 32);
  if (threadIdx.x % 32 == 0) {
    p.kv_seg_range[2 * idx] = r.x;
    p.kv_seg_range[2 * idx + 1] = r.y;
  }
}

// dbias = dbias_accum, cast to T (both in the bias's layout).
template <typename T>
__global__ void __launch_bounds__(256) convert_dbias_kernel(const BwdParams p, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    static_cast<T*>(p.dbias)[i] = static_cast<T>(p.dbias_accum[i]);
}

// dalibi[b, n] = the sum of dalibi_accum[b, n, :] over the key tiles, in order.
static __global__ void __launch_bounds__(256) reduce_dalibi_kernel(const BwdParams p, int n_key_tiles) {
  const int64_t bn = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bn >= p.b * p.n) return;
  float x = 0.f;
  for (int j = 0; j < n_key_tiles; ++j) x += p.dalibi_accum[bn * n_key_tiles + j];
  p.dalibi[bn] = x;
}

// kv_seg_range for the deterministic dQ ranks (bwd_workspace: with segment ids only).
template <int N>
void launch_key_tile_seg(const BwdParams& p, int64_t key_tiles, cudaStream_t stream) {
  if (p.b * key_tiles > 0)
    key_tile_seg_kernel<N><<<static_cast<unsigned>((p.b * key_tiles + 7) / 8), 256, 0, stream>>>(
        p, static_cast<int>(key_tiles));
}

template <typename Kernel>
void launch_main(Kernel kernel, const BwdParams& p, int64_t ctas, int threads, int smem,
                 cudaStream_t stream) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<static_cast<unsigned>(ctas), threads, smem, stream>>>(p);
}

// The passes before and after the main kernel (also the sm90 backward's): delta and
// dq_accum = 0 (with p.t_pad the padded lse and delta rows too), then dq from dq_accum, the
// latter as a dependent launch (`dependent`: the sm90 backward, right after its main kernel).
template <typename T, int kHeadDim, int kHeadDimV>
void launch_preprocess(const BwdParams& p, cudaStream_t stream) {
  using Rows = PreRows<kHeadDim>;
  const int64_t rows = p.b * p.t * p.n;  // (b, t, n) rows of q, o, dq
  const int64_t lse_rows = p.t_pad ? p.b * p.n * p.t_pad : 0;
  const int64_t lse_blocks = (lse_rows + Rows::kThreads - 1) / Rows::kThreads;
  if (rows > 0)
    preprocess_kernel<T, kHeadDim, kHeadDimV>
        <<<static_cast<unsigned>(Rows::blocks(rows) + lse_blocks), Rows::kThreads, 0, stream>>>(p);
}

template <typename T, int kHeadDim>
void launch_convert_dq(const BwdParams& p, cudaStream_t stream, bool dependent = false) {
  using Rows = RowChunks<Tiles<kHeadDim>::kWidth>;
  const int64_t rows = p.b * p.t * p.n;
  if (rows == 0) return;
  if (dependent)
    launch_dependent(convert_dq_kernel<T, kHeadDim>, Rows::blocks(rows), Rows::kThreads, 0, stream,
                     p);
  else
    convert_dq_kernel<T, kHeadDim>
        <<<static_cast<unsigned>(Rows::blocks(rows)), Rows::kThreads, 0, stream>>>(p);
}

}  // namespace bwd

template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_bwd(const BwdParams& p, cudaStream_t stream) {
  using Cfg = bwd::Tiles<kHeadDim>;
  bwd::launch_preprocess<T, kHeadDim, kHeadDimV>(p, stream);
  // Runs even when T == 0: dK, dV must then come out zero.
  const int64_t key_tiles = (p.s + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int64_t ctas = key_tiles * p.kh * p.b;
  const bool variants = live_variant(p) || p.deterministic;
  const BwdWorkspace w = bwd_workspace(p);
  if (variants) {
    // Elements no CTA visits (skipped tiles) keep these zeros; the turns start at 0.
    if (p.dbias && dbias_direct(p))
      cudaMemsetAsync(p.dbias, 0, bias_elements(p) * sizeof(T), stream);
    if (w.dbias_accum) cudaMemsetAsync(p.dbias_accum, 0, w.dbias_accum * sizeof(float), stream);
    if (w.dalibi_accum) cudaMemsetAsync(p.dalibi_accum, 0, w.dalibi_accum * sizeof(float), stream);
    if (w.dq_turn) cudaMemsetAsync(p.dq_turn, 0, w.dq_turn * sizeof(int), stream);
    if (w.kv_seg_range) bwd::launch_key_tile_seg<Cfg::kBlockN>(p, key_tiles, stream);
  }
  // Deterministic with a broadcast bias: dbias_kernel computes dbias, the main kernel not.
  const bool dbias_tiles = p.bias && p.deterministic && !dbias_direct(p);
  BwdParams pm = p;
  if (dbias_tiles) pm.dbias = nullptr;
  if (ctas > 0 && variants)
    bwd::launch_main(bwd::main_kernel<T, kHeadDim, kHeadDimV, false, true>, pm, ctas, Cfg::kThreads,
                     Cfg::kSmemBytes, stream);
  else if (ctas > 0)
    bwd::launch_main(bwd::main_kernel<T, kHeadDim, kHeadDimV, kCausal, false>, p, ctas, Cfg::kThreads,
                     Cfg::kSmemBytes, stream);
  bwd::launch_convert_dq<T, kHeadDim>(p, stream);
  if (dbias_tiles) {
    const BcastStrides& st = p.bias_strides;
    const int64_t tiles = p.b / p.batch_inner * (st.batch ? p.batch_inner : 1) *
                          (st.head ? p.n : 1) * (st.row ? (p.t + Cfg::kBlockM - 1) / Cfg::kBlockM : 1) *
                          (st.col ? key_tiles : 1);
    const int smem = (2 * Cfg::kBlockN + 2 * Cfg::kBlockM) * Cfg::kWidth * 2 +
                     (2 + Cfg::kBlockN) * Cfg::kBlockM * static_cast<int>(sizeof(float));
    bwd::launch_main(bwd::dbias_kernel<T, kHeadDim, kHeadDimV>, p, tiles, Cfg::kThreads, smem, stream);
  }
  if (w.dbias_accum)
    bwd::convert_dbias_kernel<T><<<static_cast<unsigned>(min(w.dbias_accum / 256 + 1, int64_t{4096})),
                                   256, 0, stream>>>(p, w.dbias_accum);
  if (w.dalibi_accum)
    bwd::reduce_dalibi_kernel<<<static_cast<unsigned>((p.b * p.n + 255) / 256), 256, 0, stream>>>(
        p, static_cast<int>(key_tiles));
}

}  // namespace jaxflash::cuda
