// FlashAttention-3-style forward for Hopper (sm_90a): TMA loads, wgmma, warp specialization.
//
// A CTA of 1 + kWGs warpgroups owns a (kBlockM = 64 kWGs, H) tile of queries of one (batch b,
// head n):
//   - warpgroup 0, the producer, gives up registers (setmaxnreg.dec); one thread issues the
//     TMA copies: the Q tile once, then the (kBlockN, H) K and V tiles of kv head n / group
//     into 2-stage shared-memory rings, each completing on its own mbarrier;
//   - the kWGs (2, or 3 at H = 64) consumers take the registers (setmaxnreg.inc) and own 64
//     query rows each: S = Q K^T by wgmma from shared memory, the online softmax in
//     registers, then O += P V by wgmma with P from registers; they hand a K stage back to
//     the producer through its "empty" mbarrier once all S GEMMs have read it, and a V stage
//     once all P V GEMMs have (a stage of both would wait for the slowest warpgroup's P V and
//     expose the next K's load). As in FA3, S of tile j + 1 and P V of tile j are in flight
//     together while the softmax of j + 1 runs.
// A warp stalls at each wgmma it issues until the tensor cores' queue takes it, which holds
// only a few: issuing S and P V of a step blocks a consumer for about the time they take
// (~800 of a 3000-cycle step at H = 64 with 2 consumers, clock64 trace). Its softmax can
// start only after that, so at H = 64, where the exp2s (MUFU) take as long as the GEMMs, a
// third consumer keeps the tensor cores and the MUFU busy while the other two are blocked
// or in their softmax (FA3's 192-row tiles at H <= 64).
// At H >= 128 the softmax keeps a lazy running max (softmax_lazy): the exp2s of a tile start
// against the max of the tiles before, without waiting for the tile's own, which moves it
// only when it has grown by more than 8 (log2 units), so that O is rarely rescaled either.
// Key tiles are visited last to first, so that the tiles needing a mask (past S, or on the
// causal diagonal) come first; masking is skipped on every other tile.
// Persistent kernels (kPersistent; run_fwd_sm90 says where): one CTA per SM walks the query
// tiles, causal ones from a counter in L2 sections of heads, longest first. The rings' stages
// and phases run on across tiles; a tile's first K loads before its Q, which waits until every
// consumer's last S GEMMs of the tile before have read sQ; O leaves through an sO of its own
// by TMA stores, so the consumers go on to the next tile while it is written.
//
// Variants: a second instantiation, kRules, runs the rules that only hide whole regions of
// keys: lengths, window, causal alignment (Rules) and segment ids (SegShared). It visits only
// the key tiles that some query of the CTA may see and tests elements only on tiles that a
// warp's 16 rows do not see whole. It also runs the variants of the logits on every tile: the
// soft cap, ALiBi and a bias (producer warp 1 copies each tile's bias rows into a stage of
// each consumer warpgroup by bulk copies).
// Mask and dropout, and the fp32 O that the backward of a bias or ALiBi takes (params.h
// o_f32), run on the sm80 variant kernel (select.h).
//
// Shared tiles are TMA's 128-byte swizzle: a (rows, H) tile is H / 64 column blocks of
// (rows, 64) elements, each row 128 bytes with its 16-byte chunk c stored at c ^ (row % 8).
// Every block starts on a 1024-byte boundary, so the wgmma descriptors (128B swizzle, base
// offset 0) see the same pattern. K-major operands (Q, K) step 16 elements along H by adding
// 32 bytes inside a column block; V is read as an MN-major B operand (N = H contiguous).
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
#include "../launch.h"
#include "../mma.cuh"
#include "../pdl.cuh"
#include "hopper.cuh"
#include "rules.cuh"
#include "wgmma_gen.h"

namespace jaxflash::cuda {
namespace sm90 {

// Key tile widths: 192 keys (the d64 plain kernels) amortise the softmax's reductions and
// barriers over more work, as in FA3; tiles cut by a diagonal (kMasked: causal or the rules
// of Rules below) keep 128, so less of each boundary tile is wasted, and so do kNarrow
// kernels: the persistent d128 one, to leave room for sO (with the lazy max it measured level
// to +7% against FA3's 176-key tiles at 2k-16k, fourteenth session), and d64 where S leaves a
// wide last tile mostly empty (run_fwd_sm90). d256 runs FA3's 80 keys: Q (64 KB) and two
// stages each of K and V (40 KB) fill the shared memory, O (128 registers a thread) and the
// S in flight the consumers' registers.
template <int kHeadDim, bool kMasked, bool kNarrow>
struct FwdTileSm90 {
  static_assert(kHeadDim != 128 || kMasked || kNarrow, "d128 runs 128-key tiles");
  static constexpr int kBlockN = kHeadDim == 256 ? 80 : kMasked || kNarrow ? 128 : 192;
};

// Segment ids (query t sees key s only if q_seg[b, t] == kv_seg[b, s]) in the rules kernel.
// Disjoint id ranges share no id, so a key tile whose keys' [min, max] id range misses the
// query tile's is never visited. Before the warps specialise, all 12 warps mark the visited
// tiles of the Rules range in `live` (warp reductions over the ids) and count them, so the
// producer and both consumers agree on the tiles and their number once per CTA. The producer
// warp walks the bits and hands the consumers, with each stage, the tile, its keys' ids and
// their range: a consumer warp whose rows all carry the one id of every key skips the test.
template <int kBlockN, int kStages>
struct SegShared {
  // Bits kept for 32K candidate tiles (4M keys); a CTA with more visits those past them all,
  // with the element test (correct, not skipped).
  static constexpr int kLiveTiles = 32 * 1024;
  int kv_ids[kStages][kBlockN];   // (kStages, kBlockN) ids of the stage's keys in the CTA's range
  int kv_lo[kStages], kv_hi[kStages];  // their range
  int tile[kStages];              // key tile j the stage holds
  int num_live;                   // visited tiles
  uint32_t live[kLiveTiles / 32];  // bit r: candidate tile j_lo + r is visited

  // The highest visited candidate r' <= r (r' >= 0 as long as the count says one is left).
  __device__ int prev_live(int r) const {
    while (r >= 0 && r < kLiveTiles) {
      const uint32_t w = live[r / 32] & (0xffffffffu >> (31 - r % 32));  // bits 0 .. r % 32
      if (w != 0) return (r & ~31) + 31 - __clz(static_cast<int>(w));
      r = (r & ~31) - 1;
    }
    return r;
  }
};

// A warp's share of the 128 ids from `base`: v[k] = ids[i] for i = base + lane + 32 k (so that
// v[k] belongs to tile column lane + 32 k) where lo <= i < end (0 elsewhere, never read), and
// the (min, max) of those over the warp, (INT_MAX, INT_MIN) when none is: a range that meets
// no other.
__device__ __forceinline__ int2 load_ids(int (&v)[4], const int32_t* ids, int base, int lo,
                                         int end, int lane) {
  int id_lo = INT_MAX, id_hi = INT_MIN;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = base + lane + 32 * k;
    const bool valid = i >= lo && i < end;
    v[k] = valid ? ids[i] : 0;
    if (valid) {
      id_lo = min(id_lo, v[k]);
      id_hi = max(id_hi, v[k]);
    }
  }
  return make_int2(__reduce_min_sync(0xffffffffu, id_lo), __reduce_max_sync(0xffffffffu, id_hi));
}

// S (64, N) = Q K^T of a warpgroup from its descriptors d_q (rows of kBlockM) and d_k (the K
// stage at byte `stage`, rows of kBlockN): H / 16 k16 steps, each 32 bytes into a 128-byte
// swizzled row, column block kk / 4. `first` (a tile's first S): each column block of Q past the
// first is waited for on q[cb] (bar_q + 8 cb, phase parity `parity`) right before its first
// step; ptxas closes the wgmma group before each wait. Committed, not waited for.
template <typename T, int N, int kHeadDim, int kBlockM, int kBlockN>
__device__ __forceinline__ void issue_s(float (&acc)[N / 2], uint64_t d_q, uint64_t d_k,
                                        uint32_t stage, bool first, uint32_t bar_q,
                                        uint32_t parity) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    if (first && kk % 4 == 0 && kk > 0) mbar_wait(bar_q + 8 * (kk / 4), parity);
    Wgmma<N>::template ss<T>(acc, desc_at(d_q, (kk / 4) * kBlockM * 128 + (kk % 4) * 32),
                             desc_at(d_k, stage + (kk / 4) * kBlockN * 128 + (kk % 4) * 32),
                             kk > 0);
  }
  wgmma_commit();
}

