// Entry points of the CUDA kernels. One explicit instantiation per (direction, head dim,
// dtype) lives in instantiations/, each file covering both causal values.
#pragma once

#include <cuda_runtime.h>

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

// T is __half or __nv_bfloat16; kHeadDim is H and kHeadDimV >= Hv (dispatch_fwd_head_dims
// says which pair runs which (H, Hv)). Every variant of p is supported.
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_fwd(const FwdParams& p, cudaStream_t stream);

// p.delta (B, N, T) and p.dq_accum (B, T, N, H) must point at fp32 device workspace.
// No variant is supported yet: live_variant(p) must be nullptr.
template <typename T, int kHeadDim, bool kCausal>
void run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace jaxflash::cuda
