// FlashAttention-3-style backward for Hopper (sm_90a): TMA loads, wgmma, warp specialization.
// The passes around the main kernel are the sm80 backward's (../flash_bwd.cuh): delta and
// dq_accum = 0 before (no zeros where the kernel stores each tile's first dQ: kFirstStore),
// dq = scale * dq_accum after. The main kernel and the conversion are programmatic dependent
// launches, each of the kernel before it; past two waves of CTAs the preprocess runs beside the
// main kernel and slots of the main kernel's own grid convert dq (run_bwd_sm90).
//
// A CTA of 3 warpgroups is K/V-stationary: it owns kBlockN = 128 keys of one (batch b, kv head)
// and loops over the query heads of its group and their (kBlockM, H) query tiles:
//   - warpgroup 0, the producer: one warp loads K, V once and then each step's Q, dO tiles by
//     TMA into a 2-stage ring, with the step's lse (in log2 units) and delta rows beside them;
//   - warpgroups 1 and 2, the consumers, own 64 keys each (wgmma's M) and keep their dK, dV
//     accumulators in registers. Per step, with the keys as rows (the "transposed" products,
//     so that P^T and dS^T come out of the accumulators as the A operands of dV and dK):
//       S^T = K Q^T, dP^T = V dO^T                       (64, kBlockM), A and B from smem
//       P^T = 2^(S^T scale_log2 - lse_log2), dS^T = P^T (dP^T - delta)   (registers)
//       dV += P^T dO, dK += dS^T Q                       (64, H), A from registers
//       dQ = dS K over both warpgroups' 128 keys         (64, 64) per warpgroup, dS^T through
//                                                        smem, both operands MN-major (H = 128:
//                                                        dQ^T = K^T dS^T, dS through smem)
//     and store dQ (fp32) into a shared tile, which warp 1 of warpgroup 0, the dQ writer,
//     adds into dq_accum with TMA reduce-adds (one per 32 columns, done in the L2): the
//     consumers issue no atomics and go on to the next step's S^T while the tile drains.
//   H = 128 runs kBlockM = 64 (the warpgroups split dQ's columns), H = 64 kBlockM = 128 (they
//   split its rows): every wgmma has N >= 64 and the dQ split falls on whole swizzle atoms.
//   H = 256 (BwdCfgSm90::kSplitCols) runs kBlockN = 64 keys shared by both consumers, which
//   split S^T, dP^T by queries (32 each) and dK, dV, dQ by columns (128 each); P^T and dS^T go
//   through shared memory as the A of dV and dK.
//   At the end dK, dV leave through shared memory (the K, V, Q, dO, dS^T buffers, free by then)
//   as whole 16-byte pieces of rows.
// Variants: a second instantiation, kRules, runs the key-range rules (lengths, window, causal
// alignment; rules.cuh) and segment ids (BwdSegShared): a CTA visits only the query tiles that
// may see its keys, and warps test elements only where their 16 keys are not seen whole by
// the step's queries. It runs the soft cap too, an elementwise pass on every step, or at
// H = 128 a bias with no broadcast dim: warp 3 (the bias warp) copies each step's bias rows
// into a stage that the consumers read transposed into S^T's fragment (ldmatrix), and
// dbias = dS leaves from their registers, transposed back (movmatrix).
// deterministic_backward (every kernel): the CTAs that visit a query tile add their dQ to it
// one after the other, in a fixed order (the dQ writer).
// Shared tiles use TMA's 128-byte swizzle as in flash_fwd_sm90.cuh: a (rows, cols) tile is
// cols / 64 column blocks of (rows, 64), each row 128 bytes with chunk c at c ^ (row % 8).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../params.h"
#include "../flash_bwd.cuh"
#include "../mma.cuh"
#include "hopper.cuh"
#include "rules.cuh"
#include "wgmma_gen.h"

namespace jaxflash::cuda {
namespace sm90 {

// Segment ids in the rules kernel: query tiles whose ids' [min, max] range misses the key
// tile's are never visited (disjoint ranges share no id). Before the warps specialise, all 12
// warps mark the live candidates (query tiles m_first + r) in `live` and count them; every role
// then walks the same steps (StepWalk). The producer stages each step's query ids and their
// range with its lse and delta rows; a consumer warp whose 16 keys and the step's queries all
// carry one id skips the element test.
template <int kBlockM, int kStages>
struct BwdSegShared {
  // Bits kept for 32K candidate tiles; a CTA with more visits those past them all, with the
  // element test (correct, not skipped).
  static constexpr int kLiveTiles = 32 * 1024;
  int q_ids[kStages][kBlockM];  // the stage's query ids (rows past q_len: 0, never compared)
  int q_lo[kStages], q_hi[kStages];
  int kv_ids[128];               // the key tile's ids (keys below kv_len; others 0, unread)
  int kv_lo, kv_hi;             // their range
  int2 warp_kv[8];              // the range of consumer warp w's 16 keys
  int num_live;                 // live candidates
  uint32_t live[kLiveTiles / 32];

  // The lowest live candidate r' >= r; n_cand when none is left.
  __device__ int next_live(int r, int n_cand) const {
    while (r < n_cand && r < kLiveTiles) {
      const uint32_t w = live[r / 32] & (0xffffffffu << (r % 32));
      if (w != 0) return (r & ~31) + __ffs(static_cast<int>(w)) - 1;
      r = (r & ~31) + 32;
    }
    return min(r, n_cand);
  }
};

// The steps of a CTA, walked by each role on its own: for each query head of the kv head's
// group in turn, the live candidates r in increasing order (query tile m_first + r, or under
// causal masking without the first-store tickets m_end - 1 - r: step_m0); every candidate
// without segment ids (seg null).
template <typename Seg>
struct StepWalk {
  int r, head, heads;
  // The walk starts at step `start` (head * n_cand + r, or the first live candidate from
  // there) and wraps round past the last head.
  __device__ StepWalk(int start, int n_cand, int heads_)
      : r(n_cand ? start % n_cand - 1 : -1), head(n_cand ? start / n_cand : 0), heads(heads_) {}
  __device__ void next(const Seg* seg, int n_cand) {
    r = seg ? seg->next_live(r + 1, n_cand) : r + 1;
    if (r >= n_cand) {
      if (++head == heads) head = 0;
      r = seg ? seg->next_live(0, n_cand) : 0;
    }
  }
};

template <typename T, int kHeadDim>
struct BwdCfgSm90 {
  // H = 256 (kSplitCols): the warpgroups share 64 keys and split dK, dV by columns (each owns
  // 128) and S^T, dP^T by queries (each computes 32), exchanging P^T and dS^T through shared
  // memory; dO has one stage and dQ leaves in two rounds of half its columns, to fit 227 KB.
  static constexpr bool kSplitCols = kHeadDim == 256;
  static constexpr int kBlockN = kSplitCols ? 64 : 128;      // keys per CTA (2 x 64 or 64)
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;  // queries per step
  static constexpr int kStages = 2;
  static constexpr int kDOStages = kSplitCols ? 1 : kStages;
  static constexpr int kWgCols = kSplitCols ? kHeadDim / 2 : kHeadDim;  // dK, dV columns a WG
  static constexpr int kDQRounds = kSplitCols ? 2 : 1;  // sdQ fills a step
  static constexpr int kThreads = 384;
  static constexpr uint32_t kRowBytes = 128;  // one swizzled row of a column block
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(T);  // K or V
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(T);   // one Q or dO stage
  static constexpr uint32_t kDSBytes = kBlockN * kBlockM * sizeof(T);   // one dS^T or P^T buffer
  // 240 consumer registers: at 232, reading the lse and delta rows early (below) made ptxas
  // serialise the wgmmas (C7512, too few registers). The producer and dQ writer warps spill a
  // few values at 24; they only issue copies.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // dQ's fp32 tile: H / 32 column blocks of (kBlockM, 32), 128-byte rows in TMA's 128-byte
  // swizzle, so that a warp's float2 stores (8 rows x 32 bytes) take 2 wavefronts, not 8.
  // kSplitCols: three slots of a warpgroup's half of a round (64 columns), taken in turn by the
  // step's four halves, so that a half mostly finds a slot the TMA has long read (the reduce-adds
  // read sdQ at ~20 bytes a clock; NOTES.md, forty-eighth session).
  static constexpr int kDQSlots = kSplitCols ? 3 : 1;
  static constexpr uint32_t kDQSlotBytes = kBlockM * kHeadDim * 4 / (kSplitCols ? 4 : 1);
  static constexpr uint32_t kDQBytes = kDQSlots * kDQSlotBytes;
  // dS^T (and kSplitCols: P^T) buffers: kSplitCols keeps one, for sdQ's third slot.
  static constexpr int kDSBufs = kSplitCols ? 1 : 2;
  // Byte offsets from the 1024-aligned base: sK, sV, sQ[kStages], sdO[kDOStages],
  // sdS[kDSBufs], sP[kDSBufs] (kSplitCols), lse[kStages], delta[kStages] (kBlockM floats each),
  // sdQ, then the mbarriers kv, full[kStages], empty[kStages], dq_full, dq_empty, do_full,
  // do_empty, ds[2], slot_full[3], slot_empty[3] (kSplitCols: dO and sdQ's slots have barriers
  // of their own), bias_full, bias_empty (the bias stage's), the steps' info, the segment-id
  // tables and, at H = 128 with a bias, its stage.
  static constexpr uint32_t kOffK = 0;
  static constexpr uint32_t kOffV = kOffK + kKVBytes;
  static constexpr uint32_t kOffQ = kOffV + kKVBytes;
  static constexpr uint32_t kOffDO = kOffQ + kStages * kQBytes;
  static constexpr uint32_t kOffDS = kOffDO + kDOStages * kQBytes;
  static constexpr uint32_t kOffP = kOffDS + kDSBufs * kDSBytes;
  static constexpr uint32_t kOffLse = kOffP + (kSplitCols ? kDSBufs * kDSBytes : 0);
  static constexpr uint32_t kOffDelta = kOffLse + kStages * kBlockM * 4;
  static constexpr uint32_t kOffDQ = (kOffDelta + kStages * kBlockM * 4 + 1023) & ~1023u;
  static constexpr uint32_t kOffBar = kOffDQ + kDQBytes;
  static constexpr uint32_t kOffInfo = kOffBar + (15 + 2 * kStages) * 8;  // int [2][kStages]
  static constexpr uint32_t kOffSeg = kOffInfo + kStages * 8;  // 8-aligned: Seg holds int2
  using Seg = BwdSegShared<kBlockM, kStages>;
  // (H = 256 has no rules kernel, so no segment-id tables.)
  static constexpr uint32_t kOffBias = (kOffSeg + (kSplitCols ? 0 : sizeof(Seg)) + 15) & ~15u;
  // The rules kernel's bias stage at H = 128 (kBiasStage): the step's kBlockM rows of the key
  // tile's bias, each padded by 16 bytes so that an ldmatrix's 8 rows fall in distinct banks.
  // H = 64 (128 query rows, 34 KB) does not fit and runs a bias on sm80 (select.h).
  static constexpr bool kBiasStage = kHeadDim == 128;
  static constexpr uint32_t kBiasRowBytes = kBlockN * sizeof(T) + 16;
  static constexpr uint32_t kBiasBytes = kBiasStage ? kBlockM * kBiasRowBytes : 0;
  // Without a bias the launch leaves the stage out (kSmemBytes - kBiasBytes).
  static constexpr int kSmemBytes = kOffBias + kBiasBytes + 1024;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "sm90 backward head dims");
  static_assert(kSmemBytes <= 227 * 1024, "sm90 shared memory per block");
};

// The key tiles of a pair that the causal backward's descending walks run after all the
// sections: its shortest eighth (run_bwd_sm90 sizes the dq slots by it too).
__host__ __device__ constexpr int deferred_key_tiles(int64_t key_tiles) {
  return static_cast<int>(key_tiles / 8);
}

// Where block x of a backward grid with dq slots (DqSlots) falls: the CTA of index `main` in
// section_tile_deferred's order, or (main < 0) a slot of group `group` that converts its rows
// [t0, t1), past DqSlots::rows when `deferred_rows`. per_group: a group's CTAs before the
// deferred key tiles (all groups but the last are whole); ctas: every CTA. Regions, in order:
// groups 0 .. G - 2, each followed (from group lag on) by the slots of group j - lag; the
// rest of the CTAs; the slots of the groups that had none yet; every group's deferred rows.
struct GridPlace {
  int main, group, t0, t1;
  bool deferred_rows;
};
__device__ __forceinline__ GridPlace grid_place(unsigned x, const DqSlots& s, unsigned per_group,
                                                unsigned ctas, unsigned t_len) {
  GridPlace g{-1, 0, 0, 0, false};
  const unsigned groups = s.groups, lag = min(static_cast<unsigned>(s.lag), groups - 1);
  const unsigned mid_groups = groups - 1 - lag;
  const unsigned mid = (s.rows + s.mid_rows - 1) / s.mid_rows;  // slots a group among the CTAs
  const unsigned lead = lag * per_group, region = (groups - 1) * per_group + mid_groups * mid;
  if (x < lead) {
    g.main = static_cast<int>(x);
    return g;
  }
  if (x < region) {
    const unsigned y = x - lead, k = y / (per_group + mid), r = y % (per_group + mid);
    if (r < per_group) {
      g.main = static_cast<int>(lead + k * per_group + r);
      return g;
    }
    g.group = static_cast<int>(k);
    g.t0 = static_cast<int>((r - per_group) * s.mid_rows);
    g.t1 = min(g.t0 + s.mid_rows, s.rows);
    return g;
  }
  unsigned z = x - region;
  const unsigned rest = ctas - (groups - 1) * per_group;
  if (z < rest) {
    g.main = static_cast<int>((groups - 1) * per_group + z);
    return g;
  }
  z -= rest;
  const unsigned end = (s.rows + s.end_rows - 1) / s.end_rows;
  if (z < (groups - mid_groups) * end) {
    g.group = static_cast<int>(mid_groups + z / end);
    g.t0 = static_cast<int>(z % end * s.end_rows);
    g.t1 = min(g.t0 + s.end_rows, s.rows);
    return g;
  }
  z -= (groups - mid_groups) * end;
  const unsigned def = (t_len - s.rows + s.def_rows - 1) / s.def_rows;
  g.group = static_cast<int>(z / def);
  g.t0 = static_cast<int>(s.rows + z % def * s.def_rows);
  g.t1 = min(g.t0 + s.def_rows, static_cast<int>(t_len));
  g.deferred_rows = true;
  return g;
}

// A dq slot (grid_place): once its group's CTAs are done (those of the deferred key tiles too
// for rows past DqSlots::rows), dq[b, t, n] = scale * dq_accum[b, t, n] for t in [t0, t1) and
// the group's query heads, a token's heads side by side (adjacent in dq_accum within a batch).
// Each thread steps through its rows without divisions (the heads' offsets in shared memory),
// 64 bytes of a row (D=128) at a time: with the row decoded per 16 bytes the slots moved 18 GB/s
// an SM, bound by the index arithmetic.
template <typename T, int kHeadDim, int kThreads>
__device__ __forceinline__ void convert_dq_slot(const BwdParams& p, const GridPlace& g,
                                                int key_tiles, int deferred, unsigned char* smem) {
  const DqSlots& s = p.dq_slots;
  const int group_q = static_cast<int>(p.n / p.kh), n_heads = static_cast<int>(p.n);
  const int pair0 = g.group * s.pairs, pairs = min(s.pairs, static_cast<int>(p.b * p.kh) - pair0);
  const int heads = pairs * group_q;
  int64_t* src_at = reinterpret_cast<int64_t*>(smem);  // (heads): head hh's row at token 0
  int64_t* dst_at = src_at + heads;
  for (int hh = threadIdx.x; hh < heads; hh += kThreads) {
    const int q = pair0 * group_q + hh, b = q / n_heads, n = q % n_heads;  // q = b N + n
    src_at[hh] = (b * p.t * p.n + n) * kHeadDim;
    dst_at[hh] = b * p.dq_batch_stride + n * p.dq_head_stride;
  }
  if (threadIdx.x == 0) {
    int* done = s.done + 2 * g.group;
    while (bwd::ld_acquire(done) != pairs * (key_tiles - deferred)) __nanosleep(256);
    if (g.deferred_rows)
      while (bwd::ld_acquire(done + 1) != pairs * deferred) __nanosleep(256);
  }
  __syncthreads();  // (thread 0's acquire, then the barrier, orders every thread's loads)
  // Rows (token, head of the group), the head fastest; a row's kChunks float4 pieces on
  // kLanesRow lanes (128 bytes of the row at a time).
  constexpr int kChunks = kHeadDim / 4, kLanesRow = 8;
  constexpr int kRowsWarp = 32 / kLanesRow, kPerLane = kChunks / kLanesRow;
  constexpr int kStep = kThreads / 32 * kRowsWarp;  // rows from one of a thread's to the next
  // Rows a thread has in flight: 24 float4 pieces (16: the slots cost ~1% more than the pass
  // they replace at 4k causal, ncu; 32 spill).
  constexpr int kBatch = 24 / kPerLane;
  const int lane = threadIdx.x % 32, col = 4 * (lane % kLanesRow);
  const int rows = (g.t1 - g.t0) * heads, dt = kStep / heads, dh = kStep % heads;
  const int64_t token = p.n * kHeadDim;  // dq_accum's row stride
  const float scale = p.scale;
  int r = threadIdx.x / 32 * kRowsWarp + lane / kLanesRow;
  int t = g.t0 + r / heads, hh = r % heads;
  for (; r < rows; r += kStep * kBatch) {
    float4 v[kBatch][kPerLane];
    int64_t dst[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (r + k * kStep < rows) {
        const float* src = p.dq_accum + src_at[hh] + t * token + col;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j)
          v[k][j] = __ldcg(reinterpret_cast<const float4*>(src + 4 * kLanesRow * j));
        dst[k] = dst_at[hh] + t * p.dq_row_stride + col;
      }
      hh += dh;
      t += dt;
      if (hh >= heads) hh -= heads, ++t;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (r + k * kStep >= rows) continue;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const float4 x = v[k][j];
        const int64_t at = dst[k] + 4 * kLanesRow * j;
        if (p.grads_f32)
          *reinterpret_cast<float4*>(static_cast<float*>(p.dq) + at) =
              make_float4(x.x * scale, x.y * scale, x.z * scale, x.w * scale);
        else
          *reinterpret_cast<uint2*>(static_cast<T*>(p.dq) + at) =
              make_uint2(pack2<T>(x.x * scale, x.y * scale), pack2<T>(x.z * scale, x.w * scale));
      }
    }
  }
}

