// The ONE place where run-time dtype, head dim and causal become template arguments.
// Only head dims compiled in (JAXFLASH_HDIM<d>, from the JAXFLASH_HEAD_DIMS CMake option)
// are reachable; the handler rejects the rest before getting here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "launch.h"

namespace jaxflash::cuda {

template <typename F>
bool dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF16: f(__half{}); return true;
    case DType::kBF16: f(__nv_bfloat16{}); return true;
    default: return false;
  }
}

template <typename F>
bool dispatch_head_dim(int64_t h, F&& f) {
  switch (h) {
#ifdef JAXFLASH_HDIM64
    case 64: f(std::integral_constant<int, 64>{}); return true;
#endif
#ifdef JAXFLASH_HDIM128
    case 128: f(std::integral_constant<int, 128>{}); return true;
#endif
    default: return false;
  }
}

template <typename F>
void dispatch_bool(bool b, F&& f) {
  if (b) f(std::true_type{}); else f(std::false_type{});
}

// f is a functor with `template <typename T, int kHeadDim, bool kCausal> void operator()()`
// (C++17 has no template lambdas); returns false if the (dtype, head dim) pair was not compiled in.
template <typename Params, typename F>
bool dispatch(const Params& p, F&& f) {
  bool ok = false;
  dispatch_dtype(p.dtype, [&](auto t) {
    ok = dispatch_head_dim(p.h, [&](auto hdim) {
      dispatch_bool(p.is_causal, [&](auto causal) {
        f.template operator()<decltype(t), decltype(hdim)::value, decltype(causal)::value>();
      });
    });
  });
  return ok;
}

inline bool head_dim_compiled(int64_t h) {
  return dispatch_head_dim(h, [](auto) {});
}

}  // namespace jaxflash::cuda
