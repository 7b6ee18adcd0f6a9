// The one struct that crosses from the FFI handlers to every kernel (CPU, CUDA sm80, later sm90).
// Letter key: B batch, T query length, S key length, N query heads, K kv heads, H head dim.
// Layout is BTNH for q/o/dq/do, BSKH for k/v/dk/dv, BNT for lse/dlse. Strides are in elements.
#pragma once

#include <cstdint>

namespace jaxflash {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

#ifdef __CUDACC__
#define JAXFLASH_HOST_DEVICE __host__ __device__
#else
#define JAXFLASH_HOST_DEVICE
#endif

// Element strides of a broadcast (..., B|1, N|1, T|1, S|1) operand (mask, bias); 0 on a
// broadcast dim, so the kernel reads the user's array in place and never expands it.
// `outer` steps over leading vmap dims, so flattened batch index b starts at batch_at(b).
struct BcastStrides {
  int64_t outer = 0, batch = 0, head = 0, row = 0, col = 0;
  JAXFLASH_HOST_DEVICE int64_t batch_at(int64_t b, int64_t batch_inner) const {
    return (b / batch_inner) * outer + (b % batch_inner) * batch;
  }
};

struct FwdParams {
  const void* q;  // (B, T, N, H)
  const void* k;  // (B, S, K, H)
  const void* v;  // (B, S, K, Hv)
  void* o;        // (B, T, N, Hv), dtype of q
  float* lse;     // (B, N, T): log-sum-exp of the scaled logits; -inf for a row with no visible key

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  int64_t b;       // batch (all leading dims of a vmapped call, flattened)
  int64_t t, s;    // query and key lengths
  int64_t n, kh;   // query heads and kv heads; n % kh == 0
  int64_t h, hv;   // head dims of q/k and of v

  float scale;       // multiplies q.k before the softmax
  float scale_log2;  // scale * log2(e): kernels use exp2
  bool is_causal;    // key s visible to query t only when s <= t + shift[b]
  DType dtype;

  // Variants; every field defaults to "off". Semantics: jaxflash/reference.py.
  // Per-batch operands below are indexed by the flattened batch index b (vmap dims included).
  int64_t batch_inner = 1;         // the user's B (q's dim at rank - 4); splits b for `outer`
  const void* bias = nullptr;      // (..., B|1, N|1, T|1, S|1), dtype of q, added to the logits
  BcastStrides bias_strides;
  const uint8_t* mask = nullptr;   // (..., B|1, N|1, T|1, S|1) bool: nonzero = attend
  BcastStrides mask_strides;
  const int32_t* q_lengths = nullptr;       // (B): query rows t >= q_lengths[b] see nothing
  const int32_t* kv_lengths = nullptr;      // (B): keys s >= kv_lengths[b] are invisible
  const int32_t* q_segment_ids = nullptr;   // (B, T); set together with kv_segment_ids
  const int32_t* kv_segment_ids = nullptr;  // (B, S): attend only where the ids are equal
  const float* alibi_slopes = nullptr;      // (B, N): logits -= slope * |s - (t + shift)|
  const uint32_t* dropout_seeds = nullptr;  // (B, 2): per-batch seeds of the dropout hash
  int64_t window_left = -1;   // keys s >= t + shift - window_left; -1: unbounded
  int64_t window_right = -1;  // keys s <= t + shift + window_right; -1: unbounded
  bool bottom_right = false;  // shift[b] = kv_len[b] - q_len[b] (else 0): causal/window/alibi
  float softcap = 0.f;        // logits = softcap * tanh(logits / softcap) when > 0
  float dropout_rate = 0.f;   // p is dropped where hash < dropout_threshold, kept ones / (1 - rate)
  uint32_t dropout_threshold = 0;
  // CUDA workspace: the mask's tile summary (cuda/launch.h MaskTiles); null without a mask.
  const uint8_t* mask_tiles = nullptr;
  // CUDA workspace: the next-tile counter of the persistent causal sm90 forward (claim_tile:
  // nothing zeroes it).
  unsigned long long* tile_counter = nullptr;
  // CUDA workspace of the persistent plain sm90 forward's split last round (FwdTail in
  // sm90/flash_fwd_sm90.cuh; select.h fwd_split_bytes sizes it): each piece's partial O (fp32,
  // in its accumulators' order) and (m, l) rows, and a counter per split tile and warpgroup
  // (claim_tile: nothing zeroes them). Null: no split.
  float* split_o = nullptr;
  float* split_ml = nullptr;
  unsigned long long* split_cnt = nullptr;

