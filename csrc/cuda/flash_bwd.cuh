// FlashAttention-2 backward for sm80+ (mma.sync m16n8k16, ldmatrix, cp.async), in three kernels:
//   1. preprocess: delta = rowsum(dO * O) - dlse (B, N, T) and dq_accum = 0 (B, T, N, H);
//   2. main, K/V-stationary: one CTA per (key tile, kv head, batch) keeps its K, V tile and its
//      dK, dV accumulators on chip and loops over the G query heads of its group and over the
//      query tiles; dQ is accumulated with fp32 atomics into dq_accum;
//   3. convert: dq = scale * dq_accum, cast to T.
// Math per query tile (the CPU bwd_typed, tile by tile; P is the forward's softmax, recomputed):
//   S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse * log2e), dP^T = V dO^T,
//   dS^T = P^T * (dP^T - delta), dV += P^T dO, dK += dS^T Q, dQ += dS K;
//   the softmax scale is applied to dK at the end and to dQ in the convert kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launch.h"
#include "mma.cuh"

namespace jaxflash::cuda {
namespace bwd {

// Tiles. Each of the 8 warps owns 16 keys of the key tile (one mma M tile), so:
//  * S^T and dP^T come out of the mma in the layout the dV and dK mmas take as their A operand:
//    P and dS reach dV, dK straight from registers (only dS^T goes through smem, for dQ);
//  * the warp's dK, dV accumulators (2 * 16 * H fp32) are private, no cross-warp reduction.
// fp32 accumulators per thread: dK + dV = 2 * 16 * H / 32 = H, plus S^T + dP^T of a sub-block of
// kSubM queries = kSubM: 160 at H = 128 fits 255 registers with the fragments and addresses
// (whole 64-query tiles, 192, spilled, and so did kSubM = 64 at H = 64 on sm80). kBlockM is then
// bound by shared memory:
//  * H = 128: kBlockM = 64 (as FA2): (2*128*128 + 4*64*128 + 128*64) * 2 B + 1 KB = 145 KB;
//    128 would need 226 KB, over the A100's 163 KB;
//  * H = 64: kBlockM = 128, halving the barriers per FLOP:
//    (2*128*64 + 4*128*64 + 128*128) * 2 B + 2 KB = 130 KB.
// One CTA of 8 warps per SM on the A100 and the H100 (227 KB).
template <int kHeadDim>
struct Tiles {
  static constexpr int kBlockN = 128;                     // keys per CTA
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;  // queries per step
  static constexpr int kSubM = 32;  // queries per S^T/dP^T sub-block (registers, see above)
  static constexpr int kWarps = kBlockN / 16;
  static constexpr int kThreads = kWarps * 32;
  // dQ = dS K is a (kBlockM, H) tile: warps split it kWarpsMdQ x kWarpsDdQ, 16 rows each.
  static constexpr int kWarpsMdQ = kBlockM / 16;
  static constexpr int kWarpsDdQ = kWarps / kWarpsMdQ;
  static constexpr int kColsdQ = kHeadDim / kWarpsDdQ;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 only");
  static_assert(kWarps % kWarpsMdQ == 0 && kColsdQ % 64 == 0, "dQ warp layout");
  static_assert(kBlockM * kHeadDim / 8 % kThreads == 0 && kBlockM <= kThreads, "copy loops");

