// Backward kernels for head dim 192, fp16 (one file per pair so that they compile in parallel).
#include "../flash_bwd.cuh"

namespace jaxflash::cuda {

template void run_bwd<__half, 192, 192, false>(const BwdParams&, cudaStream_t);
template void run_bwd<__half, 192, 192, true>(const BwdParams&, cudaStream_t);

}  // namespace jaxflash::cuda
