// Backward kernels for head dim 64, fp16 (one file per pair so that they compile in parallel).
#include "../flash_bwd.cuh"

namespace jaxflash::cuda {

template void run_bwd<__half, 64, 64, false>(const BwdParams&, cudaStream_t);
template void run_bwd<__half, 64, 64, true>(const BwdParams&, cudaStream_t);

}  // namespace jaxflash::cuda