// The split last round of a persistent plain kernel (launch_fwd says where): with n_tiles =
// F SMs + tiles, the kernel runs F whole rounds, and instead of one more tile on `tiles` of the
// SMs and none on the rest, the same kernel with kPieces runs the last tiles' key tiles: their
// tiles * nb key tiles, in tile order, cut into `ctas` runs of equal length (to one key tile),
// one a CTA, launched as a dependent of the whole rounds. A run is at most nb key tiles (ctas >=
// tiles), so it holds pieces of at most two tiles. Every piece writes its partial O and (m, l)
// rows to slot 2 c + i (CTA c's piece i); the last piece of a tile to finish merges them all.
struct FwdTail {
  int tiles, ctas, nb;
  // CTA c's run: key tiles [start(c), start(c + 1)) of the tail
  __device__ int start(int c) const {
    return static_cast<int>(int64_t{c} * tiles * nb / ctas);
  }
  // the CTA whose run holds key tile u: the last c with start(c) <= u
  __device__ int cta_of(int u) const {
    const int64_t units = int64_t{tiles} * nb;
    return static_cast<int>(((u + 1) * int64_t{ctas} + units - 1) / units) - 1;
  }
};

// Slot `slot`'s partial O of warpgroup w's thread tw: (slots, kWGs, kNO / 4, 128) float4, the
// thread's accumulator floats 4 i .. 4 i + 3 at + 128 i, so that a warp's stores are 512 bytes
// in a row.
template <int kNO>
__device__ __forceinline__ float4* split_slot_o(float* base, int slot, int wgs, int w, int tw) {
  return reinterpret_cast<float4*>(base) + (int64_t{slot} * wgs + w) * (kNO / 4) * 128 + tw;
}

// kPersistent: a grid of one CTA per SM (see the kernel); kNarrow: 128-key tiles
// (FwdTileSm90); kWGs: consumer warpgroups (3 only at H = 64, in 160 registers: S, P and O
// take 128); run_fwd_sm90 says where each runs.
template <typename T, int kHeadDim, bool kCausal, bool kRules, bool kPersistent, bool kNarrow,
          int kWGs>
struct FwdCfgSm90 {
  static constexpr bool kMasked = kCausal || kRules;
  static_assert(!(kPersistent && kRules), "the rules kernel runs one tile a CTA");
  static constexpr bool kDynamic = kPersistent && kCausal;  // next tile from a counter
  static_assert(kWGs == 2 || (kWGs == 3 && !kRules), "3 consumer warpgroups: not the rules kernel");
  static constexpr int kBlockM = 64 * kWGs;  // each consumer warpgroup owns 64 rows (wgmma's M)
  static constexpr int kBlockN = FwdTileSm90<kHeadDim, kMasked, kNarrow>::kBlockN;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kWGs);
  static constexpr int kConsumerWarps = 4 * kWGs, kConsumerThreads = 128 * kWGs;
  // 24 + 2 x 240 (24 + 3 x 160) registers per thread of the warpgroups fit the 64K register
  // file; at entry __launch_bounds__(kThreads, 1) gives each thread 168 (128).
  static constexpr int kProducerRegs = 24, kConsumerRegs = kWGs == 2 ? 240 : 160;
  // The lazy running max (softmax_lazy in the kernel) at H = 128: +7-9% plain at 1k-16k, +6%
  // and +11% causal at 4k and 16k, level at 1k causal; at H = 64 level to -3% (NOTES.md,
  // fourteenth session); at H = 256 +7-12% plain and causal but 1k causal (+2%) (twentieth
  // session). Not in the rules kernel.
  static constexpr bool kLazyMax = !kRules && kHeadDim >= 128;
  static constexpr int kSwzCols = 64;  // elements in one 128-byte swizzled row
  static constexpr int kColBlocks = kHeadDim / kSwzCols;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(T);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(T);  // one K or V stage
  // Byte offsets from the 1024-aligned base: sQ, sK[kStages], sV[kStages], (kStageO) sO,
  // then mbarriers q[kColBlocks], full_k[kStages], full_v[kStages], empty_k[kStages],
  // empty_v[kStages], q_empty, (kDynamic) tile[2], (kRules) full_bias[kWGs], empty_bias[kWGs],
  // then the tiles' ids (kDynamic) or the warpgroups' flags (kPieces), then (kRules) the
  // SegShared and the bias stages.
  static constexpr uint32_t kOffQ = 0;
  static constexpr uint32_t kOffK = kOffQ + kQBytes;
  static constexpr uint32_t kOffV = kOffK + kStages * kKVBytes;
  static constexpr uint32_t kOffO = kOffV + kStages * kKVBytes;
  // O leaves through shared memory by TMA stores: staged in sQ when the CTA runs one tile,
  // in an sO of its own when persistent (sQ may hold the next tile's Q by then).
  static constexpr bool kStageO = kPersistent;
  static constexpr uint32_t kOffBar = kOffO + (kStageO ? kQBytes : 0);
  static constexpr int kNumBars =
      kColBlocks + 1 + 4 * kStages + (kDynamic ? 2 : 0) + (kRules ? 2 * kWGs : 0);
  static constexpr uint32_t kOffTile = kOffBar + kNumBars * 8;  // int [4]
  static constexpr uint32_t kOffSeg = (kOffTile + 16 + 15) / 16 * 16;
  using Seg = SegShared<kBlockN, kStages>;
  // kRules: each consumer warpgroup's bias stage, its 64 rows of kBlockN keys, rows padded by
  // 16 bytes so that the 8 rows a fragment read touches fall in distinct banks (and each row
  // starts 16-byte aligned, as bulk copies need).
  static constexpr uint32_t kBiasRowBytes = kBlockN * 2 + 16;
  static constexpr uint32_t kBiasWGBytes = 64 * kBiasRowBytes;
  static constexpr uint32_t kOffBias = (kOffSeg + (kRules ? sizeof(Seg) : 0) + 15) / 16 * 16;
  static constexpr int kBiasBytes = kRules ? kWGs * kBiasWGBytes : 0;
  static constexpr int kSmemBytes = kOffBias + kBiasBytes + 1024;  // + slack to align the base

  static_assert(kHeadDim % kSwzCols == 0, "whole 128-byte swizzle rows");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N and TMA box rows");
  static_assert((kBlockN * 128) % 1024 == 0, "column blocks of K/V start on swizzle atoms");
  static_assert(kSmemBytes <= 227 * 1024, "sm90 shared memory per block");
  static_assert(!kRules || (kBlockM == 128 && kBlockN == 128), "load_ids: 4 ids a lane, a tile");
};

// kRules: the rules of p (Rules: causal, window, lengths, alignment; SegShared: segment ids)
// apply; kCausal is false.
// kPieces: the pieces of a split last round (FwdTail; kPersistent plain kernels).
template <typename T, int kHeadDim, bool kCausal, bool kRules, bool kPersistent, bool kNarrow,
          int kWGs, bool kPieces = false>
