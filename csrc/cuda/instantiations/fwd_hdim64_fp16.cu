// Forward kernel, head dim 64, fp16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__half, 64, 64, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__half, 64, 64, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