template <typename T, int kHeadDim, bool kCausal, bool kRules, bool kFirstStore = false>
__global__ void __launch_bounds__(384, 1)
    flash_bwd_sm90_kernel(const BwdParams p, const __grid_constant__ CUtensorMap tma_q,
                          const __grid_constant__ CUtensorMap tma_k,
                          const __grid_constant__ CUtensorMap tma_v,
                          const __grid_constant__ CUtensorMap tma_do,
                          const __grid_constant__ CUtensorMap tma_dq, int key_tiles,
                          int sec_pairs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!(kCausal && kRules), "the rules kernel reads is_causal from p");
  using Cfg = BwdCfgSm90<T, kHeadDim>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr bool kSplitCols = Cfg::kSplitCols;
  constexpr int kDQRounds = Cfg::kDQRounds;
  static_assert(!(kSplitCols && kRules), "H = 256 runs the rules on sm80 (select.h)");
  constexpr uint32_t kRowBytes = Cfg::kRowBytes;
  // The dq conversion after (a dependent launch) may take the SMs of the last wave's CTAs.
  pdl_trigger();

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sK = base + Cfg::kOffK;    // (H / 64, kBlockN, 64)
  const uint32_t sV = base + Cfg::kOffV;    // (H / 64, kBlockN, 64)
  const uint32_t sQ = base + Cfg::kOffQ;    // (kStages, H / 64, kBlockM, 64)
  const uint32_t sdO = base + Cfg::kOffDO;  // (kDOStages, H / 64, kBlockM, 64)
  const uint32_t sdS = base + Cfg::kOffDS;  // (2, kBlockM / 64, kBlockN, 64): dS^T
  const uint32_t sdQ = base + Cfg::kOffDQ;  // (H / 32 / kDQRounds, kBlockM, 32) fp32
  float* sLse = reinterpret_cast<float*>(smem + Cfg::kOffLse);      // (kStages, kBlockM)
  float* sDelta = reinterpret_cast<float*>(smem + Cfg::kOffDelta);  // (kStages, kBlockM)
  int* sM0 = reinterpret_cast<int*>(smem + Cfg::kOffInfo);  // (2, kStages): the steps' m0, head
  const uint32_t bar_kv = base + Cfg::kOffBar;
  const uint32_t bar_full = bar_kv + 8;                 // full[stage] at + 8 * stage
  const uint32_t bar_empty = bar_full + 8 * kStages;    // empty[stage]
  const uint32_t bar_dq_full = bar_empty + 8 * kStages;  // sdQ holds a step's dQ
  const uint32_t bar_dq_empty = bar_dq_full + 8;         // the writer has read sdQ
  const uint32_t bar_do_full = bar_dq_empty + 8;         // kSplitCols: sdO holds a step's dO
  const uint32_t bar_do_empty = bar_do_full + 8;         // kSplitCols: both dVs read it
  const uint32_t bar_ds = bar_do_empty + 8;  // kDSBar: ds[buf] at + 8 buf, sdS buffer buf full
  // kSplitCols: sdQ's slot s is full at bar_slot_full + 8 s, read at bar_slot_empty + 8 s
  const uint32_t bar_slot_full = bar_ds + 16, bar_slot_empty = bar_ds + 40;
  // kBiasStage with a bias: the step's bias rows landed in sBias (the bias warp's 32 lanes, its
  // copies' bytes), read (every consumer thread: racecheck saw a warp's lane 0 after __syncwarp
  // as no order between the other lanes' reads and the next step's copies)
  const uint32_t bar_bias_full = bar_ds + 64, bar_bias_empty = bar_ds + 72;
  constexpr bool kBiasStage = kRules && Cfg::kBiasStage;
  const uint32_t sBias = base + Cfg::kOffBias;  // (kBlockM, kBiasRowBytes): the step's bias rows

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // blockIdx.x enumerates sections of sec_pairs (b, kv head) pairs, and in each (key tile,
  // pair), key tile slowest: the pairs' CTAs read the same Q, dO tiles close together in time
  // (L2), and under causal masking the longest ones start first across the section
  // (run_bwd_sm90). sec_pairs = 1: each pair's key tiles one after the other.
  // Deterministic: each pair's key tiles start last to first, the order in which they add to
  // a query tile's dQ (but for rotated walks; the dQ writer below).
  const bool det = p.deterministic;
  const int t_len = static_cast<int>(p.t), s_len = static_cast<int>(p.s);
  // Under causal masking past the first-store tickets (and not deterministic, whose order of
  // adds is fixed) each CTA walks its query tiles last to first, its masked diagonal steps
  // last: D=128 +1-2.3% at 4k-8k causal, 0-2% at 16k, though it reads more DRAM (NOTES.md,
  // thirty-seventh session). There the shortest eighth of every pair's key tiles runs after
  // all the sections, longest first, to fill the SMs that the last sections' long CTAs leave
  // idle: D=128 +0.9% at 16k causal, +0.4-0.7% at 4k-8k (medians of A/B rounds; a quarter:
  // 4k slower; thirty-ninth).
  const bool last_first = kCausal && !kFirstStore && !det;
  const int deferred = last_first ? deferred_key_tiles(key_tiles) : 0;
  const unsigned pairs = static_cast<unsigned>(p.b * p.kh);
  // With dq slots (run_bwd_sm90) some blocks convert dq instead.
  int main_idx = static_cast<int>(blockIdx.x);
  if constexpr (!kRules) {
    if (p.dq_slots.done) {
      const GridPlace g = grid_place(blockIdx.x, p.dq_slots, p.dq_slots.pairs * (key_tiles - deferred),
                                     pairs * key_tiles, t_len);
      if (g.main < 0) {
        convert_dq_slot<T, kHeadDim, Cfg::kThreads>(p, g, key_tiles, deferred, smem);
        return;
      }
      main_idx = g.main;
    }
  }
  const int2 st = section_tile_deferred(main_idx, sec_pairs, pairs, key_tiles, deferred);
  const int key_tile = det ? key_tiles - 1 - st.x : st.x;
  const int n0 = key_tile * kBlockN;
  const int64_t bkh = st.y;
  const int64_t kvh = bkh % p.kh, b = bkh / p.kh;
  // The preprocess beside this kernel (prep_beside_kernel; else it ran before, and the roles
  // that read its rows wait for its grid): the pair's rows done, their writes visible to this
  // thread and to its TMA copies.
  const bool beside = !kRules && p.prep_rows != 0;
  auto wait_prep = [&] {
    while (bwd::ld_acquire(p.prep_done + bkh) != p.prep_rows) __nanosleep(64);
    fence_proxy_async_global();
  };
  const int group = static_cast<int>(p.n / p.kh);
  int m_first = 0, m_end = (t_len + kBlockM - 1) / kBlockM;
  Rules rules;
  if constexpr (kRules) {
    // The query tiles that meet the queries which may see a key of this tile (none: dK = dV
    // = 0 from empty accumulators); rows past q_len get P = 0 through their lse below.
    rules = Rules(p, b);
    const int2 qs = rules.query_range(n0, kBlockN);
    m_first = qs.x / kBlockM;
    m_end = qs.y > qs.x ? (qs.y - 1) / kBlockM + 1 : m_first;
  } else if (kCausal) {
    // Query tile m sees this key tile iff its last query m0 + kBlockM - 1 >= n0.
    m_first = min(n0 / kBlockM, m_end);
  }
  const int q_end = kRules ? rules.q_len : t_len;  // rows past it see no key
  // The rules kernel's bias and dbias of batch element b (select.h: no broadcast dim, keys
  // contiguous, rows 16-byte aligned): query head n's row t at n * bias_hs + t * bias_rs.
  // Taken before the roles split, as in the forward (from p in the consumers: spills).
  const uint16_t* bias_b = nullptr;
  uint16_t* dbias_b = nullptr;
  int64_t bias_rs = 0, bias_hs = 0;
  if (kBiasStage && p.bias) {
    const BcastStrides& bs = p.bias_strides;
    const int64_t at = bs.batch_at(b, p.batch_inner);
    bias_b = static_cast<const uint16_t*>(p.bias) + at;
    dbias_b = static_cast<uint16_t*>(p.dbias) + at;
    bias_rs = bs.row;
    bias_hs = bs.head;
  }
  const int n_cand = m_end - m_first;  // candidate query tiles per head
  using Seg = typename Cfg::Seg;
  Seg* seg = kRules && p.q_segment_ids ? reinterpret_cast<Seg*>(smem + Cfg::kOffSeg) : nullptr;
  const int32_t* q_ids = p.q_segment_ids + b * p.t;
  const int32_t* kv_ids = p.kv_segment_ids + b * p.s;
  // Step it: query head kvh * group + walk.head, query tile step_m0 (StepWalk).
  auto step_head = [&](const StepWalk<Seg>& w) { return kvh * group + w.head; };
  auto step_m0 = [&](const StepWalk<Seg>& w) {
    return (last_first ? m_end - 1 - w.r : m_first + w.r) * kBlockM;
  };
  // The ids' range of rows [m0, m0 + kBlockM) below q_end, warp-wide; (INT_MAX, INT_MIN) when
  // there are none (a range that meets no other).
  auto q_tile_ids = [&](int m0) {
    return bwd::seg_id_range(q_ids, m0, min(m0 + kBlockM, q_end), lane);
  };

  if (tid == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      // the producer's lane 0, or in the rules kernel every lane (its rows)
      mbar_init(bar_full + 8 * s, kRules ? 32 : 1);
      // every consumer thread, each releasing its own reads of the stage's rows (sM0, sLse,
      // sDelta, seg->q_ids) before the producer rewrites them
      mbar_init(bar_empty + 8 * s, 256);
    }
    if constexpr (!kSplitCols) {  // one sdQ tile, stored by all 8 consumer warps
      mbar_init(bar_dq_full, 8);
      mbar_init(bar_dq_empty, 1);
    } else {
      for (int slot = 0; slot < 3; ++slot) {
        mbar_init(bar_slot_full + 8 * slot, 4);  // a warpgroup's warps
        mbar_init(bar_slot_empty + 8 * slot, 1);
      }
      mbar_init(bar_do_full, 1);
      mbar_init(bar_do_empty, 256);
    }
    mbar_init(bar_ds, 8);  // every consumer warp's lane 0
    mbar_init(bar_ds + 8, 8);
    if (kBiasStage && bias_b) {
      mbar_init(bar_bias_full, 32);
      mbar_init(bar_bias_empty, 256);  // every consumer thread, a reader
    }
    mbar_fence_init();
  }
  if (seg) {
    for (int i = tid; i < Seg::kLiveTiles / 32; i += Cfg::kThreads) seg->live[i] = 0;
    if (tid == 0) seg->num_live = max(0, n_cand - Seg::kLiveTiles);  // past the bits: live
    if (tid < kBlockN) seg->kv_ids[tid] = n0 + tid < rules.kv_len ? kv_ids[n0 + tid] : 0;
    if (warp == 0) {
      const int2 kr = bwd::seg_id_range(kv_ids, n0, min(n0 + kBlockN, rules.kv_len), lane);
      if (lane == 0) seg->kv_lo = kr.x, seg->kv_hi = kr.y;
    } else if (warp >= 4) {  // consumer warp w = warp - 4 owns keys 16 w .. 16 w + 15
      const int w0 = n0 + 16 * (warp - 4);
      const int2 wr = bwd::seg_id_range(kv_ids, w0, max(w0, min(w0 + 16, rules.kv_len)), lane);
      if (lane == 0) seg->warp_kv[warp - 4] = wr;
    }
  }
  __syncthreads();
  if (seg) {
    const int2 kr = make_int2(seg->kv_lo, seg->kv_hi);
    for (int r = warp; r < min(n_cand, Seg::kLiveTiles); r += Cfg::kThreads / 32)
      if (bwd::seg_meet(q_tile_ids((m_first + r) * kBlockM), kr) && lane == 0) {
        atomicOr(&seg->live[r / 32], 1u << (r % 32));
        atomicAdd(&seg->num_live, 1);
      }
    __syncthreads();
  }
  const int n_steps = group * (seg ? seg->num_live : n_cand);
  // p.rotate_walk (deterministic, every key tile a candidate of every query tile): key tile k
  // of K starts its walk at step k W / K of the W = group * n_cand and wraps round, so that
  // each step's visitors come W / K steps apart instead of all at once, each waiting for the
  // one before.
  const bool rotate = !kCausal && p.rotate_walk;
  const int walk_len = group * n_cand;
  const int walk_start = rotate ? static_cast<int>(int64_t{key_tile} * walk_len / key_tiles) : 0;

  if (warp < 4) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0) {
      const int ci_kvh = static_cast<int>(kvh), ci_b = static_cast<int>(b);
      if (lane == 0) {
        tma_prefetch_desc(&tma_q);
        tma_prefetch_desc(&tma_k);
        tma_prefetch_desc(&tma_v);
        tma_prefetch_desc(&tma_do);
        mbar_arrive_expect_tx(bar_kv, 2 * Cfg::kKVBytes);
#pragma unroll
        for (int cb = 0; cb < kHeadDim / 64; ++cb) {
          tma_load_4d(sK + cb * kBlockN * kRowBytes, &tma_k, bar_kv, cb * 64, ci_kvh, n0, ci_b,
                      L2Hint::kFirst);
          tma_load_4d(sV + cb * kBlockN * kRowBytes, &tma_v, bar_kv, cb * 64, ci_kvh, n0, ci_b,
                      L2Hint::kFirst);
        }
      }
      // Launched as a dependent of the preprocess pass: K and V (inputs) load while it ends;
      // its lse, delta rows (and dq_accum's zeros, for the writer) only after. Beside, warp 2
      // copies the first step's rows (below).
      if (!beside) pdl_wait();
      StepWalk<Seg> walk(walk_start, n_cand, group);
      for (int it = 0; it < n_steps; ++it) {
        walk.next(seg, n_cand);
        const int s = it % kStages;
        const int64_t n = step_head(walk);
        const int m0 = step_m0(walk);
        // Stage s last held step it - kStages: wait until both consumers released it.
        if (it >= kStages) mbar_wait(bar_empty + 8 * s, (it / kStages - 1) & 1);
        // Q, dO and the step's lse (log2 units) and delta rows, padded by the preprocess pass
        // to whole tiles (BwdParams::t_pad; lse_log2 = +inf where P = 0: rows past T or q_len,
        // or with no visible key): copies from one thread, and in the rules kernel the rows by
        // every lane with the segment ids (there the copies cost the consumers spills).
        const uint32_t full = bar_full + 8 * s;
        const int ci_n = static_cast<int>(n);
        const int64_t row0 = (b * p.n + n) * p.t_pad + m0;
        if (lane == 0) {
          sM0[s] = m0;
          if constexpr (kRules) sM0[kStages + s] = ci_n;  // (the consumers' dbias rows)
          constexpr uint32_t kRowsBytes = kRules ? 0 : kBlockM * 4;
          mbar_expect_tx(full, (kSplitCols ? 1 : 2) * Cfg::kQBytes + 2 * kRowsBytes);
          const uint32_t stage = s * Cfg::kQBytes;
#pragma unroll
          for (int cb = 0; cb < kHeadDim / 64; ++cb) {
            tma_load_4d(sQ + stage + cb * kBlockM * kRowBytes, &tma_q, full, cb * 64, ci_n, m0, ci_b,
                        L2Hint::kLast);
            if constexpr (!kSplitCols)
              tma_load_4d(sdO + stage + cb * kBlockM * kRowBytes, &tma_do, full, cb * 64, ci_n, m0,
                          ci_b, L2Hint::kLast);
          }
          if constexpr (!kRules) {
            if (it > 0 || !beside) {
              if (it == 1 && beside) wait_prep();  // (warp 2's acquire is not this thread's)
              bulk_load(base + Cfg::kOffLse + s * kRowsBytes, p.lse_log2 + row0, kRowsBytes, full);
              bulk_load(base + Cfg::kOffDelta + s * kRowsBytes, p.delta + row0, kRowsBytes, full);
            }
          }
        }
        if constexpr (kRules) {
          int id_lo = INT_MAX, id_hi = INT_MIN;  // the range of the step's ids, as q_tile_ids
          for (int r = lane; r < kBlockM; r += 32) {
            sLse[s * kBlockM + r] = p.lse_log2[row0 + r];
            sDelta[s * kBlockM + r] = p.delta[row0 + r];
            if (seg) {
              const bool valid = m0 + r < q_end;
              const int id = valid ? q_ids[m0 + r] : 0;
              seg->q_ids[s][r] = id;
              if (valid) id_lo = min(id_lo, id), id_hi = max(id_hi, id);
            }
          }
          if (seg) {
            id_lo = __reduce_min_sync(0xffffffffu, id_lo);
            id_hi = __reduce_max_sync(0xffffffffu, id_hi);
            if (lane == 0) seg->q_lo[s] = id_lo, seg->q_hi[s] = id_hi;
          }
        }
        if (kRules || lane == 0) mbar_arrive(full);
        if constexpr (kSplitCols) {  // dO once both dVs of step it - 1 have read it
          if (it > 0) mbar_wait(bar_do_empty, (it - 1) & 1);
          if (lane == 0) {
            mbar_arrive_expect_tx(bar_do_full, Cfg::kQBytes);
#pragma unroll
            for (int cb = 0; cb < kHeadDim / 64; ++cb)
              tma_load_4d(sdO + cb * kBlockM * kRowBytes, &tma_do, bar_do_full, cb * 64, ci_n, m0,
                          ci_b, L2Hint::kLast);
          }
        }
      }
    } else if (warp == 1) {
      if (!beside) pdl_wait();
      // dq_accum[b, m0 .., n, :] += sdQ by TMA (rows past T skipped); sdQ is released once
      // read, the adds complete in the L2 on their own (the CTA need not wait for them: the
      // last wait above is the read of its last tile, before its shared memory goes).
      // Deterministic: the key tiles that visit a query tile add in turn, last to first (each
      // pair's CTAs start in that order, so a CTA only waits for one that started before it),
      // each once the one before has completed its adds; p.dq_turn counts them. A tile's rank
      // is the number of its query tile's visitors after it: under causal masking the last
      // visitor is the key tile of the tile's last row, under the rules that of the last key
      // its rows may see; with segment ids only the visitors whose ids the tile's meet count
      // (the live candidates above, from every key tile's id range in p.kv_seg_range), which
      // lane 0 cannot count alone: the rules kernel's writer runs on the whole warp. Rotated
      // walks turn the order round to the key tile whose walk starts last at or before the
      // step: a CTA may then wait for any CTA of its pair, so all of them must fit on the GPU
      // at once (run_bwd_sm90).
      auto dq_rank = [&](const StepWalk<Seg>& walk) {
        const int m0 = step_m0(walk);
        // The visitors ahead of this key tile: key tiles key_tile + 1 .. key_tile + ahead
        // (mod K).
        int ahead;
        if constexpr (kCausal) {
          ahead = min(key_tiles - 1, (m0 + kBlockM - 1) / kBlockN) - key_tile;
        } else if (rotate) {  // the first visitor: the last key tile k with k W / K <= w
          const int w = walk.head * n_cand + walk.r;
          ahead = static_cast<int>((int64_t{w + 1} * key_tiles + walk_len - 1) / walk_len) - 1 -
                  key_tile;
          if (ahead < 0) ahead += key_tiles;
        } else {
          ahead = (kRules ? (rules.key_range(m0, kBlockM).y - 1) / kBlockN : key_tiles - 1) -
                  key_tile;
        }
        if constexpr (!kRules) {
          return ahead;
        } else {
          if (!seg) return ahead;
          const int2 q_ids_range = q_tile_ids(m0);
          const int* kv_range = p.kv_seg_range + 2 * b * key_tiles;
          int live = 0;
          for (int i = 1 + lane; i <= ahead; i += 32) {
            const int k = key_tile + i < key_tiles ? key_tile + i : key_tile + i - key_tiles;
            // (candidates past Seg::kLiveTiles are visited whatever their ids)
            live += bwd::seg_meet(q_ids_range, make_int2(kv_range[2 * k], kv_range[2 * k + 1])) ||
                    (m0 / kBlockM >= Seg::kLiveTiles &&
                     m0 / kBlockM - rules.query_range(k * kBlockN, kBlockN).x / kBlockM >=
                         Seg::kLiveTiles);
          }
          return __reduce_add_sync(0xffffffffu, live);
        }
      };
      if (kRules || lane == 0) {
        if (lane == 0) tma_prefetch_desc(&tma_dq);
        if (beside) wait_prep();  // dq_accum's zeros (no lane but 0 here: !kRules)
        StepWalk<Seg> walk(walk_start, n_cand, group);
        const int m_tiles = (t_len + kBlockM - 1) / kBlockM;
        for (int it = 0; it < n_steps; ++it) {
          walk.next(seg, n_cand);
          const int n = static_cast<int>(step_head(walk)), m0 = step_m0(walk);
          const int rank = det ? dq_rank(walk) : 0;
          if (lane == 0) {
            // kFirstStore (causal, run_bwd_sm90): dq_accum is not zeroed; a query tile's first
            // contribution is stored, the others added once its ticket says kDone. The first
            // is the CTA that claims the ticket (0 -> 1): the tile's own CTA (whose keys start
            // at its rows, at its first steps) claims at once, any other only if the tile is
            // not done by the time it gets there (a causal head's CTAs reach a tile steps
            // apart). A CTA only ever waits for one that claimed, so for one that is running.
            // All before the wait for sdQ, whose latency hides it.
            const int64_t tile = (b * p.n + n) * m_tiles + m0 / kBlockM;  // its turn and ticket
            int* turn = nullptr;
            if (det) {
              turn = p.dq_turn + tile;
              while (bwd::ld_acquire(turn) != rank) __nanosleep(32);
              fence_proxy_async_global();  // the adds after the acquired ones, across the proxies
            }
            constexpr int kDone = bwd::kDqTicketDone;
            int* ticket = p.dq_ticket + tile;
            bool first = false;
            if constexpr (kFirstStore) {
              int state = m0 < n0 + kBlockN ? 0 : bwd::ld_acquire(ticket);
              if (!(state & kDone)) {
                first = atomicCAS(ticket, 0, 1) == 0;
                while (!first && !(state & kDone)) state = bwd::ld_acquire(ticket);
              }
              // the adds after the store, across the proxies
              if (!first) fence_proxy_async_global();
            }
            // a (kBlockM, 32) column block of sdQ at src to dq_accum's columns col ..
            auto send = [&](uint32_t src, int col) {
              if (first)
                tma_store_4d(&tma_dq, src, col, n, m0, static_cast<int>(b));
              else
                tma_reduce_add_4d(&tma_dq, src, col, n, m0, static_cast<int>(b), L2Hint::kLast);
            };
#pragma unroll
            for (int j = 0; j < kDQRounds; ++j) {
              if constexpr (kSplitCols) {
                // Half h = 2 (2 it + j) + w: warpgroup w's columns 128 w + 64 j .. + 63, in
                // slot h % 3 (its use h / 3 of that slot). Each half goes once its warpgroup
                // has stored it; the half before it comes free once the TMA has read it.
#pragma unroll
                for (int w = 0; w < 2; ++w) {
                  const int h = 2 * (kDQRounds * it + j) + w, slot = h % 3;
                  mbar_wait(bar_slot_full + 8 * slot, (h / 3) & 1);
                  const uint32_t src = sdQ + slot * Cfg::kDQSlotBytes;
                  send(src, 128 * w + 64 * j);
                  send(src + kBlockM * kRowBytes, 128 * w + 64 * j + 32);
                  bulk_commit();
                  if (h > 0) {
                    bulk_wait_read<1>();
                    mbar_arrive(bar_slot_empty + 8 * ((h - 1) % 3));
                  }
                }
              } else {
                mbar_wait(bar_dq_full, it & 1);
#pragma unroll
                for (int cb = 0; cb < kHeadDim / 32; ++cb)
                  send(sdQ + cb * kBlockM * kRowBytes, cb * 32);
                bulk_commit();
                bulk_wait_read();
                mbar_arrive(bar_dq_empty);
              }
            }
            if (first || det) {  // the stored (added) tile, once its copy is complete
              bulk_wait_all();
              fence_proxy_async_global();
              if (det)
                red_add_release(turn, 1);
              else
                red_or_release(ticket, kDone);
            }
          }
          if constexpr (kRules) __syncwarp();
        }
        if (!kRules && p.dq_slots.done) {  // this CTA's adds are complete: its group's count
          bulk_wait_all();
          fence_proxy_async_global();
          const int group_at = 2 * (static_cast<int>(bkh) / p.dq_slots.pairs);
          red_add_release(p.dq_slots.done + group_at + (key_tile >= key_tiles - deferred), 1);
        }
      }
    } else if (kBiasStage && warp == 3 && bias_b) {
      // The bias warp: each step's kBlockM rows of the key tile's bias (its keys below S) into
      // sBias, a bulk copy a row, once every consumer warp has read the step before's; rows
      // past T get zeros (P = 0 there, but stale bits could be NaN). A copy is issued about a
      // step before its read.
      const uint32_t bytes = 2 * min(kBlockN, s_len - n0);  // S % 8 == 0: 16-byte pieces
      StepWalk<Seg> walk(walk_start, n_cand, group);
      for (int it = 0; it < n_steps; ++it) {
        walk.next(seg, n_cand);
        const int m0 = step_m0(walk);
        const uint16_t* rows = bias_b + step_head(walk) * bias_hs + int64_t{m0} * bias_rs + n0;
        if (it > 0) mbar_wait(bar_bias_empty, (it - 1) & 1);
        if (lane == 0) mbar_expect_tx(bar_bias_full, bytes * min(t_len - m0, kBlockM));
        __syncwarp();
        for (int r = lane; r < kBlockM; r += 32) {
          const uint32_t dst = sBias + r * Cfg::kBiasRowBytes;
          if (m0 + r < t_len) {
            bulk_load(dst, rows + r * bias_rs, bytes, bar_bias_full);
          } else {
            for (int c = 0; c < 2 * kBlockN; c += 8) sts_f32x2(dst + c, 0.f, 0.f);
            fence_proxy_async();  // before a later step's copy into the row
          }
        }
        mbar_arrive(bar_bias_full);
      }
    } else if (warp == 2 && beside && lane == 0 && n_steps > 0) {
      // The first step's lse and delta rows, once the pass beside has done them: stage 0's full
      // barrier expects their bytes from the producer's arrival (a complete_tx before it leaves
      // the barrier's tx-count negative until then). The producer issues that step's Q and dO
      // meanwhile, and waits itself only before the second step's rows, while the consumers
      // run the first: its wait before the first step's measured 0.3-0.4% more main-kernel
      // cycles (ncu, 4k causal), this one none.
      wait_prep();
      StepWalk<Seg> walk(walk_start, n_cand, group);
      walk.next(seg, n_cand);
      constexpr uint32_t kRowsBytes = kBlockM * 4;
      const int64_t row0 = (b * p.n + step_head(walk)) * p.t_pad + step_m0(walk);
      bulk_load(base + Cfg::kOffLse, p.lse_log2 + row0, kRowsBytes, bar_full);
      bulk_load(base + Cfg::kOffDelta, p.delta + row0, kRowsBytes, bar_full);
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    // The lane afresh: ptxas spilled the kernel's (live from before the split into roles) and
    // reloaded it in the step loop.
    const int lane = lane_id_volatile();
    // Consumer warpgroup: keys 64 cw .. 64 cw + 63 of the tile (kSplitCols: all 64 keys, the
    // step's queries 32 cw .. 32 cw + 31 in S^T and dP^T, dK and dV columns 128 cw .. 128 cw +
    // 127). Broadcast from lane 0 so that ptxas sees it warp-uniform and keeps the descriptors
    // derived from it in uniform registers.
    const int cw = __shfl_sync(0xffffffffu, warp / 4 - 1, 0);
    const int wg_key0 = kSplitCols ? 0 : 64 * cw;  // this warpgroup's first key in the tile
    constexpr int kSN = kSplitCols ? kBlockM / 2 : kBlockM;  // S^T, dP^T columns (queries)
    const int wg_q0 = kSplitCols ? kSN * cw : 0;             // the first of them in the step
    const int wi = warp % 4;      // warp in the warpgroup: accumulator rows 16 wi .. 16 wi + 15
    const int g = lane / 4, tig = lane % 4;
    // Accumulator element 4 i + c sits at row 16 wi + g + 8 (c / 2), column 8 i + 2 tig + c % 2.
    constexpr int kNS = kSN / 2;       // S^T, dP^T floats per thread: (64, kSN) / 128
    constexpr int kWgCols = Cfg::kWgCols;
    constexpr int kNKV = kWgCols / 2;  // dK, dV floats per thread: (64, kWgCols) / 128
    constexpr int kKM = kBlockM / 16;  // k16 steps of dV, dK (over the queries)
    // dQ of this warpgroup: (64, 64) at query row dq_row0, column dq_col0 of sdQ, which is K's
    // column block dq_kcb (kSplitCols: one a round, dq_kcb and dq_kcb + 1).
    const int dq_row0 = kHeadDim == 64 ? 64 * cw : 0, dq_col0 = kHeadDim >= 128 ? 64 * cw : 0;
    const int dq_kcb = kSplitCols ? 2 * cw : dq_col0 / 64;
    // H >= 128 computes it transposed, dQ^T = K^T dS^T (A = K's column block dq_kcb read
    // MN-major, B = dS stored with the queries as rows, read K-major), storing dS by stmatrix:
    // 11% fewer instructions a step than dQ = dS K with dS^T stored by 32-bit stores, +0.5-2%
    // at 1k-16k over 4 A/B runs; at H = 64 (128 queries a step, split by rows) it measured 1-4%
    // slower (NOTES.md, fifteenth session).
    constexpr bool kDQT = kHeadDim >= 128;
    const int key_row = n0 + wg_key0 + 16 * wi + g;  // this thread's keys: key_row, key_row + 8

    float acc_dv[kNKV], acc_dk[kNKV];
#pragma unroll
    for (int i = 0; i < kNKV; ++i) acc_dv[i] = acc_dk[i] = 0.f;
    // Operand descriptors at stage 0 (the step's are desc_at offsets of these): this
    // warpgroup's rows of K and V (K-major), its queries of the Q, dO stages K-major (S^T,
    // dP^T) and, from its first dK, dV column, MN-major (dK, dV: column blocks kBlockM rows
    // apart), K's column block dq_kcb (MN-major), for dQ either dS^T's column block
    // dq_row0 / 64 (MN-major) or dS (kDQT, K-major), and (kSplitCols) P and dS as the A of dV
    // and dK (MN-major: the keys contiguous; dS's is d_ds).
    const uint32_t wg_cols = (kSplitCols ? 2 * cw : 0) * kBlockM * kRowBytes;
    const uint64_t d_k_rows = sw128_desc(sK + wg_key0 * kRowBytes, 16, 1024);
    const uint64_t d_v_rows = sw128_desc(sV + wg_key0 * kRowBytes, 16, 1024);
    const uint64_t d_q = sw128_desc(sQ + wg_q0 * kRowBytes, 16, 1024);
    const uint64_t d_do = sw128_desc(sdO + wg_q0 * kRowBytes, 16, 1024);
    const uint64_t d_p_mn = sw128_desc(base + Cfg::kOffP, kBlockM * kRowBytes, 1024);
    const uint64_t d_q_mn = sw128_desc(sQ + wg_cols, kBlockM * kRowBytes, 1024);
    const uint64_t d_do_mn = sw128_desc(sdO + wg_cols, kBlockM * kRowBytes, 1024);
    const uint64_t d_ds = sw128_desc(sdS + (dq_row0 / 64) * kBlockN * kRowBytes, kBlockN * kRowBytes, 1024);
    const uint64_t d_k_dq = sw128_desc(sK + dq_kcb * kBlockN * kRowBytes, kBlockN * kRowBytes, 1024);
    const uint64_t d_dsq = sw128_desc(sdS, 16, 1024);
    // dQ = dS K: (64, 64) per warpgroup, K = kBlockN keys in k16 steps of 16 rows; A = dS^T's
    // column block dq_row0 / 64 read MN-major (M = queries contiguous), B = K's column block
    // dq_kcb read MN-major (N = H contiguous). kDQT: dQ^T = K^T dS^T, A = that block of K
    // (M = H contiguous; round j: block dq_kcb + j), B = dS K-major (its key column blocks
    // kBlockM rows apart).
    auto issue_dq = [&](float (&acc_dq)[32], uint32_t ds_buf, int j) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        if constexpr (kDQT)
          Wgmma<64>::template ts<T>(
              acc_dq, desc_at(d_k_dq, (j * kBlockN + kk * 16) * kRowBytes),
              desc_at(d_dsq, ds_buf + (kk / 4) * kBlockM * kRowBytes + (kk % 4) * 32), kk > 0);
        else
          Wgmma<64>::template tt<T>(
              acc_dq,
              desc_at(d_ds, ds_buf + kk * 16 * kRowBytes), desc_at(d_k_dq, kk * 16 * kRowBytes),
              kk > 0);
      }
      wgmma_commit();
    };
    // dQ into sdQ (row dq_row0 + r, column dq_col0 + c) in column block c / 32, once the
    // writer has read the round before. Row r of a column block holds 16-byte chunk c at
    // c ^ (r % 8). kSplitCols: this warpgroup's half of the round, half = 2 round + cw, goes to its
    // two column blocks in slot half % 3 (dq_slot), once the writer has read the slot's use before.
    auto store_dq = [&](float (&acc_dq)[32], int round) {
      const int half = 2 * round + cw, slot = kSplitCols ? half % 3 : 0;
      const uint32_t dq_slot = sdQ + slot * Cfg::kDQSlotBytes;
      if constexpr (kSplitCols) {
        if (half >= 3) mbar_wait(bar_slot_empty + 8 * slot, (half / 3 - 1) & 1);
      } else {
        if (round > 0) mbar_wait(bar_dq_empty, (round - 1) & 1);
      }
      if constexpr (kDQT) {
        // acc_dq element 4 i + c is dQ at row q = 8 i + 2 tig + c % 2, column d = dq_col0 +
        // 16 wi + g + 8 (c / 2), in chunk (d % 32) / 4 ^ (q % 8) of row q. A warp's 32 stores
        // of one element fall in 32 distinct banks: the chunk differs along g / 4 and tig,
        // d % 4 = g % 4 picks the bank in it. q % 8 = 2 tig + c % 2 for every i, so each
        // (c / 2, c % 2) needs one address, 8 i rows on.
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = dq_col0 + 16 * wi + g + 8 * h, q = 2 * tig + e;
            const int cb = (kSplitCols ? d - dq_col0 : d) / 32;  // column block in the slot
            const uint32_t at = dq_slot + cb * kBlockM * kRowBytes + q * kRowBytes +
                                ((((d % 32) / 4) ^ q) * 16) + (d % 4) * 4;
#pragma unroll
            for (int i = 0; i < kBlockM / 8; ++i)
              sts_f32(at + i * 8 * kRowBytes, acc_dq[4 * i + 2 * h + e]);
          }
      } else {
        // Element 4 i + 2 h of acc_dq sits 8 h rows and 8 i columns past this thread's first
        // (row dq_row0 + 16 wi + g, column 2 tig), and r % 8 = g; column 8 i + 2 tig is chunk
        // 2 (i % 4) + tig / 2, so its swizzled byte offset in the row is this thread's offset
        // for i % 4 = 0, XOR 32 (i % 4). A float2 store is served a half-warp (4 rows) at a
        // time, and rows g, g ^ 1 put the same i in the same banks: so odd rows store i ^ 2
        // (XOR 64) when even rows store i, and each half-warp's 4 rows fill 4 distinct 32-byte
        // bank groups (1 wavefront, not 2).
        const bool odd = g & 1;
        const uint32_t sdq_thread = (sdQ + (dq_col0 / 32) * kBlockM * kRowBytes +
                                     (dq_row0 + 16 * wi + g) * kRowBytes +
                                     (((tig / 2) ^ g) * 16 + (tig % 2) * 8)) ^ (odd ? 64 : 0);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int e = 4 * i + 2 * h, e2 = 4 * (i ^ 2) + 2 * h;  // selects, not an index
            sts_f32x2((sdq_thread ^ ((i % 4) * 32)) + (8 * h) * kRowBytes + (i / 4) * kBlockM * kRowBytes,
                      odd ? acc_dq[e2] : acc_dq[e], odd ? acc_dq[e2 + 1] : acc_dq[e + 1]);
          }
      }
      fence_proxy_async();  // the writer's TMA reads sdQ through the async proxy
      __syncwarp();
      if (lane == 0) mbar_arrive(kSplitCols ? bar_slot_full + 8 * slot : bar_dq_full);
    };
    mbar_wait(bar_kv, 0);

    // The descending walk's last step is the diagonal m0 = n0 (the last head's), where H = 128's
    // second warpgroup's keys n0 + 64 .. lie past every query: it leaves the loop a step early
    // and only sends that step's dQ columns with its dS^T zero (below). The loop's code stays as
    // it was (a skip inside it cost 2-5% through ptxas's schedule); 0.55% fewer cycles at 4k
    // causal, 0.06% at 16k (ncu; NOTES.md, forty-second session).
    const bool skip_last = kHeadDim == 128 && last_first && cw == 1 && n_steps > 0;
    const int loop_steps = n_steps - (skip_last ? 1 : 0);
    for (int it = 0; it < loop_steps; ++it) {
      const int s = it % kStages;
      const uint32_t stage = s * Cfg::kQBytes;  // the step's Q: sQ + stage
      const uint32_t do_stage = kSplitCols ? 0 : stage;  // and its dO: sdO + do_stage
      mbar_wait(bar_full + 8 * s, (it / kStages) & 1);
      // the step's first query, from the producer with the stage
      const int m0 = sM0[s];

      // S^T = K Q^T and dP^T = V dO^T: (64, kBlockM), K = H in k16 steps, both operands
      // K-major (this warpgroup's 64 rows of K or V, the stage's Q or dO tile).
      float acc_s[kNS], acc_dp[kNS];
      auto issue_rows_by_tile = [&](float (&acc)[kNS], uint64_t rows, uint64_t tile, uint32_t at) {
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const uint32_t col = (kk % 4) * 32, cb = kk / 4;
          Wgmma<kSN>::template ss<T>(
              acc, desc_at(rows, cb * kBlockN * kRowBytes + col),
              desc_at(tile, at + cb * kBlockM * kRowBytes + col), kk > 0);
        }
        wgmma_commit();
      };
      const float* lse = sLse + s * kBlockM + wg_q0;  // this warpgroup's queries'
      const float* delta = sDelta + s * kBlockM + wg_q0;
      // At kBlockM = 64 the step's lse rows are read before S^T is issued, its delta rows
      // while dP^T is in flight (the stall sampling found exp2 waiting on their shared-memory
      // latency); 128 rows' worth of registers would spill.
      constexpr bool kRowsEarly = kBlockM == 64;
      float2 lse_q[kNS / 4], delta_q[kNS / 4];
      auto read_lse = [&](int i) {
        lse_q[i] = *reinterpret_cast<const float2*>(lse + 8 * i + 2 * tig);
      };
      auto read_delta = [&](int i) {
        delta_q[i] = *reinterpret_cast<const float2*>(delta + 8 * i + 2 * tig);
      };
      if constexpr (kRowsEarly) {
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i) read_lse(i);
      }
      wgmma_fence();
      issue_rows_by_tile(acc_s, d_k_rows, d_q, stage);
      if constexpr (kSplitCols) {  // dO may come after Q (its own barrier)
        mbar_wait(bar_do_full, it & 1);
        wgmma_fence();
      }
      issue_rows_by_tile(acc_dp, d_v_rows, d_do, do_stage);

      // P^T = 2^(S^T scale_log2 - lse_log2[q]), 0 at keys >= S and, under causal, at keys
      // past the query (kRules: keys >= kv_len or outside the band -wl <= key - q - shift
      // <= hi); only warps whose 16 keys are not all visible to all the step's queries test
      // elements.
      const int warp_key0 = n0 + wg_key0 + 16 * wi, warp_last_key = warp_key0 + 15;
      bool edge;
      int lo_d = 0, hi_d = 0;  // kRules: key - q in tile offsets (key - warp_key0, q - m0)
      if constexpr (kRules) {
        const int64_t base = int64_t{warp_key0} - m0 - rules.shift;
        lo_d = clamp_diag(-rules.wl - base);
        hi_d = clamp_diag(rules.hi - base);
        edge = warp_last_key >= rules.kv_len || -(kBlockM - 1) < lo_d || 15 > hi_d;
      } else {
        edge = warp_last_key >= s_len || (kCausal && warp_last_key > m0 + wg_q0);
      }
      // Segment ids: unless the warp's keys and the step's queries all carry one id.
      bool seg_edge = false;
      if (seg) {
        const int2 wk = seg->warp_kv[warp - 4];
        seg_edge = !(seg->q_lo[s] == seg->q_hi[s] && wk.x == wk.y && seg->q_lo[s] == wk.x);
      }
      wgmma_wait<1>();
      fence_regs(acc_s);
      // The rules kernel's soft cap, in q.k's units: S^T = c tanh(scale S^T / c) / scale.
      if (kRules && p.softcap > 0.f) {
        const float in = p.scale / p.softcap, out = p.softcap / p.scale;
#pragma unroll
        for (int i = 0; i < kNS; ++i) acc_s[i] = out * tanhf(acc_s[i] * in);
      }
      // S^T += bias^T / scale, in q.k's units, from the step's bias stage (bias warp): block
      // (i, h) of this warp's S^T (keys 8 h .., queries 8 i ..) is an 8 x 8 block of the stage's
      // rows read transposed; four blocks an ldmatrix. Released once read.
      if (kBiasStage && bias_b) {
        mbar_wait(bar_bias_full, it & 1);
        const float inv_scale = 1.f / p.scale;
        const int m = lane / 8;  // the block this lane addresses a row of: i = 2 j + m / 2, h = m % 2
        const uint32_t at = sBias + (8 * (m / 2) + lane % 8) * Cfg::kBiasRowBytes +
                            (wg_key0 + 16 * wi + 8 * (m % 2)) * 2;
#pragma unroll
        for (int j = 0; j < kNS / 8; ++j) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, at + 16 * j * Cfg::kBiasRowBytes);
