// Backward kernels for head dim 128, bf16 (one file per pair so that they compile in parallel).
#include "../flash_bwd.cuh"

namespace jaxflash::cuda {

template void run_bwd<__nv_bfloat16, 128, 128, false>(const BwdParams&, cudaStream_t);
template void run_bwd<__nv_bfloat16, 128, 128, true>(const BwdParams&, cudaStream_t);

}  // namespace jaxflash::cuda
