// Forward kernel, head dim 64, bf16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__nv_bfloat16, 64, 64, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__nv_bfloat16, 64, 64, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