#pragma unroll
          for (int b4 = 0; b4 < 4; ++b4) {
            const int e = 4 * (2 * j + b4 / 2) + 2 * (b4 % 2);  // element of (i, h)'s c = 0
            const float2 v = unpack2<T>(r[b4]);
            acc_s[e] = fmaf(v.x, inv_scale, acc_s[e]);
            acc_s[e + 1] = fmaf(v.y, inv_scale, acc_s[e + 1]);
          }
        }
        mbar_arrive(bar_bias_empty);
      }
      // Two copies of the loop, with and without the element test: as one loop with the test
      // selected by `edge`, ptxas computed every element's predicate ahead of the S^T GEMM
      // and kept them in registers (P2R) on every step.
      auto p_tile = [&](auto edge_c) {
        constexpr bool kEdge = decltype(edge_c)::value;
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i) {
          if constexpr (!kRowsEarly) read_lse(i);
          const float2 l = lse_q[i];
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float x = exp2_approx(fmaf(acc_s[4 * i + c], p.scale_log2, -(c % 2 ? l.y : l.x)));
            if constexpr (kEdge) {
              const int key = key_row + 8 * (c / 2), q = m0 + wg_q0 + 8 * i + 2 * tig + c % 2;
              if constexpr (kRules) {
                const int d = (key - warp_key0) - (q - m0);
                if (key >= rules.kv_len || d < lo_d || d > hi_d) x = 0.f;
              } else {
                if (key >= s_len || (kCausal && key > q)) x = 0.f;
              }
            }
            acc_s[4 * i + c] = x;
          }
        }
      };
      if (edge)
        p_tile(std::true_type{});
      else
        p_tile(std::false_type{});
      if (seg_edge) {  // P^T = 0 where the query's id is not the key's
        const int kv_id[2] = {seg->kv_ids[key_row - n0], seg->kv_ids[key_row + 8 - n0]};
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i) {
          const int2 q = *reinterpret_cast<const int2*>(&seg->q_ids[s][8 * i + 2 * tig]);
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if ((c % 2 ? q.y : q.x) != kv_id[c / 2]) acc_s[4 * i + c] = 0.f;
        }
      }
      if constexpr (kRowsEarly) {
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i) read_delta(i);
      }
      wgmma_wait<0>();
      fence_regs(acc_dp);
      // dS^T = P^T (dP^T - delta[q]); P^T and dS^T as wgmma A fragments (k16 step kk is
      // accumulator columns 16 kk .. 16 kk + 15, elements 8 kk .. 8 kk + 7).
      constexpr int kSK = kSN / 16;  // k16 steps of this warpgroup's P^T, dS^T
      uint32_t rP[kSK][4], rdS[kSK][4];