  static constexpr int kSmemBytes =
      (2 * kBlockN * kHeadDim + 4 * kBlockM * kHeadDim + kBlockN * kBlockM) * 2 +
      4 * kBlockM * static_cast<int>(sizeof(float));
};

// Element offset of (row, col) in a row-major (rows, kCols) smem tile of 16-bit values whose
// 16-byte chunks are XOR-swizzled by row % 8: the 8 rows an ldmatrix reads, or a warp stores
// from an mma fragment, fall in 8 different bank groups (no bank conflicts).
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(kCols % 64 == 0, "a row must span at least 8 chunks");
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

__device__ __forceinline__ float exp2_fast(float x) {  // 2^-inf = 0, NaN stays NaN
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
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

// Rows (b, t, n) of a BTNH tensor handled by 8-element (16-byte) chunks, kHeadDim / 8 lanes per
// row; these lanes are adjacent in one warp.
template <int kHeadDim>
struct RowChunks {
  static constexpr int kLanes = kHeadDim / 8;
  static constexpr int kThreads = 256;
  static int64_t blocks(int64_t rows) { return (rows * kLanes + kThreads - 1) / kThreads; }
};

// delta[b, n, t] = sum_d dout[b, t, n, d] * o[b, t, n, d] - dlse[b, n, t]; dq_accum[b, t, n] = 0.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(RowChunks<kHeadDim>::kThreads)
    preprocess_kernel(const BwdParams p) {
  constexpr int kLanes = RowChunks<kHeadDim>::kLanes;
  const int64_t rows = p.b * p.t * p.n;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / kLanes;  // (b * T + t) * N + n
  const int c = static_cast<int>(idx % kLanes);
  const bool valid = row < rows;
  const int64_t n = row % p.n, t = (row / p.n) % p.t, b = row / (p.n * p.t);

  float acc = 0.f;
  if (valid) {
    const uint4 o = *reinterpret_cast<const uint4*>(
        static_cast<const T*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride +
        n * p.o_head_stride + c * 8);
    const uint4 d = *reinterpret_cast<const uint4*>(
        static_cast<const T*>(p.dout) + b * p.do_batch_stride + t * p.do_row_stride +
        n * p.do_head_stride + c * 8);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 of = unpack2<T>(ow[i]), df = unpack2<T>(dw[i]);
      acc += of.x * df.x + of.y * df.y;
    }
    float4* dqa = reinterpret_cast<float4*>(p.dq_accum + row * kHeadDim + c * 8);
    dqa[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    dqa[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // Every lane takes part in the shuffles; kLanes divides 32, so a row never straddles warps.
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && c == 0) {
    const int64_t bnt = (b * p.n + n) * p.t + t;
    p.delta[bnt] = acc - p.dlse[bnt];
  }
}

// dq[b, t, n] = scale * dq_accum[b, t, n], cast to T.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(RowChunks<kHeadDim>::kThreads)
    convert_dq_kernel(const BwdParams p) {
  constexpr int kLanes = RowChunks<kHeadDim>::kLanes;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / kLanes;
  const int c = static_cast<int>(idx % kLanes);
  if (row >= p.b * p.t * p.n) return;
  const int64_t n = row % p.n, t = (row / p.n) % p.t, b = row / (p.n * p.t);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row * kHeadDim + c * 8);
  const float4 x = src[0], y = src[1];
  const float s = p.scale;
  uint4 out;
  out.x = pack2<T>(x.x * s, x.y * s);
  out.y = pack2<T>(x.z * s, x.w * s);
  out.z = pack2<T>(y.x * s, y.y * s);
  out.w = pack2<T>(y.z * s, y.w * s);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + b * p.dq_batch_stride + t * p.dq_row_stride +
                            n * p.dq_head_stride + c * 8) = out;
}

// ldmatrix on 32-bit shared-memory addresses: precomputed per-lane offsets stay one register each.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
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

template <typename T, int kHeadDim, bool kCausal>
__global__ void __launch_bounds__(Tiles<kHeadDim>::kThreads, 1) main_kernel(const BwdParams p) {
  using Cfg = Tiles<kHeadDim>;
  constexpr int D = kHeadDim, M = Cfg::kBlockM, N = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kSubM = Cfg::kSubM;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row of Q, dO, K, V
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // (N, D)
  T* sV = sK + N * D;                  // (N, D)
  T* sQ = sV + N * D;                  // 2 x (M, D): double buffer
  T* sdO = sQ + 2 * M * D;             // 2 x (M, D)
  T* sdS = sdO + 2 * M * D;            // (N, M): dS^T of the current query tile
  float* sLse = reinterpret_cast<float*>(sdS + N * M);  // 2 x (M)
  float* sDelta = sLse + 2 * M;                         // 2 x (M)
  // The same tiles as shared-memory byte addresses, for ldmatrix.
  const uint32_t aK = smem_addr(sK), aV = smem_addr(sV), aQ = smem_addr(sQ),
                 adO = smem_addr(sdO), adS = smem_addr(sdS);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, tq = lane % 4;  // fragment row (and row + 8), column pair 2 * tq
  const int seq_t = static_cast<int>(p.t), seq_s = static_cast<int>(p.s);
  const int n_key_tiles = (seq_s + N - 1) / N;
  // Key tiles of one (b, kh) are adjacent in launch order (they share Q, dO in L2); key tile 0,
  // the longest under causal, goes first.
  const int key_tile = static_cast<int>(blockIdx.x % n_key_tiles);
  const int64_t bk = blockIdx.x / n_key_tiles;
  const int64_t kh = bk % p.kh, b = bk / p.kh;
  const int64_t G = p.n / p.kh;  // query heads per kv head (group() is host-only)
  const int n0 = key_tile * N;

  // Causal: query tiles whose rows all precede key n0 see nothing of this tile.
  const int m_first = kCausal ? n0 / M : 0;
  const int n_m = max(0, (seq_t + M - 1) / M - m_first);
  const int iters = static_cast<int>(G) * n_m;  // (query head, query tile) pairs

  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + kh * p.k_head_stride +
                n0 * p.k_row_stride;  // (N, D)
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + kh * p.v_head_stride +
                n0 * p.v_row_stride;  // (N, D)

  // Issues the cp.async loads of step `it` (query head, query tile) into buffer `buf`.
  auto load_step = [&](int it, int buf) {
    const int64_t n = kh * G + it / n_m;
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
      const bool ok = m0 + row < seq_t;  // rows past T are zero-filled, never read
      cp_async_16(&tQ[swz<D>(row, col)], gQ + (ok ? row * p.q_row_stride + col : 0), ok);
      cp_async_16(&tdO[swz<D>(row, col)], gdO + (ok ? row * p.do_row_stride + col : 0), ok);
    }
    const int64_t bnt = (b * p.n + n) * p.t + m0;  // (B, N, T) row statistics
    if (tid < M) {
      const bool ok = m0 + tid < seq_t;
      cp_async_4(&sLse[buf * M + tid], p.lse + bnt + (ok ? tid : 0), ok);
      cp_async_4(&sDelta[buf * M + tid], p.delta + bnt + (ok ? tid : 0), ok);
    }
  };

