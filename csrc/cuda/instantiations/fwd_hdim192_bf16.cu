// Forward kernel, head dim 192, bf16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__nv_bfloat16, 192, 192, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__nv_bfloat16, 192, 192, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
