// CPU kernels: tiled online-softmax attention in fp32 accumulation, forward and backward,
// O(T + S) extra memory per tile. They make the full custom-call path run (and be tested) on CPU.
#pragma once

#include "../params.h"

namespace jaxflash::cpu {

void run_fwd(const FwdParams& p);

// Uses p.delta (B, N, T) and p.dq_accum (B, T, N, H) as workspace; both must be set.
void run_bwd(const BwdParams& p);

}  // namespace jaxflash::cpu
