// Forward kernel, head dims 192 (q, k) and 128 (v), the MLA shape, fp16.
#include "../flash_fwd.cuh"

namespace jaxflash::cuda {
template void run_fwd<__half, 192, 128, false>(const FwdParams&, cudaStream_t);
template void run_fwd<__half, 192, 128, true>(const FwdParams&, cudaStream_t);
}  // namespace jaxflash::cuda