#pragma unroll
      for (int i = 0; i < kNS / 4; ++i) {
        if constexpr (!kRowsEarly) read_delta(i);
        const float2 d = delta_q[i];
#pragma unroll
        for (int c = 0; c < 4; ++c)
          acc_dp[4 * i + c] = acc_s[4 * i + c] * (acc_dp[4 * i + c] - (c % 2 ? d.y : d.x));
      }
      // The soft cap's derivative, dS^T *= 1 - tanh^2, with tanh taken back from P^T =
      // 2^(c log2(e) tanh - lse_log2): no register holds it across the dP^T wait. Where P^T
      // is 0 (hidden, or past the query length: lse_log2 = +inf) tanh is -inf or NaN, which
      // the clamp to -1 turns into a factor of 0.
      if (kRules && p.softcap > 0.f) {
        const float to_tanh = 1.f / (p.softcap * 1.4426950408889634f);
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i) {
          const float2 l = *reinterpret_cast<const float2*>(lse + 8 * i + 2 * tig);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const float th = fmaxf((log2f(acc_s[4 * i + c]) + (c % 2 ? l.y : l.x)) * to_tanh, -1.f);
            acc_dp[4 * i + c] *= 1.f - th * th;
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < kSK; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          rP[kk][r] = pack2<T>(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
          rdS[kk][r] = pack2<T>(acc_dp[8 * kk + 2 * r], acc_dp[8 * kk + 2 * r + 1]);
        }

      // dV += P^T dO, and after dQ below dK += dS^T Q: K = kBlockM queries in k16 steps of 16
      // rows (2 swizzle atoms); B MN-major (N = H contiguous), its column blocks kBlockM * 128
      // bytes apart. Three commit groups in the order dV, dQ, dK, so that dQ's stores wait
      // for dQ only and overlap dK. (kSplitCols: A is P^T, dS^T of both warpgroups' queries,
      // from shared memory, after the barrier below.)
      fence_regs(acc_dv);
      fence_regs(acc_dk);
      if constexpr (!kSplitCols) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKM; ++kk)
          Wgmma<kWgCols>::template rs<T>(
              acc_dv, rP[kk], desc_at(d_do_mn, do_stage + kk * 16 * kRowBytes), 1);
        wgmma_commit();
      }
      // dbias = dS (no soft cap beside a bias: select.h), so rdS's blocks, transposed back to
      // the bias's rows (query 8 i + g, keys 8 h + 2 tig and + 1), while dV runs. Every element
      // a visited step covers is written; run_bwd_sm90 zeroes dbias where rules skip steps.
      if (kBiasStage && bias_b) {
        uint16_t* rows = dbias_b + sM0[kStages + s] * bias_hs + warp_key0 + 2 * tig;
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int q = m0 + 8 * i + g;
            const uint32_t x = movmatrix_trans(rdS[i / 2][2 * (i % 2) + h]);
            if (q < t_len && warp_key0 + 8 * h < s_len)
              __stcs(reinterpret_cast<unsigned*>(rows + q * bias_rs + 8 * h), x);
          }
      }

      // dS^T into shared buffer it % 2, rows = keys (kDQT: dS, (kBlockN / 64 column blocks of
      // keys, kBlockM, 64); kSplitCols: P too, in sP). The other warpgroup last read this buffer
      // in its dQ (dV, dK) of step it - 2, which it waited for before its arrival at the
      // barrier (or on ds[buf ^ 1]) of step it - 1: one exchange per step suffices.
      // kSplitCols keeps one buffer of each (sdQ's third slot has the other): both warpgroups
      // meet first, once each has waited for its GEMMs of step it - 1.
      const uint32_t ds_buf = kSplitCols ? 0 : (it % 2) * Cfg::kDSBytes;
      if constexpr (kSplitCols) named_barrier_sync(4, 256);
      const uint32_t sdS_b = sdS + ds_buf;
      if constexpr (kDQT) {
        // rdS[kk] holds the 8 x 8 blocks (query block 2 kk + j / 2, key rows 16 wi + 8 (j % 2)),
        // j = 0 .. 3; lane l stores row l % 8 of block l / 8 transposed: 8 keys of one query.
        // Query 16 kk + 8 (j / 2) + l % 8 is 16 kk rows past this lane's row at kk = 0.
        // (kSplitCols: queries wg_q0 + ..., keys all 64.)
        const int j = lane / 8, q = 8 * (j / 2) + lane % 8;
        const uint32_t at = (wg_key0 / 64) * kBlockM * kRowBytes + (wg_q0 + q) * kRowBytes +
                            (((2 * wi + j % 2) ^ (q % 8)) * 16);
#pragma unroll
        for (int kk = 0; kk < kSK; ++kk) {
          stmatrix_x4_trans(sdS_b + at + kk * 16 * kRowBytes, rdS[kk]);
          if constexpr (kSplitCols)
            stmatrix_x4_trans(base + Cfg::kOffP + ds_buf + at + kk * 16 * kRowBytes, rP[kk]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = 64 * cw + 16 * wi + g + 8 * h;
            const uint32_t off = (i / 8) * kBlockN * kRowBytes + row * kRowBytes +
                                 (((i % 8) ^ (row % 8)) * 16) + tig * 4;
            bwd::sts_u32(sdS_b + off, rdS[i / 2][2 * (i % 2) + h]);
          }
      }
      fence_proxy_async();
      // H = 128 (kDSBar): each warpgroup arrives on ds[buf] and waits for the other only right
      // before its dQ, after issuing dK's first k16 step, which needs its own dS^T alone; with
      // the barrier the wait left the tensor cores without work from either warpgroup. +2-4%
      // at 4k causal, +3-5% at 16k causal, 0-5% at 16k plain; at H = 64 (8 k16 steps of dK) it
      // measured -1 to -2% at 16k plain (NOTES.md, thirty-second session).
      constexpr bool kDSBar = !kSplitCols && kHeadDim == 128;
      if constexpr (kDSBar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_ds + 8 * (it % 2));
      } else {
        named_barrier_sync(1, 256);
      }

      float acc_dq[32];
      if constexpr (kSplitCols) {
        // dV, both rounds of dQ (the second into acc_dq1), dK: four commit groups, waited for
        // in turn, so that dQ's stores overlap the GEMMs queued behind.
        float acc_dq1[32];
        // acc += A B over the step's queries: A = P^T or dS^T (buffer ds_buf), B = dO or Q
        auto issue_kv = [&](float (&acc)[kNKV], uint64_t a, uint64_t b, uint32_t b_at) {
#pragma unroll
          for (int kk = 0; kk < kKM; ++kk)
            Wgmma<kWgCols>::template tt<T>(acc, desc_at(a, ds_buf + kk * 16 * kRowBytes),
                                           desc_at(b, b_at + kk * 16 * kRowBytes), 1);
          wgmma_commit();
        };
        wgmma_fence();
        issue_kv(acc_dv, d_p_mn, d_do_mn, do_stage);
        issue_dq(acc_dq, ds_buf, 0);
        issue_dq(acc_dq1, ds_buf, 1);
        issue_kv(acc_dk, d_ds, d_q_mn, stage);
        wgmma_wait<2>();  // dV and the first dQ
        fence_regs(acc_dq);
        fence_regs(acc_dv);
        mbar_arrive(bar_do_empty);  // dP^T and dV have read dO
        store_dq(acc_dq, kDQRounds * it);
        wgmma_wait<1>();
        fence_regs(acc_dq1);
        store_dq(acc_dq1, kDQRounds * it + 1);
        wgmma_wait<0>();  // dK: the stage's Q is read
        fence_regs(acc_dk);
        mbar_arrive(bar_empty + 8 * s);
      } else {
        // dK += dS^T Q over k16 steps k0 .. k1 - 1. Its first step goes before the wait for the
        // other warpgroup's dS^T (kDSBar), the rest after dQ so that dQ's stores overlap them
        // (none, 2 or all 4 of its steps before the wait measured below 1). Each part opens
        // with a wgmma fence: without them (the registers allow it) the change measured 1-2%
        // slower than the barrier instead of 2-5% faster.
        auto issue_dk = [&](int k0, int k1) {
          if constexpr (kDSBar) wgmma_fence();
#pragma unroll
          for (int kk = k0; kk < k1; ++kk)
            Wgmma<kWgCols>::template rs<T>(
                acc_dk, rdS[kk], desc_at(d_q_mn, stage + kk * 16 * kRowBytes), 1);
          wgmma_commit();
        };
        constexpr int kDKEarly = kDSBar ? 1 : 0;
        if constexpr (kDSBar) {
          issue_dk(0, kDKEarly);
          mbar_wait(bar_ds + 8 * (it % 2), (it / 2) & 1);
        }
        issue_dq(acc_dq, ds_buf, 0);
        issue_dk(kDKEarly, kKM);
        wgmma_wait<1>();  // dV, dK's first steps and dQ (groups retire in order)
        fence_regs(acc_dq);
        fence_regs(acc_dv);
        store_dq(acc_dq, it);
        wgmma_wait<0>();  // dK: the stage's Q and dO are read
        fence_regs(acc_dk);
        mbar_arrive(bar_empty + 8 * s);
      }
    }
    if (skip_last) {
      // Zeros for this warpgroup's keys of dS (the step's buffer: the other warpgroup's dQ of
      // step it - 2 read it before its ds arrival of step it - 1), the exchange, dQ.
      const int it = n_steps - 1;
      const uint32_t ds_buf = (it % 2) * Cfg::kDSBytes;
      uint4* half = reinterpret_cast<uint4*>(smem + Cfg::kOffDS + ds_buf +
                                             (wg_key0 / 64) * kBlockM * kRowBytes);
#pragma unroll
      for (int i = 0; i < kBlockM * kRowBytes / 16 / 128; ++i)
        half[tid % 128 + 128 * i] = make_uint4(0, 0, 0, 0);
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_ds + 8 * (it % 2));
      mbar_wait(bar_ds + 8 * (it % 2), (it / 2) & 1);
      float acc_dq[32];
      issue_dq(acc_dq, ds_buf, 0);
      wgmma_wait<0>();
      fence_regs(acc_dq);
      store_dq(acc_dq, it);
    }

    // dK = scale * acc_dk, dV = acc_dv in the input dtype (or fp32: grads_f32); keys past S
    // are not stored. They go through shared memory so that the global stores are whole
    // 16-byte pieces of rows (the accumulator layout gives a thread 4 bytes of each of 8 rows
    // per instruction). Once both warpgroups pass the barrier their last GEMMs have read sK ..
    // sdS, and the producer loads nothing after the last step; the dQ writer keeps sdQ.
    named_barrier_sync(1, 256);
    auto store = [&](auto* gdk, auto* gdv) {
      using Out = std::remove_pointer_t<decltype(gdk)>;
      // Rows of kWgCols + 8 elements: a warp's 8 rows of 4 (or, fp32, 8) bytes fall in
      // distinct banks.
      constexpr int kPitch = (kWgCols + 8) * sizeof(Out);
      static_assert(4 * 64 * kPitch <= Cfg::kOffLse, "dK, dV of both warpgroups in sK .. sdS");
      unsigned char* s_dk = smem + 2 * cw * 64 * kPitch;  // (64, kWgCols + 8) each
      unsigned char* s_dv = s_dk + 64 * kPitch;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * wi + g + 8 * h;
#pragma unroll
        for (int i = 0; i < kNKV / 4; ++i) {
          const int at = row * kPitch + (8 * i + 2 * tig) * static_cast<int>(sizeof(Out));
          const float dk0 = acc_dk[4 * i + 2 * h] * p.scale, dk1 = acc_dk[4 * i + 2 * h + 1] * p.scale;
          const float dv0 = acc_dv[4 * i + 2 * h], dv1 = acc_dv[4 * i + 2 * h + 1];
          if constexpr (std::is_same_v<Out, float>) {
            *reinterpret_cast<float2*>(s_dk + at) = make_float2(dk0, dk1);
            *reinterpret_cast<float2*>(s_dv + at) = make_float2(dv0, dv1);
          } else {
            *reinterpret_cast<uint32_t*>(s_dk + at) = pack2<T>(dk0, dk1);
            *reinterpret_cast<uint32_t*>(s_dv + at) = pack2<T>(dv0, dv1);
          }
        }
      }
      named_barrier_sync(2 + cw, 128);
      // 16-byte chunks of the rows, consecutive threads along a row (outputs are dense:
      // rows of K * H elements, H a multiple of 8).
      constexpr int kChunks = kWgCols * sizeof(Out) / 16, kPer = 16 / sizeof(Out);
      for (int idx = tid % 128; idx < 64 * kChunks; idx += 128) {
        const int r = idx / kChunks, c = idx % kChunks, key = n0 + wg_key0 + r;
        if (key >= s_len) continue;
        *reinterpret_cast<uint4*>(gdk + key * p.dk_row_stride + c * kPer) =
            *reinterpret_cast<const uint4*>(s_dk + r * kPitch + 16 * c);
        *reinterpret_cast<uint4*>(gdv + key * p.dv_row_stride + c * kPer) =
            *reinterpret_cast<const uint4*>(s_dv + r * kPitch + 16 * c);
      }
    };
    const int col0 = kSplitCols ? kWgCols * cw : 0;  // this warpgroup's first column
    const int64_t dk_at = b * p.dk_batch_stride + kvh * p.dk_head_stride + col0;
    const int64_t dv_at = b * p.dv_batch_stride + kvh * p.dv_head_stride + col0;
    if (p.grads_f32)
      store(static_cast<float*>(p.dk) + dk_at, static_cast<float*>(p.dv) + dv_at);
    else
      store(static_cast<T*>(p.dk) + dk_at, static_cast<T*>(p.dv) + dv_at);
  }