__global__ void __launch_bounds__(128 * (1 + kWGs), 1)
    flash_fwd_sm90_kernel(const FwdParams p, const __grid_constant__ CUtensorMap tma_q,
                          const __grid_constant__ CUtensorMap tma_k,
                          const __grid_constant__ CUtensorMap tma_v,
                          const __grid_constant__ CUtensorMap tma_o, int num_m_blocks,
                          int n_tiles, int sec_heads, FwdTail tail) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!(kCausal && kRules), "the rules kernel reads is_causal from p");
  using Cfg = FwdCfgSm90<T, kHeadDim, kCausal, kRules, kPersistent, kNarrow, kWGs>;
  constexpr bool kDynamic = Cfg::kDynamic;
  static_assert(!kPieces || (kPersistent && !kDynamic), "pieces of a persistent plain kernel");
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr uint32_t kRowBytes = 128;  // one swizzled row of a column block
  // The pieces of a split last round, a dependent launch, may take the SMs this grid leaves.
  if constexpr (kPersistent && !kCausal && !kPieces) pdl_trigger();

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);  // generic pointer to the aligned base
  const uint32_t sQ = base + Cfg::kOffQ;  // (kColBlocks, kBlockM, 64)
  const uint32_t sK = base + Cfg::kOffK;  // (kStages, kColBlocks, kBlockN, 64)
  const uint32_t sV = base + Cfg::kOffV;  // (kStages, kColBlocks, kBlockN, 64)
  const uint32_t bar_q = base + Cfg::kOffBar;  // q[cb]: column block cb of sQ, at + 8 * cb
  const uint32_t bar_k = bar_q + 8 * Cfg::kColBlocks;  // full_k[stage] at + 8 * stage
  const uint32_t bar_v = bar_k + 8 * kStages;       // full_v[stage]
  const uint32_t bar_empty_k = bar_v + 8 * kStages;      // empty_k[stage]
  const uint32_t bar_empty_v = bar_empty_k + 8 * kStages;  // empty_v[stage]
  const uint32_t bar_q_empty = bar_empty_v + 8 * kStages;  // every consumer's S GEMMs read sQ
  // kDynamic: the CTA's tile k (k > 0; n_tiles or more when there is none) in tile_id[k % 2],
  // published by an arrival on tile[k % 2] (bar_tile + 8 (k % 2)); kPieces: tile_id[cw] says
  // whether warpgroup cw's piece was its tile's last
  const uint32_t bar_tile = bar_q_empty + 8;
  int* tile_id = reinterpret_cast<int*>(smem + Cfg::kOffTile);
  // kRules with a bias: full_bias[cw] (+ 8 cw), warpgroup cw's stage of the step's bias landed;
  // empty_bias[cw], its threads read it
  const uint32_t bar_bias_full = bar_tile + (kDynamic ? 16 : 0);
  const uint32_t bar_bias_empty = bar_bias_full + 8 * kWGs;
  const uint32_t sBias = base + Cfg::kOffBias;  // (kWGs, 64, kBiasRowBytes)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // Tile t enumerates (b, n, m_block), m_block fastest (the query tiles of one head share its
  // K/V in L2); causal runs the longest rows first. A CTA runs tile blockIdx.x and then: none
  // (one CTA a tile; unequal tiles of the rules are left to the hardware's scheduling), or
  // (kPersistent, one CTA per SM, whose producer loads the next tile's Q and K while the
  // consumers finish the last one) blockIdx.x + gridDim.x, + 2 gridDim.x, ... when the tiles
  // are alike, or under causal (kDynamic) the next one of the counter p.tile_counter, so that
  // the CTAs' sums of unequal tiles come out even (tile t is then numbered as below).
  // Rows are int (T, S < 2^30).
  const int t_len = static_cast<int>(p.t), s_len = static_cast<int>(p.s);
  int64_t bn, n, b, kvh;
  int m0, j_lo, n_blocks;
  int2 keys = make_int2(0, 0);
  auto set_tile = [&](int t) {
    int m_block = t % num_m_blocks;
    bn = t / num_m_blocks;  // b * N + n
    if constexpr (kDynamic) {
      // Sections of sec_heads heads whose K/V fit in the L2, and in each the query tiles
      // longest first, tile m_block of every head before the shorter ones: the CTAs' last
      // tiles are the shortest of all.
      const int2 st = section_tile(t, sec_heads, static_cast<int>(p.b * p.n), num_m_blocks);
      m_block = st.x;
      bn = st.y;
    }
    n = bn % p.n, b = bn / p.n;
    if (kCausal || (kRules && p.is_causal)) m_block = num_m_blocks - 1 - m_block;
    kvh = n / (p.n / p.kh);  // GQA: kv head of query head n
    m0 = m_block * kBlockM;
    // Key tiles j_lo .. j_lo + n_blocks - 1 hold the keys this tile needs: all S, under causal
    // up to its last row t (s <= t), under the rules their key range [keys.x, keys.y); with
    // segment ids, n_blocks becomes the number of those visited (SegShared).
    j_lo = 0;
    n_blocks = ((kCausal ? min(s_len, min(t_len, m0 + kBlockM)) : s_len) + kBlockN - 1) / kBlockN;
    if constexpr (kRules) {
      keys = Rules(p, b).key_range(m0, kBlockM);
      j_lo = keys.x / kBlockN;
      n_blocks = keys.y > keys.x ? (keys.y + kBlockN - 1) / kBlockN - j_lo : 0;
    }
  };
  set_tile(blockIdx.x);
  // kPieces: the CTA's items are the pieces of run blockIdx.x of the tail (FwdTail), which
  // follows the n_tiles - tail.tiles whole tiles.
  const int n_full = n_tiles - tail.tiles;
  int run0 = 0, run1 = 0, n_items = 0;
  if constexpr (kPieces) {
    run0 = tail.start(blockIdx.x);
    run1 = tail.start(blockIdx.x + 1);
    n_items = (run1 > run0) + (run1 > (run0 / tail.nb + 1) * tail.nb);
  }
  int piece = 0, piece_tile = 0;  // the item's piece of the run, its tile of the tail
  auto set_item = [&](int k) {
    piece = k;
    piece_tile = run0 / tail.nb + k;
    set_tile(n_full + piece_tile);
    const int u0 = piece_tile * tail.nb;  // the tile's first key tile in the tail
    j_lo = max(run0 - u0, 0);
    n_blocks = min(run1 - u0, tail.nb) - j_lo;
  };
  using Seg = typename Cfg::Seg;
  Seg& seg = *reinterpret_cast<Seg*>(smem + Cfg::kOffSeg);  // kRules only
  const int n_cand = n_blocks;  // candidate tiles; the visited ones are bits of seg.live
  const bool segs = kRules && p.q_segment_ids != nullptr;
  const int32_t* gQSeg = segs ? p.q_segment_ids + b * p.t : nullptr;    // (T) ids of batch b
  const int32_t* gKvSeg = segs ? p.kv_segment_ids + b * p.s : nullptr;  // (S)
  // The rules kernel's bias of (b, n) (one tile a CTA), its rows bias_rs apart (0: broadcast
  // over the rows) and its keys contiguous (select.h sm90_bias_ok: rows of keys 16-byte
  // aligned, as bulk copies need).
  const uint16_t* bias_bn = nullptr;
  int64_t bias_rs = 0;
  if (kRules && p.bias) {
    const BcastStrides& st = p.bias_strides;
    bias_bn = static_cast<const uint16_t*>(p.bias) + st.batch_at(b, p.batch_inner) + n * st.head;
    bias_rs = st.row;
  }

  if (segs) {
    const int words = (min(n_cand, Seg::kLiveTiles) + 31) / 32;
    for (int w = tid; w < words; w += Cfg::kThreads) seg.live[w] = 0;
    if (tid == 0) seg.num_live = max(0, n_cand - Seg::kLiveTiles);
  }
  if (tid == 0) {
    for (int cb = 0; cb < Cfg::kColBlocks; ++cb) mbar_init(bar_q + 8 * cb, 1);
    for (int s = 0; s < kStages; ++s) {
      // the rules kernel: every lane of producer warp 0, which writes the stage's tile and ids
      mbar_init(bar_k + 8 * s, kRules ? 32 : 1);
      mbar_init(bar_v + 8 * s, 1);
      // lane 0 of each consumer warp; for K in the rules kernel every consumer thread, all of
      // which read the stage's tile (and ids) published with K
      mbar_init(bar_empty_k + 8 * s, kRules ? Cfg::kConsumerThreads : Cfg::kConsumerWarps);
      mbar_init(bar_empty_v + 8 * s, Cfg::kConsumerWarps);
    }
    // lane 0 of each consumer warp; under kDynamic every consumer thread, each releasing its
    // own read of tile_id before the producer rewrites it
    mbar_init(bar_q_empty, kDynamic ? Cfg::kConsumerThreads : Cfg::kConsumerWarps);
    if constexpr (kDynamic) {
      mbar_init(bar_tile, 1);
      mbar_init(bar_tile + 8, 1);
    }
    if constexpr (kRules) {
      for (int w = 0; w < kWGs; ++w) {
        mbar_init(bar_bias_full + 8 * w, 1);
        mbar_init(bar_bias_empty + 8 * w, 128);  // every thread of the warpgroup, a reader
      }
    }
    mbar_fence_init();
    tma_prefetch_desc(&tma_q);
    tma_prefetch_desc(&tma_k);
    tma_prefetch_desc(&tma_v);
  }
  __syncthreads();

  // TMA box coordinates, innermost first: (column, head, row, batch).
  // Q's column blocks on barriers of their own: a tile's first S GEMMs start once the first
  // has landed (ncu: -1.2 to -2% at H = 256, -0.5 to -0.9% causal at 128 and 64; NOTES.md,
  // twenty-third session).
  auto load_q = [&] {
    const int ci_n = static_cast<int>(n), ci_b = static_cast<int>(b);
#pragma unroll
    for (int cb = 0; cb < Cfg::kColBlocks; ++cb) {
      mbar_arrive_expect_tx(bar_q + 8 * cb, Cfg::kQBytes / Cfg::kColBlocks);
      tma_load_4d(sQ + cb * kBlockM * kRowBytes, &tma_q, bar_q + 8 * cb, cb * 64, ci_n, m0, ci_b,
                  L2Hint::kFirst);
    }
  };
  // K (or V) of key tile j into ring stage s of sK (sV), completing on full_k[s] (full_v[s]).
  auto load_tile = [&](const CUtensorMap* map, uint32_t ring, uint32_t full, int s, int j) {
    mbar_arrive_expect_tx(full + 8 * s, Cfg::kKVBytes);
#pragma unroll
    for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
      tma_load_4d(ring + s * Cfg::kKVBytes + cb * kBlockN * kRowBytes, map, full + 8 * s, cb * 64,
                  static_cast<int>(kvh), j * kBlockN, static_cast<int>(b), L2Hint::kLast);
  };

  if (segs) {
    // Every warp: the query tile's id range over its rows t < q_len, then 4 candidate tiles
    // at a time (16 loads in flight per lane) marked live where the id ranges meet. Q loads
    // meanwhile.
    if (tid == 0) load_q();
    int v[4];
    const int q_end = min(m0 + kBlockM, Rules(p, b).q_len);
    const int2 q_ids = load_ids(v, gQSeg, m0, m0, q_end, lane);
    int found = 0;
    for (int r0 = 4 * warp; r0 < min(n_cand, Seg::kLiveTiles); r0 += 4 * Cfg::kThreads / 32) {
      uint32_t bits = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n0 = (j_lo + r0 + k) * kBlockN;
        const int2 kv = load_ids(v, gKvSeg, n0, keys.x, min(n0 + kBlockN, keys.y), lane);
        if (r0 + k < n_cand && kv.y >= q_ids.x && kv.x <= q_ids.y) bits |= 1u << k;
      }
      if (lane == 0 && bits != 0) atomicOr(&seg.live[r0 / 32], bits << (r0 % 32));
      found += __popc(bits);
    }
    if (lane == 0 && found != 0) atomicAdd(&seg.num_live, found);
    __syncthreads();
    n_blocks = seg.num_live;
  }

  if (warp < 4) {
    // Producer warpgroup: one thread issues every copy, the rest have nothing to do; in the
    // rules kernel warp 0 also publishes each stage's tile (and ids: SegShared).
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (kRules ? warp == 0 : tid == 0) {
      // kv_base: the K/V steps of the CTA's earlier tiles, with which the rings' stages and
      // phases go on.
      for (int t = blockIdx.x, k = 0, kv_base = 0, t_next = 0; kPieces ? k < n_items : t < n_tiles;
           t = kDynamic ? t_next : kPersistent && !kPieces ? t + gridDim.x : n_tiles, ++k,
               kv_base += n_blocks) {
        if (kPieces) set_item(k);
        else if (k > 0) set_tile(t);
        // Step it loads K of tile it, then V of tile it - 1: the consumers issue S of tile it
        // with P V of tile it - 1. A K stage is free once both S GEMMs read it, long before
        // the V stage beside it, which waits for the slower warpgroup's P V.
        int r = segs ? n_cand : n_blocks;
        auto load_k = [&](int it) {
          r = segs ? seg.prev_live(r - 1) : r - 1;  // tiles last to first
          const int j = j_lo + r;
          const int q = kv_base + it, s = q % kStages, n0 = j * kBlockN;
          int v[4];
          int2 kv = make_int2(0, 0);
          if (segs) kv = load_ids(v, gKvSeg, n0, keys.x, min(n0 + kBlockN, keys.y), lane);
          // Stage s last held K of step q - kStages: wait until both consumers released it.
          if (q >= kStages) mbar_wait(bar_empty_k + 8 * s, (q / kStages - 1) & 1);
          if constexpr (kRules) {
            if (segs) {
#pragma unroll
              for (int i = 0; i < 4; ++i) seg.kv_ids[s][lane + 32 * i] = v[i];
            }
            if (lane == 0) {
              seg.tile[s] = j;
              seg.kv_lo[s] = kv.x;
              seg.kv_hi[s] = kv.y;
            }
          }
          // each lane's arrival on full_k publishes its writes (the rules kernel's warp)
          if (lane == 0) load_tile(&tma_k, sK, bar_k, s, j);
          else mbar_arrive(bar_k + 8 * s);
          return j;
        };
        // The tile's first K goes out before its Q: its stage was freed two steps ago, sQ only
        // by the last S GEMMs of the tile before.
        int j_prev = n_blocks > 0 ? load_k(0) : 0;
        if (k > 0) mbar_wait(bar_q_empty, (k - 1) & 1);  // every consumer's last S of tile k - 1
        if (!segs && lane == 0) load_q();  // with segment ids it is on its way already
        // kDynamic: the CTA's next tile is claimed after this tile's last K load (or its first
        // V), about two steps before the consumers finish the tile, and published once its V
        // loads are out in tile_id[(k + 1) % 2], whose last reader (tile k - 1's consumers)
        // released sQ above. Claimed at the tile's start, an SM's next tile was fixed a whole
        // tile early, and the sections' last tiles went to SMs still busy: this is +2.4-3.4% at
        // D=128 1k causal, +1.9-3.8% at 2k-4k, level at 16k, D=64 1k 1% slower and 2k-16k level
        // (NOTES.md, thirty-fourth session). Every causal tile has a key tile (S > 0), so every
        // tile claims once.
        const int claim_at = max(n_blocks - 1, 1);
        unsigned long long claim = 0;  // its round trip runs while the Vs below wait
        for (int it = 1; it <= n_blocks; ++it) {
          const int j = it < n_blocks ? load_k(it) : 0;
          if (kDynamic && it == claim_at) claim = claim_add(p.tile_counter);
          const int q = kv_base + it - 1, s = q % kStages;
          if (q >= kStages) mbar_wait(bar_empty_v + 8 * s, (q / kStages - 1) & 1);
          if (lane == 0) load_tile(&tma_v, sV, bar_v, s, j_prev);
          j_prev = j;
        }
        if constexpr (kDynamic) {
          t_next = static_cast<int>(gridDim.x) + claim_tile(p.tile_counter, claim);
          tile_id[(k + 1) % 2] = t_next;
          mbar_arrive(bar_tile + 8 * ((k + 1) % 2));
        }
      }
    } else if (kRules && warp == 1 && bias_bn) {
      // Producer warp 1: the bias of each visited key tile, in the K ring's order, warpgroup
      // w's 64 rows (one when broadcast over the rows; none past T) into its stage, a bulk copy
      // a row, once the warpgroup has read the tile before: the copies have the step between
      // a tile's softmax and the next one's to land.
      int r = segs ? n_cand : n_blocks;
      for (int it = 0; it < n_blocks; ++it) {
        r = segs ? seg.prev_live(r - 1) : r - 1;
        const int n0 = (j_lo + r) * kBlockN;
        const uint32_t bytes = 2 * min(kBlockN, s_len - n0);  // S % 8 == 0: whole 16 bytes
#pragma unroll 1
        for (int w = 0; w < kWGs; ++w) {
          const int r0 = m0 + 64 * w;
          const int rows = bias_rs == 0 ? 1 : max(0, min(64, t_len - r0));
          if (it > 0) mbar_wait(bar_bias_empty + 8 * w, (it - 1) & 1);
          fence_proxy_async();  // the warpgroup's reads before the copies' writes
          if (lane == 0) mbar_arrive_expect_tx(bar_bias_full + 8 * w, rows * bytes);
          for (int i = lane; i < rows; i += 32)
            bulk_load(sBias + w * Cfg::kBiasWGBytes + i * Cfg::kBiasRowBytes,
                      bias_bn + (r0 + i) * bias_rs + n0, bytes, bar_bias_full + 8 * w);
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    // Consumer warpgroup: tile rows 64 cw .. 64 cw + 63. Broadcast from lane 0 so that ptxas
    // sees it warp-uniform and keeps the descriptors derived from it in uniform registers.
    const int cw = __shfl_sync(0xffffffffu, warp / 4 - 1, 0);
    const int wr = 64 * cw + (warp % 4) * 16;  // this warp's first tile row (wgmma: 16 per warp)
    const int g = lane / 4, tig = lane % 4;    // accumulator rows g, g + 8; column pair tig
    const bool o_leader = warp % 4 == 0 && lane == 0;  // issues the warpgroup's O stores
    constexpr int kNS = kBlockN / 2;   // S accumulator floats per thread: (64, kBlockN) / 128
    // Causal 128-row tiles: S of a warpgroup's first key tile at half width where its rows
    // see no key of the upper half (the prologue below).
    constexpr bool kHalfFirst = kCausal && kWGs == 2 && (kBlockN == 128 || kBlockN == 80);
    constexpr int kNO = kHeadDim / 2;  // O accumulator floats per thread: (64, H) / 128
    // Accumulator element 4 i + c sits at row g + 8 (c / 2), column 8 i + 2 tig + c % 2.

    // wgmma descriptors of this warpgroup's rows of sQ, K stage 0 and V stage 0 (column block
    // 0); every GEMM offsets them (desc_at). K-major Q and K: LBO unused (16), SBO = 8 rows.
    // V, MN-major: the column blocks LBO = kBlockN * 128 bytes apart.
    const uint64_t d_q = sw128_desc(sQ + 64 * cw * kRowBytes, 16, 1024);
    const uint64_t d_k = sw128_desc(sK, 16, 1024);
    const uint64_t d_v = sw128_desc(sV, kBlockN * kRowBytes, 1024);
    int k = 0;
    for (int t = blockIdx.x, kv_base = 0; kPieces ? k < n_items : t < n_tiles;
         t = kDynamic ? t : kPersistent && !kPieces ? t + gridDim.x : n_tiles, ++k,
         kv_base += n_blocks) {
      if (kDynamic && k > 0) {  // tile k, if any (published while tile k - 1 ran)
        mbar_wait(bar_tile + 8 * (k % 2), ((k - 1) / 2) & 1);
        t = tile_id[k % 2];
        if (t >= n_tiles) break;
      }
      if (kPieces) set_item(k);
      else if (k > 0) set_tile(t);
      float acc_o[kNO];  // (64, H) fp32 per warpgroup
#pragma unroll
      for (int i = 0; i < kNO; ++i) acc_o[i] = 0.f;
      float row_max[2] = {-INFINITY, -INFINITY};  // log2-scaled logits, rows g and g + 8
      float row_sum[2] = {0.f, 0.f};              // this lane's share; quad-summed at the end
      // ALiBi's slope in q.k's units (the softmax multiplies the logits by scale_log2).
      const float alibi_raw = kRules && p.alibi_slopes ? p.alibi_slopes[bn] / p.scale : 0.f;

      // Segment ids: those of this thread's rows g, g + 8, and the warp's range over its rows
      // t < q_len (rows past q_len see nothing by the rules, whatever their id).
      int row_id[2] = {0, 0};
      int2 warp_ids = make_int2(0, 0);
      if (segs) {
        const int q_len = Rules(p, b).q_len;
        int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = m0 + wr + g + 8 * h;
          if (t < q_len) {
            row_id[h] = gQSeg[t];
            lo = min(lo, row_id[h]);
            hi = max(hi, row_id[h]);
          }
        }
        warp_ids = make_int2(__reduce_min_sync(0xffffffffu, lo), __reduce_max_sync(0xffffffffu, hi));
      }

      mbar_wait(bar_q, k & 1);

      // The steps of one key tile it (ring stage it % kStages): tile j = j_lo + n_blocks - 1 - it,
      // in the rules kernel the stage's seg.tile.
      // S = Q K^T: (64, N) per warpgroup, K = H in k16 steps; committed, not waited for. N is
      // kBlockN, or half that (issue_qk_half) for the first kBlockN / 2 keys of the stage's
      // tile, into an array of its own: with one GEMM's accumulator a part of another's, ptxas
      // serialises every wgmma of the kernel (C7511).
      auto wait_k = [&](int it) {  // the byte offset of the stage holding K of tile it
        const int q = kv_base + it;
        mbar_wait(bar_k + 8 * (q % kStages), (q / kStages) & 1);
        wgmma_fence();
        return static_cast<uint32_t>((q % kStages) * Cfg::kKVBytes);
      };
      // first: the tile's first S, which waits for Q's column blocks past the first (the
      // tile's start waited for that one) as it reaches them (issue_s).
      auto issue_qk = [&](float (&acc_s)[kNS], int it, bool first) {
        issue_s<T, kBlockN, kHeadDim, kBlockM, kBlockN>(acc_s, d_q, d_k, wait_k(it), first, bar_q,
                                                        k & 1);
      };
      constexpr int kNH = kHalfFirst ? kBlockN / 2 : kBlockN;
      auto issue_qk_half = [&](float (&acc_h)[kNH / 2], int it) {
        issue_s<T, kNH, kHeadDim, kBlockM, kBlockN>(acc_h, d_q, d_k, wait_k(it), true, bar_q, k & 1);
      };
      // O += P V: K = kBlockN keys in k16 steps of 16 rows (2 swizzle atoms, 2048 bytes) of
      // every column block; N = H, the column blocks LBO = kBlockN * 128 bytes apart.
      auto issue_pv = [&](const uint32_t (&rP)[kBlockN / 16][4], int it) {
        const int q = kv_base + it;
        const uint32_t stage = (q % kStages) * Cfg::kKVBytes;
        mbar_wait(bar_v + 8 * (q % kStages), (q / kStages) & 1);
        fence_regs(acc_o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          Wgmma<kHeadDim>::template rs<T>(acc_o, rP[kk], desc_at(d_v, stage + kk * 16 * kRowBytes), 1);
        }
        wgmma_commit();
      };
      // The GEMM that reads K (V) of tile it is complete (and in the rules kernel the softmax has
      // read the stage's tile and ids): hand the stage back to the producer.
      // With the last tile's S, sQ is read too: the producer may load the next tile's Q.
      auto release_k = [&](int it) {
        __syncwarp();
        if (kRules || lane == 0) mbar_arrive(bar_empty_k + 8 * ((kv_base + it) % kStages));
        if (it == n_blocks - 1 && (kDynamic || lane == 0)) mbar_arrive(bar_q_empty);
      };
      auto release_v = [&](int it) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_empty_v + 8 * ((kv_base + it) % kStages));
      };
      // Keys >= S and under causal keys s > t (or what the rules hide) set to -inf in a
      // completed S, only on tiles that need it (the rules kernel's soft cap, bias and ALiBi
      // first, on every tile).
      // ns: the floats of acc_s that hold S (kNS, or kNS / 2 on a half tile); the lambdas
      // take a pointer because the half tile's array is a type of its own.
      auto mask_tile = [&](float* acc_s, int it, int ns) {
        const int n0 = (kRules ? seg.tile[(kv_base + it) % kStages] : j_lo + n_blocks - 1 - it) *
                       kBlockN;
        if constexpr (kRules) {
          const Rules r(p, b);
          const int64_t diag = int64_t{m0 + wr} - n0 + r.shift;
          // The logits' variants on every tile, in q.k's units: the soft cap
          // c tanh(scale s / c) / scale, the bias / scale, ALiBi's -slope |col - row - diag| /
          // scale.
          if (p.softcap > 0.f) {
            const float in = p.scale / p.softcap, out = p.softcap / p.scale;
#pragma unroll
            for (int i = 0; i < kNS; ++i) acc_s[i] = out * tanhf(acc_s[i] * in);
          }
          if (bias_bn) {
            // Step it's bias in this warpgroup's stage (rows past T or keys past S: stale,
            // hidden below by the lengths).
            mbar_wait(bar_bias_full + 8 * cw, it & 1);
            const float inv_scale = 1.f / p.scale;
            const int rs = bias_rs == 0 ? 0 : Cfg::kBiasRowBytes;
            const unsigned char* sb =
                smem + Cfg::kOffBias + cw * Cfg::kBiasWGBytes + (wr % 64 + g) * rs + 4 * tig;
#pragma unroll
            for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const float2 v =
                    unpack2<T>(*reinterpret_cast<const uint32_t*>(sb + 8 * h * rs + 16 * i));
                acc_s[4 * i + 2 * h] = fmaf(v.x, inv_scale, acc_s[4 * i + 2 * h]);
                acc_s[4 * i + 2 * h + 1] = fmaf(v.y, inv_scale, acc_s[4 * i + 2 * h + 1]);
              }
            mbar_arrive(bar_bias_empty + 8 * cw);
          }
          if (p.alibi_slopes) {
            const float d0 = static_cast<float>(int64_t{2 * tig - g} - diag);  // at i = c = 0
#pragma unroll
            for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                const float d = d0 + static_cast<float>(8 * i + c % 2 - 8 * (c / 2));
                acc_s[4 * i + c] -= alibi_raw * fabsf(d);
              }
          }
          // This warp's rows t = m0 + wr + row (row < 16) see key n0 + col iff row < q_rows,
          // col < kv_limit and lo_d <= col - row <= hi_d; a tile all of whose elements pass
          // skips the test.
          const int q_rows = r.q_len - (m0 + wr), kv_limit = r.kv_len - n0;
          if (q_rows < 16 || kv_limit < kBlockN || diag - r.wl > -15 || diag + r.hi < kBlockN - 1) {
            const int lo_d = clamp_diag(diag - r.wl), hi_d = clamp_diag(diag + r.hi);
#pragma unroll
            for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                const int col = 8 * i + 2 * tig + c % 2, row = g + 8 * (c / 2);
                if (row >= q_rows || col >= kv_limit || col - row < lo_d || col - row > hi_d)
                  acc_s[4 * i + c] = -INFINITY;
              }
          }
          // Segment ids: unless the warp's rows and the tile's keys (in the CTA's key range; the
          // rules hide the others) all carry one id, key col is hidden where its id differs.
          const int s = (kv_base + it) % kStages;
          if (segs && !(seg.kv_lo[s] == warp_ids.y && seg.kv_hi[s] == warp_ids.x)) {
#pragma unroll
            for (int i = 0; i < kNS / 4; ++i) {
              const int2 kv = *reinterpret_cast<const int2*>(&seg.kv_ids[s][8 * i + 2 * tig]);
#pragma unroll
              for (int c = 0; c < 4; ++c)
                if ((c % 2 ? kv.y : kv.x) != row_id[c / 2]) acc_s[4 * i + c] = -INFINITY;
            }
          }
        } else if (n0 + kBlockN > s_len || (kCausal && n0 + kBlockN - 1 > m0 + wr)) {
          // Element (i, c) is column 8 i + c % 2 + 2 tig of warp row 8 (c / 2) + g; with this
          // thread's offsets moved into the bounds every test compares a constant (kept as
          // col - row per element, the 64 differences spilled in the 3-consumer kernel).
          const int kv_lim = s_len - n0 - 2 * tig;          // hidden: 8 i + c % 2 >= kv_lim
          const int diag_lim = m0 + wr - n0 + g - 2 * tig;  // hidden: 8 i + c % 2 - 8 (c / 2) > diag_lim
#pragma unroll
          for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int col = 8 * i + c % 2;
              if (4 * i < ns && (col >= kv_lim || (kCausal && col - 8 * (c / 2) > diag_lim)))
                acc_s[4 * i + c] = -INFINITY;
            }
        }
      };
      // Online softmax of a completed S, masked: the new running max m of the log2-scaled
      // logits, l rescaled and P = 2^(S * scale_log2 - m) in place, one FFMA and one exp2 per
      // element (the FP32 and MUFU pipes, not the tensor cores, bound this step); corr =
      // 2^(m_old - m_new) is left for O, which may still be accumulating the previous tile.
      auto softmax = [&](float* acc_s, int it, float (&corr)[2], int ns) {
        mask_tile(acc_s, it, ns);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;  // of the raw logits: the scale is positive
#pragma unroll
          for (int i = 0; i < kNS / 4; ++i)
            if (4 * i < ns) mx = fmaxf(mx, fmaxf(acc_s[4 * i + 2 * h], acc_s[4 * i + 2 * h + 1]));
          mx = fmaxf(row_max[h], quad_max(mx) * p.scale_log2);
          // A row with no visible key so far keeps m = -inf; subtracting 0 then gives P = 0.
          const float m_use = mx == -INFINITY ? 0.f : mx;
          corr[h] = exp2_approx(row_max[h] - m_use);
          row_max[h] = mx;
          row_sum[h] *= corr[h];
#pragma unroll
          for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
            for (int c = 2 * h; c < 2 * h + 2; ++c) {
              if (4 * i >= ns) continue;
              acc_s[4 * i + c] = exp2_approx(fmaf(acc_s[4 * i + c], p.scale_log2, -m_use));
              row_sum[h] += acc_s[4 * i + c];
            }
        }
      };
      // S of tile it again, this warp's 16 rows only, by mma.sync from sQ and the K stage (the
      // accumulator layouts agree: n8 block i of m16n8 is elements 4 i .. 4 i + 3).
      auto recompute_s = [&](float (&acc_s)[kNS], int it) {
        const uint32_t sk = sK + ((kv_base + it) % kStages) * Cfg::kKVBytes;
        // The lane read here, not hoisted: ptxas would otherwise keep this rare path's
        // addresses in registers across the loop (and spill in the hot one).
        const int lane = lane_id_volatile();
        const int j = lane / 8;  // ldmatrix: this lane's row address is for matrix j, row lane % 8
#pragma unroll
        for (int i = 0; i < kNS; ++i) acc_s[i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const uint32_t cb = kk / 4, chunk = (kk % 4) * 2;  // column block, first 16-byte chunk
          // A (16 rows x k16): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), row-major
          const int qr = wr + (j % 2) * 8 + lane % 8;
          uint32_t a[4];
          ldmatrix_x4(a, sQ + cb * kBlockM * kRowBytes + qr * kRowBytes +
                             (((chunk + j / 2) ^ (qr % 8)) * 16));
#pragma unroll
          for (int i = 0; i < kNS / 4; i += 2) {
            // B of n8 blocks i, i + 1: matrices (keys 8 i .. | 8 i + 8 ..) x (k 0-7 | 8-15)
            const int key = 8 * i + (j / 2) * 8 + lane % 8;
            uint32_t b[4];
            ldmatrix_x4(b, sk + cb * kBlockN * kRowBytes + key * kRowBytes +
                               (((chunk + j % 2) ^ (key % 8)) * 16));
#pragma unroll
            for (int n = 0; n < 2; ++n) {
              float d[4] = {acc_s[4 * (i + n)], acc_s[4 * (i + n) + 1], acc_s[4 * (i + n) + 2],
                            acc_s[4 * (i + n) + 3]};
              const uint32_t bn[2] = {b[2 * n], b[2 * n + 1]};
              mma_16816<T>(d, a, bn);
#pragma unroll
              for (int c = 0; c < 4; ++c) acc_s[4 * (i + n) + c] = d[c];
            }
          }
        }
      };
      // The online softmax with a lazy running max m (FA4's rule, without waiting for the
      // tile's max): P = 2^(S * scale_log2 - m) against the m of the tiles before, the tile's
      // max found beside the exp2s instead of before them. Only where a row's max passes m + 8
      // (warp-wide) does m move, P and l by 2^(m_old - m_new). P <= 2^8 fits every input
      // dtype. Returns 0 (O keeps its scale), 1 (O needs the rescale by corr) or, where a row's
      // max passed m + 120 and the exp2s may have overflowed, 2: S is to be computed again
      // (recompute_s) and take the exact path. Every row of the warp has a finite m (a
      // visible key in an earlier tile).
      auto softmax_lazy = [&](float (&acc_s)[kNS], int it, float (&corr)[2]) {
        mask_tile(acc_s, it, kNS);
        float mx[2] = {-INFINITY, -INFINITY}, tile_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int h = c / 2;
            mx[h] = fmaxf(mx[h], acc_s[4 * i + c]);
            acc_s[4 * i + c] = exp2_approx(fmaf(acc_s[4 * i + c], p.scale_log2, -row_max[h]));
            tile_sum[h] += acc_s[4 * i + c];
          }
        bool grow = false, overflow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mx[h] = quad_max(mx[h]) * p.scale_log2;
          grow |= mx[h] > row_max[h] + 8.f;
          overflow |= mx[h] > row_max[h] + 120.f;
        }
        if (!__any_sync(0xffffffffu, grow)) {
          row_sum[0] += tile_sum[0];
          row_sum[1] += tile_sum[1];
          return 0;
        }
        if (__any_sync(0xffffffffu, overflow)) return 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = fmaxf(row_max[h], mx[h]);
          corr[h] = exp2_approx(row_max[h] - m_new);
          row_max[h] = m_new;
          row_sum[h] = (row_sum[h] + tile_sum[h]) * corr[h];
        }