  if (iters > 0) {
#pragma unroll
    for (int k = 0; k < N * kChunks / kThreads; ++k) {
      const int i = tid + k * kThreads, row = i / kChunks, col = i % kChunks * 8;
      const bool ok = n0 + row < seq_s;  // keys past S are zero-filled and masked
      cp_async_16(&sK[swz<D>(row, col)], gK + (ok ? row * p.k_row_stride + col : 0), ok);
      cp_async_16(&sV[swz<D>(row, col)], gV + (ok ? row * p.v_row_stride + col : 0), ok);
    }
    load_step(0, 0);
    cp_async_commit();
  }

  const int kw = warp * 16;  // this warp's first key in the tile
  const LdsmOffsets<D, Ldsm::kA> offA(lane);  // on K, V, Q, dO tiles
  const LdsmOffsets<D, Ldsm::kB> offB(lane);
  // dQ = dS K: (M, D) split over warps as (16, kColsdQ) tiles at query wm, column wd.
  constexpr int kColsdQ = Cfg::kColsdQ;
  const int wm = warp % Cfg::kWarpsMdQ * 16, wd = warp / Cfg::kWarpsMdQ * kColsdQ;
  // This warp's A = dS (queries wm.., k16 keys) from the (N, M) dS^T tile: one block column.
  const uint32_t adS_warp =
      adS + (ldsm_row<Ldsm::kB>(lane) * M +
             (((wm / 8 + ldsm_chunk<Ldsm::kB>(lane)) ^ (lane & 7)) << 3)) * 2;

  const uint32_t adS_rows = adS + (kw + g) * M * 2;  // this lane's dS^T row in sdS