#else
  __trap();  // only the sm_90a build of this kernel is ever launched (see select.h)
#endif
}

// The preprocess beside the main kernel (run_bwd_sm90, BwdParams::prep_done): delta, lse_log2
// and dq_accum's zeros as the sm80 pass (flash_bwd.cuh preprocess_kernel and lse_row), each
// warp on rounds of 16 query rows of one head, adding the rows it has done to their (b, kv
// head) pair's count. The main kernel is a dependent launch that does not wait for this grid:
// each of its CTAs waits once, for its pair's count, before its first lse and delta copies and
// its first dQ add. The full-grid pass holds every SM for ~9000 SM-us at 4k (68 us), where a
// few SMs move the same bytes at twice the rate each. So blocks [0, persistent) take the later
// pairs' rows, one SM each (kSmem keeps the main kernel's CTAs off their SMs), while the main
// kernel takes the other SMs; the first pairs' rows, which the first wave needs at once, go in
// smaller units to the other blocks, which exit to make room for the main kernel's CTAs. The
// warps never wait for each other: each counts its own rows, with a release (MEMBAR.ALL, no SC
// fence). H200, D=128: the pass alone 240 us on 16 SMs at 4k causal (56 GB/s an SM: one head's
// rows lie 4 KB apart, and such strides ran at 55 GB/s in a micro-benchmark, whole rows at 85),
// the backward +1-2% at 4k-16k causal, +1-6% at 2k-4k plain (NOTES.md, forty-fifth session).
template <int kHeadDim>
struct PrepBeside {
  static constexpr int kThreads = 512, kWarps = kThreads / 32;
  static constexpr int kRound = 16;                        // rows a warp takes at a time
  static constexpr int kUnitFirst = kRound * kWarps;        // rows a unit of the first pairs
  // Rows a unit of the later pairs (a warp's release every 4 rounds): the pass on 16 SMs took
  // 248 us at 4k causal; at 16 rounds 260 (a head a unit: 56 units on 16 blocks).
  static constexpr int kUnitLater = 4 * kUnitFirst;
  // 8-column chunks a lane: at 1 (16 lanes a row) the pass took 334 us.
  static constexpr int kChunks = 2;
  using Rows = bwd::RowChunks<kHeadDim, kChunks>;
  static constexpr int kLanes = Rows::kLanes, kRowsIter = 32 / kLanes;
  static constexpr int kIters = kRound / kRowsIter;
  // Iterations whose loads fly at once: 16 pieces of 16 bytes a lane.
  static constexpr int kBatch = kIters < 8 / kChunks ? kIters : 8 / kChunks;
  static constexpr int kSmem = 120 * 1024;
  // Persistent blocks: 32 ran the pass in half the time, with no better backward.
  static constexpr int kPersistent = 16;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "sm90 backward head dims");
  static_assert(kLanes * kChunks * 8 == kHeadDim, "a row's lanes take kChunks each of dO and O");
};