#pragma unroll
        for (int i = 0; i < kNS / 4; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_s[4 * i + c] *= corr[c / 2];
        return 1;
      };
      auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
        for (int i = 0; i < kNO / 4; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_o[4 * i + c] *= corr[c / 2];
      };
      // P as wgmma A fragments: per warp the m16k16 layout of mma.sync, so k16 step kk is
      // accumulator columns 16 kk .. 16 kk + 15, i.e. elements 8 kk .. 8 kk + 7.
      auto convert_p = [&](const float* acc_s, uint32_t (&rP)[kBlockN / 16][4], int ns) {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            // r: (row g | g + 8) x (k 2tig | 8 + 2tig); P = 0 for keys past a half tile
            const int e = 8 * kk + 2 * r;
            rP[kk][r] = e < ns ? pack2<T>(acc_s[e], acc_s[e + 1]) : 0u;
          }
      };

      // Ping-pong (FA3): the consumer warpgroups take turns issuing their GEMMs, in a ring, so
      // that one's softmax runs while another's GEMMs hold the tensor cores. Warpgroup cw waits
      // on barrier 4 + cw before a round of issues and then arrives on the next one's. The
      // rounds are the prologue's S, the loop's S + P V pairs and the last P V: n_blocks + 1 per
      // warpgroup. Warpgroup 0 goes first: the last one opens its barrier for the CTA's first
      // tile; its last arrival of a tile opens warpgroup 0's first round of the next (which
      // then overlaps the last one's epilogue), and is skipped after the CTA's last tile, where
      // nobody would wait for it (kDynamic, whose consumers learn of the last tile only after
      // it: warpgroup 0 takes it after the loop). (Barriers 1 + cw are the epilogues'.)
      const bool last_tile =
          !kDynamic && (kPieces ? k == n_items - 1
                                : !kPersistent || t + static_cast<int>(gridDim.x) >= n_tiles);
      int rounds_left = n_blocks + 1;
      auto turn_begin = [&] { named_barrier_sync(4 + cw, 256); };
      auto turn_end = [&] {
        if (cw < kWGs - 1 || --rounds_left > 0 || !last_tile)
          named_barrier_arrive(4 + (cw + 1) % kWGs, 256);
      };
      if (cw == kWGs - 1 && k == 0 && n_blocks > 0) named_barrier_arrive(4, 256);

      // Intra-warpgroup overlap (FA3): S of tile it and P V of tile it - 1 are in flight
      // together; the softmax of tile it runs while P V still does, and only the O rescale
      // waits for it.
      uint32_t rP[kBlockN / 16][4];  // P of the previous tile, read by its in-flight P V
      // The first key tile visited holds the last keys. Where none of this warpgroup's rows
      // sees its upper half (the causal diagonal of a 128-row tile's first 64 rows, or S's
      // end), S and its softmax run on the lower half (ncu at 1k keys: -2.5% at H = 64, -1.5%
      // at 128, -1.4 to -2% at 256, where 80-key tiles leave warpgroup 0 no visible key of its
      // first tile at most query tiles; NOTES.md, twenty-third session). P V keeps K = kBlockN
      // with P = 0 above: ptxas closes the wgmma group at a branch with a group of its own, and
      // the loop's wait<1> would then wait for P V.
      bool half = false;
      if constexpr (kHalfFirst)
        half = min(s_len, m0 + 64 * cw + 64) - (j_lo + n_blocks - 1) * kBlockN <= kBlockN / 2;
      // The first tile's completed S (ns of its floats): its softmax (O is still 0: no
      // rescale) and P.
      auto first_tile = [&](float* acc_s, int ns) {
        float corr[2];
        if (!kRules) release_k(0);
        softmax(acc_s, 0, corr, ns);
        if (kRules) release_k(0);
        convert_p(acc_s, rP, ns);
      };
      if (n_blocks > 0) {
        turn_begin();
        if (kHalfFirst && half) {
          float acc_s[kNH / 2];
          issue_qk_half(acc_s, 0);
          turn_end();
          wgmma_wait<0>();
          fence_regs(acc_s);
          first_tile(acc_s, kNH / 2);
        } else {
          float acc_s[kNS];
          issue_qk(acc_s, 0, true);
          turn_end();
          wgmma_wait<0>();
          fence_regs(acc_s);
          first_tile(acc_s, kNS);
        }
      }
      for (int it = 1; it < n_blocks; ++it) {
        float acc_s[kNS], corr[2];
        turn_begin();
        issue_qk(acc_s, it, false);
        issue_pv(rP, it - 1);
        turn_end();
        wgmma_wait<1>();  // groups complete in order: S is done, P V may not be
        fence_regs(acc_s);
        // K stays held through the softmax where it may be read again (recompute_s, the
        // rules' stage data).
        constexpr bool kHoldK = kRules || Cfg::kLazyMax;
        if (!kHoldK) release_k(it);
        int lazy = -1;  // softmax_lazy's answer; -1: not tried (the exact path on this S)
        if (Cfg::kLazyMax && __all_sync(0xffffffffu, row_max[0] != -INFINITY && row_max[1] != -INFINITY))
          lazy = softmax_lazy(acc_s, it, corr);
        if (lazy == 2) recompute_s(acc_s, it);
        if (lazy < 0 || lazy == 2) softmax(acc_s, it, corr, kNS);
        if (kHoldK) release_k(it);
        wgmma_wait<0>();
        fence_regs(acc_o);
        release_v(it - 1);
        if (lazy != 0) rescale_o(corr);
        convert_p(acc_s, rP, kNS);
      }
      if (n_blocks > 0) {
        turn_begin();
        issue_pv(rP, n_blocks - 1);
        turn_end();
        wgmma_wait<0>();
        fence_regs(acc_o);
        release_v(n_blocks - 1);
      }

      // Epilogue: O = acc / l, lse = (m + log2 l) ln 2; l == 0 (no visible key) gives O = 0 and
      // lse = -inf. O is staged in the warpgroup's rows of sO (sQ when the CTA runs one tile,
      // once no wgmma of the warpgroup still reads it) in the tiles' swizzle, and one thread
      // stores them by TMA (rows past T are not written); the next tile's epilogue waits until
      // that store has read them.
      // kPieces: the partial O (in the accumulators' order) and (m, l) rows to slot 2 c + piece;
      // the tile's last piece to finish (a counter per tile and warpgroup) merges every piece's
      // partial in the order of their CTAs, O = sum_i 2^(m_i - m) O_i and l = sum_i 2^(m_i - m)
      // l_i with m = max_i m_i, and stores the tile: the same bits whichever piece is last.
      // Nobody waits, so no order between the CTAs is assumed.
      float l_row[2];  // kPieces: l of rows g, g + 8
      if constexpr (kPieces) {
        l_row[0] = quad_sum(row_sum[0]);
        l_row[1] = quad_sum(row_sum[1]);
        const int tw = tid % 128;  // the thread's index in its warpgroup
        auto slot_ml = [&](int slot) {  // this thread's row g of the slot (row g + 8: + 8)
          return reinterpret_cast<float2*>(p.split_ml) + int64_t{slot} * kBlockM + wr + g;
        };
        const int own = 2 * static_cast<int>(blockIdx.x) + piece;
        float4* po = split_slot_o<kNO>(p.split_o, own, kWGs, cw, tw);
#pragma unroll
        for (int i = 0; i < kNO / 4; ++i)
          po[i * 128] =
              make_float4(acc_o[4 * i], acc_o[4 * i + 1], acc_o[4 * i + 2], acc_o[4 * i + 3]);
        if (tig == 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h) slot_ml(own)[8 * h] = make_float2(row_max[h], l_row[h]);
        }
        __threadfence();
        named_barrier_sync(1 + cw, 128);
        const int u0 = piece_tile * tail.nb;  // the tile's key tiles: runs of CTAs c0 .. c1
        const int c0 = tail.cta_of(u0), c1 = tail.cta_of(u0 + tail.nb - 1);
        if (tw == 0) {
          unsigned long long* ctr = p.split_cnt + piece_tile * kWGs + cw;
          tile_id[cw] = claim_tile(ctr, claim_add(ctr)) == c1 - c0;
          __threadfence();
        }
        named_barrier_sync(1 + cw, 128);
        if (!tile_id[cw]) continue;
        // From m = -inf, l = 0, O = 0 the first merge gives the first partial exactly.
