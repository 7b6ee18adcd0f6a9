// sm90 (TMA + wgmma) forward kernel, head dim 64, fp16. Built only with sm_90a in the archs.
#ifdef JAXFLASH_SM90
#include "../sm90/flash_fwd_sm90.cuh"

namespace jaxflash::cuda {
template bool run_fwd_sm90<__half, 64, false>(const FwdParams&, cudaStream_t);
template bool run_fwd_sm90<__half, 64, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
#endif