  float acc_dk[D / 8][4] = {};  // (16, D) of dK for keys kw.., n8 tiles along D
  float acc_dv[D / 8][4] = {};  // (16, D) of dV

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    // Prefetch the next step into the other buffer: its last readers (the previous step's
    // S/dP/dV/dK) all passed the barrier before that step's dQ.
    if (it + 1 < iters) {
      load_step(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const int64_t n = kh * G + it / n_m;
    const int m0 = (m_first + it % n_m) * M;
    const uint32_t aQt = aQ + buf * M * D * 2, adOt = adO + buf * M * D * 2;  // (M, D) tiles
    const uint32_t aKw = aK + kw * D * 2, aVw = aV + kw * D * 2;  // the warp's 16 keys
    const bool need_mask = (kCausal && m0 < n0 + N - 1) || m0 + M > seq_t || n0 + N > seq_s;
    const float* tLse = sLse + buf * M;
    const float* tDelta = sDelta + buf * M;

    // The M queries go in sub-blocks of kSubM: S^T and dP^T of one sub-block (kSubM fp32
    // registers) are live next to the dK, dV accumulators, never those of the whole tile.
#pragma unroll 1
    for (int sub = 0; sub < M / kSubM; ++sub) {
      const int ms = sub * kSubM;  // first query of the sub-block in the tile
      // S^T = K Q^T: (16, kSubM) per warp; A = K rows kw.., B = Q^T from (M, D) storage.
      float acc_s[kSubM / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4(a, aKw + offA(kk * 16));
#pragma unroll
        for (int j = 0; j < kSubM / 16; ++j) {
          uint32_t bq[4];
          ldsm_x4(bq, aQt + (ms + j * 16) * D * 2 + offB(kk * 16));
          mma_16816<T>(acc_s[2 * j], a, {bq[0], bq[1]});
          mma_16816<T>(acc_s[2 * j + 1], a, {bq[2], bq[3]});
        }
      }
      // dP^T = V dO^T: (16, kSubM) per warp.
      float acc_dp[kSubM / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4(a, aVw + offA(kk * 16));
#pragma unroll
        for (int j = 0; j < kSubM / 16; ++j) {
          uint32_t bo[4];
          ldsm_x4(bo, adOt + (ms + j * 16) * D * 2 + offB(kk * 16));
          mma_16816<T>(acc_dp[2 * j], a, {bo[0], bo[1]});
          mma_16816<T>(acc_dp[2 * j + 1], a, {bo[2], bo[3]});
        }
      }

      // P^T = exp2(S^T * scale_log2 - lse * log2e), dS^T = P^T * (dP^T - delta), elementwise.
      // Element e of n8 tile j: key kw + g + 8 * (e / 2), query ms + j * 8 + 2 * tq + e % 2.
      // lse == -inf (no visible key) becomes +inf so that P = 0.
#pragma unroll
      for (int j = 0; j < kSubM / 8; ++j) {
        const int qc = ms + j * 8 + 2 * tq;
        const float2 lse2 = *reinterpret_cast<const float2*>(&tLse[qc]);
        const float2 dl2 = *reinterpret_cast<const float2*>(&tDelta[qc]);
        const float lse_log2[2] = {lse2.x == -INFINITY ? INFINITY : lse2.x * kLog2e,
                                   lse2.y == -INFINITY ? INFINITY : lse2.y * kLog2e};
        const float dl[2] = {dl2.x, dl2.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = exp2_fast(acc_s[j][e] * p.scale_log2 - lse_log2[e % 2]);
          float ds = pv * (acc_dp[j][e] - dl[e % 2]);
          if (need_mask) {
            const int key = n0 + kw + g + 8 * (e / 2), query = m0 + qc + e % 2;
            const bool vis = key < seq_s && query < seq_t && (!kCausal || key <= query);
            pv = vis ? pv : 0.f;
            ds = vis ? ds : 0.f;
          }
          acc_s[j][e] = pv;
          acc_dp[j][e] = ds;
        }
      }
      // C fragments of n8 tiles 2kk, 2kk+1 are the A fragment of k16 step kk.
      uint32_t rP[kSubM / 16][4], rdS[kSubM / 16][4];  // (16, kSubM) as T
#pragma unroll
      for (int kk = 0; kk < kSubM / 16; ++kk) {
        rP[kk][0] = pack2<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
        rP[kk][1] = pack2<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
        rP[kk][2] = pack2<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
        rP[kk][3] = pack2<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
        rdS[kk][0] = pack2<T>(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
        rdS[kk][1] = pack2<T>(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
        rdS[kk][2] = pack2<T>(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
        rdS[kk][3] = pack2<T>(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
      }
      // dS^T -> sdS (N, M) for the dQ mma, which contracts over all warps' keys; rows kw + g
      // and kw + g + 8 share the swizzle g.
#pragma unroll
      for (int c = 0; c < kSubM / 8; ++c) {
        const uint32_t at = adS_rows + ((((ms / 8 + c) ^ g) << 3) + 2 * tq) * 2;
        sts_u32(at, rdS[c / 2][2 * (c % 2)]);
        sts_u32(at + 8 * M * 2, rdS[c / 2][2 * (c % 2) + 1]);
      }

      // dV += P^T dO: (16, D); k runs over the sub-block's queries, B = dO (.trans).
#pragma unroll
      for (int kk = 0; kk < kSubM / 16; ++kk) {
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          uint32_t bo[4];
          ldsm_x4_trans(bo, adOt + (ms + kk * 16) * D * 2 + offA(j * 16));
          mma_16816<T>(acc_dv[2 * j], rP[kk], {bo[0], bo[1]});
          mma_16816<T>(acc_dv[2 * j + 1], rP[kk], {bo[2], bo[3]});
        }
      }
      // dK += dS^T Q: (16, D).
#pragma unroll
      for (int kk = 0; kk < kSubM / 16; ++kk) {
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          uint32_t bq[4];
          ldsm_x4_trans(bq, aQt + (ms + kk * 16) * D * 2 + offA(j * 16));
          mma_16816<T>(acc_dk[2 * j], rdS[kk], {bq[0], bq[1]});
          mma_16816<T>(acc_dk[2 * j + 1], rdS[kk], {bq[2], bq[3]});
        }
      }
    }
    __syncthreads();  // sdS complete

    // dQ += dS K: (16, kColsdQ) per warp; k runs over the N keys, A = dS from (N, M) storage
    // (.trans), B = K from (N, D) storage (.trans).
    {
      float acc_dq[kColsdQ / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < N / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4_trans(a, adS_warp + kk * 16 * M * 2);
#pragma unroll
        for (int j = 0; j < kColsdQ / 16; ++j) {
          uint32_t bk4[4];
          ldsm_x4_trans(bk4, aK + kk * 16 * D * 2 + wd * 2 + offA(j * 16));
          mma_16816<T>(acc_dq[2 * j], a, {bk4[0], bk4[1]});
          mma_16816<T>(acc_dq[2 * j + 1], a, {bk4[2], bk4[3]});
        }
      }
      // dq_accum is contiguous (B, T, N, H); rows past T are not written.
      const int q0 = m0 + wm + g;
      float* dqa = p.dq_accum + ((b * p.t + q0) * p.n + n) * D + wd + 2 * tq;
      const int64_t row8 = 8 * p.n * D;  // 8 query rows further
#pragma unroll
      for (int j = 0; j < kColsdQ / 8; ++j) {
        if (q0 < seq_t) atomic_add2(dqa + j * 8, acc_dq[j][0], acc_dq[j][1]);
        if (q0 + 8 < seq_t) atomic_add2(dqa + row8 + j * 8, acc_dq[j][2], acc_dq[j][3]);
      }
    }
  }

  // Epilogue: stage dK (scaled), dV as T through sK, sV, then 16-byte stores of the rows < S.
  // With no step at all (T == 0, or causal with every query before n0) they are zeros.
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int col = j * 8 + 2 * tq;
    *reinterpret_cast<uint32_t*>(&sK[swz<D>(kw + g, col)]) =
        pack2<T>(acc_dk[j][0] * p.scale, acc_dk[j][1] * p.scale);
    *reinterpret_cast<uint32_t*>(&sK[swz<D>(kw + g + 8, col)]) =
        pack2<T>(acc_dk[j][2] * p.scale, acc_dk[j][3] * p.scale);
    *reinterpret_cast<uint32_t*>(&sV[swz<D>(kw + g, col)]) = pack2<T>(acc_dv[j][0], acc_dv[j][1]);
    *reinterpret_cast<uint32_t*>(&sV[swz<D>(kw + g + 8, col)]) =
        pack2<T>(acc_dv[j][2], acc_dv[j][3]);
  }
  __syncthreads();
  T* gdK = static_cast<T*>(p.dk) + b * p.dk_batch_stride + kh * p.dk_head_stride +
           n0 * p.dk_row_stride;  // (N, D)
  T* gdV = static_cast<T*>(p.dv) + b * p.dv_batch_stride + kh * p.dv_head_stride +
           n0 * p.dv_row_stride;  // (N, D)
#pragma unroll
  for (int k = 0; k < N * kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads, row = i / kChunks, col = i % kChunks * 8;
    if (n0 + row < seq_s) {
      *reinterpret_cast<uint4*>(gdK + row * p.dk_row_stride + col) =
          *reinterpret_cast<const uint4*>(&sK[swz<D>(row, col)]);
      *reinterpret_cast<uint4*>(gdV + row * p.dv_row_stride + col) =
          *reinterpret_cast<const uint4*>(&sV[swz<D>(row, col)]);
    }
  }
}

}  // namespace bwd

template <typename T, int kHeadDim, bool kCausal>
void run_bwd(const BwdParams& p, cudaStream_t stream) {
  using Cfg = bwd::Tiles<kHeadDim>;
  using Rows = bwd::RowChunks<kHeadDim>;
  const int64_t rows = p.b * p.t * p.n;  // (b, t, n) rows of q, o, dq
  if (rows > 0)
    bwd::preprocess_kernel<T, kHeadDim>
        <<<static_cast<unsigned>(Rows::blocks(rows)), Rows::kThreads, 0, stream>>>(p);
  // Runs even when T == 0: dK, dV must then come out zero.
  const int64_t ctas = (p.s + Cfg::kBlockN - 1) / Cfg::kBlockN * p.kh * p.b;
  if (ctas > 0) {
    auto kernel = bwd::main_kernel<T, kHeadDim, kCausal>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    kernel<<<static_cast<unsigned>(ctas), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  }
  if (rows > 0)
    bwd::convert_dq_kernel<T, kHeadDim>
        <<<static_cast<unsigned>(Rows::blocks(rows)), Rows::kThreads, 0, stream>>>(p);
}

}  // namespace jaxflash::cuda