#pragma unroll
        for (int h = 0; h < 2; ++h) row_max[h] = -INFINITY, l_row[h] = 0.f;
#pragma unroll
        for (int i = 0; i < kNO; ++i) acc_o[i] = 0.f;
        for (int c = c0; c <= c1; ++c) {
          const int slot = 2 * c + (tail.start(c) < u0);  // c's first piece, or its second
          float a[2], e[2];  // the scales of the merged rows and of the slot's
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float2 x = __ldcg(slot_ml(slot) + 8 * h);
            const float mx = fmaxf(row_max[h], x.x), m_use = mx == -INFINITY ? 0.f : mx;
            a[h] = exp2_approx(row_max[h] - m_use);
            e[h] = exp2_approx(x.x - m_use);
            row_max[h] = mx;
            l_row[h] = l_row[h] * a[h] + x.y * e[h];
          }
          const float4* pc = split_slot_o<kNO>(p.split_o, slot, kWGs, cw, tw);
#pragma unroll
          for (int i = 0; i < kNO / 4; ++i) {
            const float4 v = __ldcg(pc + i * 128);
            acc_o[4 * i] = acc_o[4 * i] * a[0] + v.x * e[0];
            acc_o[4 * i + 1] = acc_o[4 * i + 1] * a[0] + v.y * e[0];
            acc_o[4 * i + 2] = acc_o[4 * i + 2] * a[1] + v.z * e[1];
            acc_o[4 * i + 3] = acc_o[4 * i + 3] * a[1] + v.w * e[1];
          }
        }
      }
      float* gLse = p.lse + bn * p.t;
      if (Cfg::kStageO && o_leader) bulk_wait_read();
      named_barrier_sync(1 + cw, 128);
      const uint32_t o_off = Cfg::kStageO ? Cfg::kOffO : Cfg::kOffQ;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = kPieces ? l_row[h] : quad_sum(row_sum[h]);
        const float inv = l == 0.f ? 0.f : 1.f / l;
        const int row = wr + g + 8 * h;