// Units of (pair, head of its group, kUnit rows of [0, t_pad)): the first_pairs pairs' on
// blocks [persistent, gridDim.x), the later ones' on blocks [0, persistent).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(PrepBeside<kHeadDim>::kThreads, 1)
    prep_beside_kernel(const BwdParams p, int persistent, int first_pairs) {
  using Cfg = PrepBeside<kHeadDim>;
  constexpr int kLanes = Cfg::kLanes, kBatch = Cfg::kBatch;
  pdl_trigger();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_lane = lane % kLanes;  // this lane's chunks of its row: row_lane + kLanes h
  const bool later = static_cast<int>(blockIdx.x) < persistent;
  const int unit_rows = later ? Cfg::kUnitLater : Cfg::kUnitFirst;
  const int t_len = static_cast<int>(p.t), t_pad = static_cast<int>(p.t_pad);
  const int group = static_cast<int>(p.n / p.kh), chunks = (t_pad + unit_rows - 1) / unit_rows;
  const int pair0 = later ? first_pairs : 0;
  const int units = ((later ? static_cast<int>(p.b * p.kh) : first_pairs) - pair0) * group * chunks;
  const int stride = later ? persistent : static_cast<int>(gridDim.x) - persistent;
  for (int u = later ? blockIdx.x : blockIdx.x - persistent; u < units; u += stride) {
    const int pair = pair0 + u / (group * chunks);
    const int64_t b = pair / p.kh, n = pair % p.kh * group + u / chunks % group;
    const int64_t bn = b * p.n + n;
    const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + n * p.do_head_stride;
    const T* out = static_cast<const T*>(p.o) + b * p.o_batch_stride + n * p.o_head_stride;
    const int t_end = min(u % chunks * unit_rows + unit_rows, t_pad);
    int counted = 0;
    for (int r0 = u % chunks * unit_rows + warp * Cfg::kRound; r0 < t_end;
         r0 += Cfg::kWarps * Cfg::kRound) {
      counted += min(Cfg::kRound, t_pad - r0);
#pragma unroll
      for (int i0 = 0; i0 < Cfg::kIters; i0 += kBatch) {
        // kBatch rows of this lane: loads first, then dq_accum's zeros, then the sums
        uint4 d[kBatch][Cfg::kChunks], o[kBatch][Cfg::kChunks];
        float lse[kBatch], dlse[kBatch];
        int t[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          t[i] = r0 + (i0 + i) * Cfg::kRowsIter + lane / kLanes;
          lse[i] = t[i] < t_len ? p.lse[bn * p.t + t[i]] : -INFINITY;
          dlse[i] = t[i] < t_len && p.dlse ? p.dlse[bn * p.t + t[i]] : 0.f;
          if (t[i] >= t_len) continue;
#pragma unroll
          for (int h = 0; h < Cfg::kChunks; ++h) {
            d[i][h] = __ldcs(reinterpret_cast<const uint4*>(dout + t[i] * p.do_row_stride) +
                             row_lane + kLanes * h);
            o[i][h] = __ldcs(reinterpret_cast<const uint4*>(out + t[i] * p.o_row_stride) +
                             row_lane + kLanes * h);
          }
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (t[i] >= t_len) continue;
          float4* dqa = reinterpret_cast<float4*>(p.dq_accum + ((b * p.t + t[i]) * p.n + n) * kHeadDim);
#pragma unroll
          for (int h = 0; h < kHeadDim / 4 / kLanes; ++h)
            dqa[row_lane + kLanes * h] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          float acc = 0.f;
          if (t[i] < t_len) {
#pragma unroll
            for (int h = 0; h < Cfg::kChunks; ++h) {
              const uint32_t dw[4] = {d[i][h].x, d[i][h].y, d[i][h].z, d[i][h].w};
              const uint32_t ow[4] = {o[i][h].x, o[i][h].y, o[i][h].z, o[i][h].w};
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const float2 df = unpack2<T>(dw[k]), of = unpack2<T>(ow[k]);
                acc += of.x * df.x + of.y * df.y;
              }
            }
          }
#pragma unroll
          for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
          if (row_lane == 0 && t[i] < t_pad) {
            p.lse_log2[bn * t_pad + t[i]] = bwd::lse_log2_of(lse[i]);
            p.delta[bn * t_pad + t[i]] = t[i] < t_len ? acc - dlse[i] : 0.f;
          }
        }
      }
    }
    // The warp's rows are written (its lanes' stores before lane 0's release).
    __syncwarp();
    if (lane == 0 && counted > 0) red_add_release(p.prep_done + pair, counted);
  }
}

}  // namespace sm90

