// The Python extension: exposes registrations() (FFI handler capsules) and build_info().
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* jaxflash_fwd_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* jaxflash_bwd_cpu(XLA_FFI_CallFrame*);
#ifdef JAXFLASH_WITH_CUDA
XLA_FFI_Error* jaxflash_fwd_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* jaxflash_bwd_cuda(XLA_FFI_CallFrame*);
#endif
}

namespace {
template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxflash_ext, m) {
  m.def("registrations", [] {
    nb::dict cpu, cuda;
    cpu["jaxflash_fwd_cpu"] = capsule(jaxflash_fwd_cpu);
    cpu["jaxflash_bwd_cpu"] = capsule(jaxflash_bwd_cpu);
#ifdef JAXFLASH_WITH_CUDA
    cuda["jaxflash_fwd_cuda"] = capsule(jaxflash_fwd_cuda);
    cuda["jaxflash_bwd_cuda"] = capsule(jaxflash_bwd_cuda);
#endif
    nb::dict out;
    out["cpu"] = cpu;
    out["CUDA"] = cuda;
    return out;
  });
  m.def("build_info", [] {
    nb::dict info;
#ifdef JAXFLASH_WITH_CUDA
    info["cuda"] = true;
    info["cuda_archs"] = std::string(JAXFLASH_CUDA_ARCHS);
    info["cuda_head_dims"] = std::string(JAXFLASH_HEAD_DIMS);
    info["cuda_bwd_head_dims"] = std::string(JAXFLASH_BWD_HEAD_DIMS);
    info["cuda_dtypes"] = std::string(JAXFLASH_DTYPES);
#else
    info["cuda"] = false;
    info["cuda_archs"] = std::string();
    info["cuda_head_dims"] = std::string();
    info["cuda_bwd_head_dims"] = std::string();
    info["cuda_dtypes"] = std::string();
#endif
    return info;
  });
}