#pragma unroll
        for (int i = 0; i < kNO / 4; ++i) {
          const uint32_t o2 = pack2<T>(acc_o[4 * i + 2 * h] * inv, acc_o[4 * i + 2 * h + 1] * inv);
          const int chunk = i % 8;  // 16-byte chunk of column 8 i within its column block
          const uint32_t off = (i / 8) * kBlockM * kRowBytes + row * kRowBytes +
                               ((chunk ^ (row % 8)) * 16) + tig * 4;
          *reinterpret_cast<uint32_t*>(smem + o_off + off) = o2;
        }
        if (tig == 0 && m0 + row < t_len)
          gLse[m0 + row] = l == 0.f ? -INFINITY : (row_max[h] + log2f(l)) * 0.6931471805599453f;
      }
      fence_proxy_async();
      named_barrier_sync(1 + cw, 128);
      if (o_leader) {
#pragma unroll
        for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
          tma_store_4d(&tma_o, base + o_off + cb * kBlockM * kRowBytes + 64 * cw * kRowBytes,
                       cb * 64, static_cast<int>(n), m0 + 64 * cw, static_cast<int>(b));
        bulk_commit();
      }
    }
    // kDynamic: the ring's arrival after the last tile (every causal tile has n_blocks > 0).
    if (kDynamic && cw == 0 && k > 0) named_barrier_sync(4, 256);
    // Shared memory must outlive the reads of the last stores.
    if (o_leader) bulk_wait_read();
  }
  // kPieces, launched as a dependent of the whole rounds' kernel: ends after it, so that what
  // follows on the stream sees their O too.
  if constexpr (kPieces) pdl_wait();
