// Forward kernel, head dim 32, bf16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__nv_bfloat16, 32, 32, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__nv_bfloat16, 32, 32, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
