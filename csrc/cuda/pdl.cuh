// Programmatic dependent launches: a kernel whose CTAs may start while the stream's kernel
// before it still runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jaxflash::cuda {

// The sm90 backward's kernels after its first, and the sm90 forward's merge of a split last
// round (no-ops before sm90 and in kernels launched the usual way). pdl_wait: until the grid
// the kernel was launched after has completed, its writes visible. pdl_trigger: the stream's
// next kernel, if launched as a dependent (launch_dependent), may start its CTAs on the SMs
// this grid leaves free once each of its CTAs has triggered or exited.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the stream's
// kernel before it (pdl_wait, pdl_trigger): its CTAs may start, and run up to their pdl_wait,
// while that kernel's last CTAs run.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), int64_t grid, int block, int smem,
                             cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(block));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace jaxflash::cuda
