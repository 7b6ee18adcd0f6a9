// Backward kernels for head dims 192 (q, k) and 128 (v), fp16 (one file per pair so that they compile in parallel).
#include "../flash_bwd.cuh"

namespace jaxflash::cuda {

template void run_bwd<__half, 192, 128, false>(const BwdParams&, cudaStream_t);
template void run_bwd<__half, 192, 128, true>(const BwdParams&, cudaStream_t);

}  // namespace jaxflash::cuda
