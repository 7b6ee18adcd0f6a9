// sm90 (TMA + wgmma) backward kernel, head dim 256, bf16. Built only with sm_90a in the archs.
#ifdef JAXFLASH_SM90
#include "../sm90/flash_bwd_sm90.cuh"

namespace jaxflash::cuda {
template bool run_bwd_sm90<__nv_bfloat16, 256, false>(const BwdParams&, cudaStream_t);
template bool run_bwd_sm90<__nv_bfloat16, 256, true>(const BwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
#endif