// The (b, kv head) pairs in a section of the backward's grid (the kernel's blockIdx order).
// Under causal masking a pair's CTAs run from S / 64 steps (key tile 0) down to 2, and one pair
// after another leaves the last pairs' longest CTAs to start in the last wave: at 4k, 93% of the
// SMs' cycles active (ncu). Sections of pairs whose key tiles fill a wave, their Q, dO and
// dq_accum 32 MB of the L2, start them a wave earlier: 98%, and the kernel 3-4% faster at 3k-8k,
// level at 16k. With the first-store tickets (up to 2k keys) half a wave: a CTA that reaches a
// query tile before the tile's own CTA has started stores its first dQ and the others wait for
// that store, so a pair's CTAs should start close together (0.7-2% faster at 1k-2k; a wave:
// 1% slower at D=128 1k). NOTES.md, twenty-second session.
inline int bwd_section_pairs(const BwdParams& p, int64_t key_tiles, bool causal) {
  const int64_t pairs = p.b * p.kh;
  if (!causal || live_variant(p) || pairs <= 1) return 1;
  const int64_t pair_bytes = std::max<int64_t>(p.t * p.h * 8 * (p.n / p.kh), 1);
  const int64_t fit = std::max<int64_t>((int64_t{32} << 20) / pair_bytes, 1);
  const int64_t ctas = p.dq_first_store ? sm_count() / 2 : sm_count();
  int64_t w = 1;
  while (w * key_tiles < ctas && 2 * w <= fit) w *= 2;
  return static_cast<int>(std::min(w, pairs));
}