#else
  __trap();  // only the sm_90a build of this kernel is ever launched (see select.h)
#endif
}

template <typename T, int kHeadDim, bool kCausal, bool kRules, bool kPersistent, bool kNarrow,
          int kWGs>
bool launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdCfgSm90<T, kHeadDim, kCausal, kRules, kPersistent, kNarrow, kWGs>;
  CUtensorMap tma_q, tma_k, tma_v, tma_o;
  if (!encode_btnh<T>(&tma_q, p.q, p.h, p.n, p.t, p.b, p.q_head_stride, p.q_row_stride,
                      p.q_batch_stride, Cfg::kBlockM) ||
      !encode_btnh<T>(&tma_k, p.k, p.h, p.kh, p.s, p.b, p.k_head_stride, p.k_row_stride,
                      p.k_batch_stride, Cfg::kBlockN) ||
      !encode_btnh<T>(&tma_v, p.v, p.hv, p.kh, p.s, p.b, p.v_head_stride, p.v_row_stride,
                      p.v_batch_stride, Cfg::kBlockN) ||
      !encode_btnh<T>(&tma_o, p.o, p.hv, p.n, p.t, p.b, p.o_head_stride, p.o_row_stride,
                      p.o_batch_stride, 64))  // a warpgroup's rows
    return false;
  const int64_t num_m_blocks = (p.t + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t n_tiles = num_m_blocks * p.n * p.b;  // < 2^31 for anything that fits in memory
  if (n_tiles == 0) return true;
  if (Cfg::kDynamic && p.tile_counter == nullptr) return false;
  // The persistent plain kernels' last round split (FwdTail) where it would leave at least a
  // quarter of the SMs idle, from 4k keys (the workspace, fwd_split_bytes): the kernel runs the
  // whole rounds (n_whole tiles), then the pieces. At 1k-2k keys, or with 15% of the SMs idle
  // (H = 64 at 16k), the pieces' fixed costs took more than the idle SMs' share (NOTES.md,
  // thirty-fifth session).
  FwdTail tail{0, 0, 0};
  int64_t n_whole = n_tiles;
  if constexpr (kPersistent && !kCausal) {
    const int64_t sms = sm_count(), nb = (p.s + Cfg::kBlockN - 1) / Cfg::kBlockN;
    const int64_t last = n_tiles % sms;  // tiles of the last round
    if (p.split_o && last > 0 && 4 * last <= 3 * sms) {
      tail = FwdTail{static_cast<int>(last), static_cast<int>(std::min(sms, last * nb / 2)),
                     static_cast<int>(nb)};
      n_whole = n_tiles - last;
    }
  }
  const int64_t grid = kPersistent ? std::min<int64_t>(n_whole, sm_count()) : n_tiles;
  auto kernel = flash_fwd_sm90_kernel<T, kHeadDim, kCausal, kRules, kPersistent, kNarrow, kWGs>;
  // kDynamic's sections: the query heads whose K and V fill 32 MB of the L2 (the heads of a
  // GQA group share theirs), 16 MB where a head has at most 8 query tiles. Measured against
  // 8-32 MB (NOTES.md, twenty-eighth session): 16 MB is 2.4-4.2% faster at 1k keys and
  // 1.5-3% slower at 2k-4k, where 32 MB is the best.
  const int64_t kv_bytes =
      std::max<int64_t>(2 * p.s * p.h * static_cast<int64_t>(sizeof(T)) * p.kh / p.n, 1);
  const int64_t sec_bytes = int64_t{num_m_blocks <= 8 ? 16 : 32} << 20;
  const int sec_heads =
      static_cast<int>(std::clamp<int64_t>(sec_bytes / kv_bytes, 1, p.b * p.n));
  // A failure shows up in the caller's cudaGetLastError().
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Cfg::kSmemBytes) != cudaSuccess)
    return true;
  // Without a bias the bias tiles (the end of the layout) are left out, and the L1 keeps them.
  const int smem = Cfg::kSmemBytes - (p.bias ? 0 : Cfg::kBiasBytes);
  if (grid > 0)
    kernel<<<static_cast<unsigned>(grid), Cfg::kThreads, smem, stream>>>(
        p, tma_q, tma_k, tma_v, tma_o, static_cast<int>(num_m_blocks), static_cast<int>(n_whole),
        sec_heads, FwdTail{0, 0, 0});
  if constexpr (kPersistent && !kCausal) {
    if (tail.tiles > 0) {
      // The pieces' CTAs take the SMs as the whole rounds' leave them; only as a dependent of
      // our own kernel, which started after the inputs were written.
      auto pieces =
          flash_fwd_sm90_kernel<T, kHeadDim, kCausal, kRules, kPersistent, kNarrow, kWGs, true>;
      if (cudaFuncSetAttribute(pieces, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Cfg::kSmemBytes) != cudaSuccess)
        return true;
      const int nt = static_cast<int>(n_tiles), mb = static_cast<int>(num_m_blocks);
      if (grid > 0)
        launch_dependent(pieces, tail.ctas, Cfg::kThreads, Cfg::kSmemBytes, stream, p, tma_q,
                         tma_k, tma_v, tma_o, mb, nt, sec_heads, tail);
      else
        pieces<<<tail.ctas, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
            p, tma_q, tma_k, tma_v, tma_o, mb, nt, sec_heads, tail);
    }
  }
  return true;
}

}  // namespace sm90

