// Entry points of the CUDA kernels. One explicit instantiation per (direction, head dim,
// dtype) lives in instantiations/, each file covering both causal values.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace jaxflash::cuda {

// T is __half or __nv_bfloat16; kHeadDim is H (== Hv).
template <typename T, int kHeadDim, bool kCausal>
void run_fwd(const FwdParams& p, cudaStream_t stream);

// p.delta (B, N, T) and p.dq_accum (B, T, N, H) must point at fp32 device workspace.
template <typename T, int kHeadDim, bool kCausal>
void run_bwd(const BwdParams& p, cudaStream_t stream);

}  // namespace jaxflash::cuda
