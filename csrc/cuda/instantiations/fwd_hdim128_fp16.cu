// Forward kernel, head dim 128, fp16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__half, 128, 128, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__half, 128, 128, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