// Launches the sm90 forward on `stream`; false (nothing launched) when the TMA descriptors
// cannot be built. Preconditions (select.h checks them): a cc 9.x device, p.s > 0, no variant
// but the rules (Rules, segment ids), the soft cap, ALiBi and a bias, and at H = 256 none at
// all. The rules kernel covers causal too, so each file compiles it once.
template <typename T, int kHeadDim, bool kCausal>
bool run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim == 256) {
    // One CTA a tile: Q, K and V fill the shared memory, leaving no room for a persistent
    // kernel's sO; the rules kernel (128-key tiles) is not built (select.h sends them to sm80).
    return sm90::launch_fwd<T, kHeadDim, kCausal, false, false, false, 2>(p, stream);
  } else {
    if (live_variant(p))
      return sm90::launch_fwd<T, kHeadDim, false, true, false, false, 2>(p, stream);
    // Persistent where it measured faster (NOTES.md, ninth session; A/Bs interleaved in one
    // process): at H = 64 the plain kernel at every length; causal up to T = 4k (1k +12-16%,
    // 4k +3-9%; at 16k -6% at H = 64, level at 128); at H = 128 the plain kernel at every
    // length, its 128-key tiles leaving room for sO (with the lazy max, against 176-key tiles
    // one CTA a tile: 2k level, 3k +7%, 4k +6%, 6k +1%, 16k level; fourteenth session).
    // At H = 64, 3 consumer warpgroups (192-row tiles) where T's padding to 192 rows costs at
    // most 15% more rows than to 128: plain +7%, +12%, +16% at 1k, 4k, 16k; causal past 4k +9%
    // at 16k (NOTES.md, eleventh session), and from 2k to 4k persistent, +3% at 2k and +9% at
    // 4k once its mask test stopped spilling, while at 1k the 192-row tiles lose 7% (fourteenth
    // session).
    if constexpr (kHeadDim == 64) {
      const int64_t rows192 = (p.t + 191) / 192 * 192, rows128 = (p.t + 127) / 128 * 128;
      if (20 * rows192 <= 23 * rows128 && (!kCausal || p.t >= 2048)) {
        if (kCausal && p.t > 4096)
          return sm90::launch_fwd<T, kHeadDim, kCausal, false, false, true, 3>(p, stream);
        return sm90::launch_fwd<T, kHeadDim, kCausal, false, true, true, 3>(p, stream);
      }
    }
    if constexpr (kHeadDim == 64 && !kCausal) {
      // 128-key tiles where 192 would pad S by more than 5% beyond what 128 pads it by: at
      // S = 512 and 1k +13% and +9% (1152 keys computed for 1024 otherwise); at 1.5k, 3k and
      // 16k, which 192 divides or nearly, 192 is 2-4% faster (NOTES.md, tenth session).
      const int64_t pad192 = (p.s + 191) / 192 * 192 - p.s;
      const int64_t pad128 = (p.s + 127) / 128 * 128 - p.s;
      if (20 * (pad192 - pad128) > p.s)
        return sm90::launch_fwd<T, kHeadDim, false, false, true, true, 2>(p, stream);
      return sm90::launch_fwd<T, kHeadDim, false, false, true, false, 2>(p, stream);
    } else if constexpr (!kCausal) {  // H = 128
      return sm90::launch_fwd<T, kHeadDim, false, false, true, true, 2>(p, stream);
    } else {
      if (p.t <= 4096)
        return sm90::launch_fwd<T, kHeadDim, true, false, true, false, 2>(p, stream);
      return sm90::launch_fwd<T, kHeadDim, true, false, false, false, 2>(p, stream);
    }
  }
}

}  // namespace jaxflash::cuda