// The dq slots of run_bwd_sm90's grid (DqSlots, but for `done`) where its CTAs are
// `key_tiles` a pair, the last `deferred` of them after all the sections; returns the grid's
// blocks with them (0: no slots; s then unspecified).
inline int64_t plan_dq_slots(DqSlots& s, const BwdParams& p, int64_t key_tiles, int64_t deferred,
                             int sec_pairs, int block_n, int sms) {
  auto up = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t pairs = p.b * p.kh;
  // A group: whole sections, about a wave of CTAs.
  s.pairs = sec_pairs * static_cast<int>(std::max<int64_t>(1, sms / key_tiles / sec_pairs));
  // (the slot's table of its heads' offsets: 16 bytes a head in shared memory)
  if (s.pairs * (p.n / p.kh) > 4096) return 0;
  s.groups = static_cast<int>(up(pairs, s.pairs));
  // Two waves of CTAs between a group's last CTA and its slots: under causal masking its
  // longest CTA (its first) runs for about two waves of the others.
  s.lag = static_cast<int>(up(2 * sms, s.pairs * (key_tiles - deferred)));
  s.rows = static_cast<int>(std::min<int64_t>(p.t, (key_tiles - deferred) * block_n));
  // About 1 MB of dq_accum a slot among the CTAs; 256 KB after them, where they fill the SMs
  // that the last CTAs leave.
  const int64_t token_bytes = s.pairs * (p.n / p.kh) * p.h * 4;
  s.mid_rows = static_cast<int>(std::max<int64_t>(1, (int64_t{1} << 20) / token_bytes));
  s.end_rows = static_cast<int>(std::max<int64_t>(1, (int64_t{256} << 10) / token_bytes));
  s.def_rows = s.rows < p.t ? s.end_rows : 0;
  const int64_t lag = std::min(s.lag, s.groups - 1), mid_groups = s.groups - 1 - lag;
  return pairs * key_tiles + mid_groups * up(s.rows, s.mid_rows) +
         (s.groups - mid_groups) * up(s.rows, s.end_rows) +
         (s.def_rows ? s.groups * up(p.t - s.rows, s.def_rows) : 0);
}

// The sm90 backward on `stream`: preprocess, the main kernel above, convert; false (nothing
// launched) when the TMA descriptors cannot be built. Preconditions (select.h use_bwd_sm90):
// a cc 9.x device, no variants but those of sm90_bwd_variants_ok, H == Hv == kHeadDim, T,
// S > 0. The rules kernel covers causal too, so each file compiles it once.
template <typename T, int kHeadDim, bool kCausal>
bool run_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Cfg = sm90::BwdCfgSm90<T, kHeadDim>;
  static_assert(Cfg::kBlockN == bwd_block_n(kHeadDim) && Cfg::kBlockM == bwd_block_m(kHeadDim),
                "bwd_workspace sizes dq_turn and kv_seg_range by these tiles");
  CUtensorMap tma_q, tma_k, tma_v, tma_do, tma_dq;
  if (!sm90::encode_btnh<T>(&tma_q, p.q, p.h, p.n, p.t, p.b, p.q_head_stride, p.q_row_stride,
                            p.q_batch_stride, Cfg::kBlockM) ||
      !sm90::encode_btnh<T>(&tma_do, p.dout, p.hv, p.n, p.t, p.b, p.do_head_stride,
                            p.do_row_stride, p.do_batch_stride, Cfg::kBlockM) ||
      !sm90::encode_btnh<T>(&tma_k, p.k, p.h, p.kh, p.s, p.b, p.k_head_stride, p.k_row_stride,
                            p.k_batch_stride, Cfg::kBlockN) ||
      !sm90::encode_btnh<T>(&tma_v, p.v, p.hv, p.kh, p.s, p.b, p.v_head_stride, p.v_row_stride,
                            p.v_batch_stride, Cfg::kBlockN) ||
      // dq_accum: (B, T, N, H) fp32, dense
      !sm90::encode_btnh<float>(&tma_dq, p.dq_accum, p.h, p.n, p.t, p.b, p.h, p.n * p.h,
                                p.t * p.n * p.h, Cfg::kBlockM))
    return false;
  // Causal at up to 2048 keys: dq_accum is not zeroed, the kernel stores each query tile's first
  // contribution (+4-9% at 1k). The waits for a tile's store cost ~2% at 4k-16k, where the
  // zeros cost under 1% (NOTES.md, eighteenth session).
  BwdParams q = p;
  q.dq_first_store = kCausal && !live_variant(p) && !p.deterministic && p.dq_ticket && p.s <= 2048;
  q.t_pad = bwd_t_pad(p.t);  // the producer copies whole tiles of lse_log2 and delta
  static_assert(128 % Cfg::kBlockM == 0, "bwd_t_pad pads to whole tiles");
  // The main kernel and the conversion after it are dependent launches, each directly after
  // the kernel it waits for (the workspaces' setup goes first).
  const BwdWorkspace w = bwd_workspace(p);
  if (w.dq_turn) cudaMemsetAsync(p.dq_turn, 0, w.dq_turn * sizeof(int), stream);
  // Every key tile walks every query tile: no rule hides one.
  const bool full_walks = !p.is_causal && !p.q_lengths && !p.kv_lengths && p.window_left < 0 &&
                          p.window_right < 0 && !p.bottom_right;
  // dbias (select.h: no broadcast dim) is written where the steps go; rules or segment ids that
  // skip steps leave the rest to these zeros.
  if (p.bias && !(full_walks && !p.q_segment_ids))
    cudaMemsetAsync(p.dbias, 0, bias_elements(p) * sizeof(T), stream);
  const int64_t key_tiles = (p.s + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (w.kv_seg_range) bwd::launch_key_tile_seg<Cfg::kBlockN>(p, key_tiles, stream);
  int64_t grid = key_tiles * p.kh * p.b;  // < 2^31 for anything that fits in memory
  const int sec_pairs = bwd_section_pairs(q, key_tiles, kCausal);
  // The preprocess beside the main kernel (prep_beside_kernel) where the main kernel takes
  // more than two waves and its pass would zero dq_accum (variants: the pass before).
  using Prep = sm90::PrepBeside<kHeadDim>;
  const int sms = sm_count();
  const int64_t pairs = p.b * p.kh;
  if (!live_variant(p) && !p.deterministic && !q.dq_first_store && !p.o_f32 && p.prep_done &&
      grid > 2 * sms && p.b * p.n * q.t_pad < INT_MAX && sms > 2 * Prep::kPersistent) {
    q.prep_rows = static_cast<int>(q.t_pad * (p.n / p.kh));
    // The first wave's pairs: a section, or the pairs of the first (sms - kPersistent) CTAs.
    const int64_t first = std::min(
        pairs, std::max<int64_t>(sec_pairs, (sms - Prep::kPersistent + key_tiles - 1) / key_tiles));
    auto prep = sm90::prep_beside_kernel<T, kHeadDim>;
    if (cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, Prep::kSmem) !=
        cudaSuccess)
      return false;
    // dq converted by slots of the main kernel's grid, each after its group's CTAs (DqSlots):
    // most of the conversion pass's bytes move while the main kernel runs, a few SMs at a time,
    // and the pass's launch after the main kernel's last CTA goes. H200, D=128: +1-2% at 16k
    // causal, +2% at 4k plain, +5% at 1k plain, level at 4k causal (NOTES.md, forty-sixth
    // session).
    // (past the tickets, not deterministic: the causal kernel defers its shortest key tiles)
    DqSlots slots;
    const int64_t slot_grid = plan_dq_slots(slots, q, key_tiles,
                                            kCausal ? sm90::deferred_key_tiles(key_tiles) : 0,
                                            sec_pairs, Cfg::kBlockN, sms);
    if (slot_grid > 0) {
      grid = slot_grid;
      q.dq_slots = slots;
      q.dq_slots.done = p.prep_done + pairs;
    }
    cudaMemsetAsync(p.prep_done, 0, (pairs + 2 * q.dq_slots.groups) * sizeof(int), stream);
    prep<<<sms, Prep::kThreads, Prep::kSmem, stream>>>(q, Prep::kPersistent, static_cast<int>(first));
  } else {
    bwd::launch_preprocess<T, kHeadDim, kHeadDim>(q, stream);
  }
  // Deterministic attention whose key tiles all walk all query tiles (plain, or segment ids
  // alone) in rotated walks where a pair's CTAs fit twice over on the SMs: +5-20% at 1k-4k
  // (D=64-256); level to 2% slower where a pair takes half the SMs or more (its CTAs start
  // across waves; NOTES.md, twenty-seventh session).
  q.rotate_walk = !kCausal && p.deterministic && full_walks && 2 * key_tiles <= sm_count();
  // H = 256 has no rules kernel (select.h sends its variants to sm80).
  constexpr bool kHasRules = !Cfg::kSplitCols;
  auto kernel = q.dq_first_store ? sm90::flash_bwd_sm90_kernel<T, kHeadDim, kCausal, false, kCausal>
                                 : sm90::flash_bwd_sm90_kernel<T, kHeadDim, kCausal, false>;
  if constexpr (kHasRules)
    if (live_variant(p)) kernel = sm90::flash_bwd_sm90_kernel<T, kHeadDim, false, true>;
  // A failure shows up in the caller's cudaGetLastError(). Without a bias the bias stage (the
  // layout's end) is left out.
  const int smem = Cfg::kSmemBytes - (p.bias ? 0 : Cfg::kBiasBytes);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) ==
      cudaSuccess)
    launch_dependent(kernel, grid, Cfg::kThreads, smem, stream, q, tma_q, tma_k,
                          tma_v, tma_do, tma_dq, static_cast<int>(key_tiles), sec_pairs);
  if (!q.dq_slots.done) bwd::launch_convert_dq<T, kHeadDim>(p, stream, /*dependent=*/true);
  return true;
}

}  // namespace jaxflash::cuda
