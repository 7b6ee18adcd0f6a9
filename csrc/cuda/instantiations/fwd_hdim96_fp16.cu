// Forward kernel, head dim 96, fp16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__half, 96, 96, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__half, 96, 96, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