  // Optional (B, T, N, Hv) fp32 copy of O with o's strides: acc / l before the rounding to
  // q's dtype. The forward writes it when set (CUDA: the sm80 variant kernel); the backward,
  // as it reads o and lse, takes delta = rowsum(dout * o_f32) - dlse from it, which matches its
  // own fp32 sum_s P dP where the stored o misses it by a rounding of q's dtype (a rounding
  // that dbias over broadcast dims and dalibi sum up rather than average out).
  float* o_f32 = nullptr;

  int64_t group() const { return n / kh; }  // query heads per kv head
};

// Slots of the sm90 backward's grid that convert dq (dq = scale * dq_accum) for groups of
// `pairs` consecutive (b, kv head) pairs, whole sections of its CTA order, once the group's
// CTAs are done: the slots of group j follow group j + lag's CTAs, the last groups' come after
// every CTA, then each group's rows [rows, T), which the deferred key tiles also reach.
struct DqSlots {
  int* done = nullptr;  // (groups, 2): the group's CTAs done, of key tiles before the deferred, of those
  int pairs = 0, groups = 0, lag = 0;
  int rows = 0;                     // rows [0, rows) see no deferred key tile
  int mid_rows = 0, end_rows = 0;   // rows of [0, rows) a slot: among the CTAs, after them
  // Rows of [rows, T) a slot (0: rows == T; else end_rows, but the kernel's reading it from
  // here keeps the consumers' step loop as it was measured: derived there, ptxas reordered it).
  int def_rows = 0;
};

struct BwdParams : FwdParams {
  const void* dout;   // (B, T, N, Hv)
  const float* dlse;  // (B, N, T): cotangent of lse, or null for zeros (lse not an output)
  void* dq;           // (B, T, N, H), q's dtype or float32 (grads_f32)
  void* dk;           // (B, S, K, H), likewise
  void* dv;           // (B, S, K, Hv), likewise
  float* delta;       // (B, N, T) workspace: rowsum(dout * o) - dlse; (B, N, t_pad) with t_pad
  // The sm90 backward's rows padded to t_pad (a multiple of its query tiles; 0: unpadded):
  // delta as above, 0 past T, and lse_log2 (B, N, t_pad) = lse * log2(e), +inf where the row
  // sees no key or lies past T or the query length, so that whole tiles of both are bulk copies.
  int64_t t_pad = 0;
  float* lse_log2 = nullptr;
  float* dq_accum;    // (B, T, N, H) fp32 workspace where a kernel accumulates dq; may be null
  void* dbias = nullptr;         // bias's shape, dense, dtype of q: dlogits summed over broadcast dims
  float* dalibi = nullptr;       // (B, N): gradient of alibi_slopes
  bool deterministic = false;    // bit-identical backward across runs (the CPU kernel always is)
  bool grads_f32 = false;        // dq, dk, dv are float32, not q's dtype: for callers that sum
                                 // them further (ring attention adds one per ring step)
  // fp32/int32 workspaces of the CUDA variant backward (launch.h sizes them); null when unused.
  float* dbias_accum = nullptr;  // bias's shape: dbias summed over the CTAs that share an element
  float* dalibi_accum = nullptr; // (B, N, key tiles): dalibi of each key tile, summed in order
  int* dq_turn = nullptr;        // (B, N, query tiles): deterministic dQ, contributors done so far
  int* kv_seg_range = nullptr;   // (B, key tiles, 2): min and max segment id of each key tile
  // (B, N, ceil(T / 64)): the sm90 causal backward's dQ tickets. With dq_first_store, the
  // first contribution to a query tile is stored (dq_accum is not zeroed), the rest added.
  int* dq_ticket = nullptr;
  bool dq_first_store = false;
  // The deterministic sm90 backward where every key tile walks every query tile (plain
  // attention, or segment ids alone): each starts at a step of its own (run_bwd_sm90).
  bool rotate_walk = false;
  // The sm90 backward's preprocess beside its main kernel (run_bwd_sm90): (B, K) counts of the
  // query rows (of [0, t_pad), over the kv head's group) done, zeroed before each call; the
  // main kernel waits for prep_rows of them (0: the pass runs before it). The same workspace
  // holds dq_slots.done after them.
  int* prep_done = nullptr;
  int prep_rows = 0;
  // The sm90 backward's dq conversion by slots of its main kernel's own grid (run_bwd_sm90);
  // done null: the conversion pass runs after the kernel.
  DqSlots dq_slots;

  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
};

}  // namespace jaxflash
