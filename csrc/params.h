// The one struct that crosses from the FFI handlers to every kernel (CPU, CUDA sm80, later sm90).
// Letter key: B batch, T query length, S key length, N query heads, K kv heads, H head dim.
// Layout is BTNH for q/o/dq/do, BSKH for k/v/dk/dv, BNT for lse/dlse. Strides are in elements.
#pragma once

#include <cstdint>

namespace jaxflash {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

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
  bool is_causal;    // key s visible to query t only when s <= t
  DType dtype;

  int64_t group() const { return n / kh; }  // query heads per kv head
};

struct BwdParams : FwdParams {
  const void* dout;   // (B, T, N, Hv)
  const float* dlse;  // (B, N, T): cotangent of lse (zeros when lse is not an output)
  void* dq;           // (B, T, N, H)
  void* dk;           // (B, S, K, H)
  void* dv;           // (B, S, K, Hv)
  float* delta;       // (B, N, T) workspace: rowsum(dout * o) - dlse
  float* dq_accum;    // (B, T, N, H) fp32 workspace where a kernel accumulates dq; may be null

  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
};

}  // namespace jaxflash
