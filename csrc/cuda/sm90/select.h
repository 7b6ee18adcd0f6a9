// Chooses between the sm90 (TMA + wgmma) kernels and the sm80 (mma.sync) ones at run time.
// The sm90 kernels are compiled only when the build targets sm_90a (JAXFLASH_SM90, set by
// cmake/cuda.cmake) and run only on a cc 9.x device at H == Hv: the forward at H in {64, 128}
// for attention with at least one key whose variants are those of sm90_fwd_variants_ok, at
// H = 256 for plain (optionally causal) attention; the backward at H in {64, 128} for
// attention with T, S > 0 whose variants are those of sm90_bwd_variants_ok, at H = 256
// for plain (optionally causal) attention with T, S > 0, the same cases with
// deterministic_backward.
// JAXFLASH_DISABLE_SM90=1 forces the sm80 kernels (A/B benchmarking).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "../dispatch.h"
#include "../launch.h"

namespace jaxflash::cuda {

#ifdef JAXFLASH_SM90
// Defined in sm90/flash_fwd_sm90.cuh; false when nothing was launched (no TMA descriptors).
template <typename T, int kHeadDim, bool kCausal>
bool run_fwd_sm90(const FwdParams& p, cudaStream_t stream);
// Defined in sm90/flash_bwd_sm90.cuh; false when nothing was launched.
template <typename T, int kHeadDim, bool kCausal>
bool run_bwd_sm90(const BwdParams& p, cudaStream_t stream);

// Compute capability major of the current device, queried once per device.
inline int current_cc_major() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0: not queried yet
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < kMaxDevices && (major = cache[dev].load(std::memory_order_relaxed)) != 0)
    return major;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return 0;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(major, std::memory_order_relaxed);
  return major;
}

inline bool sm90_disabled_by_env() {
  static const bool disabled = [] {
    const char* v = std::getenv("JAXFLASH_DISABLE_SM90");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return disabled;
}

// TMA wants 16-byte multiples below 2^40 for every byte stride (elements are 2 bytes).
inline bool tma_strides_ok(std::initializer_list<int64_t> strides) {
  for (int64_t st : strides)
    if (st <= 0 || (2 * st) % 16 != 0 || 2 * st >= (int64_t{1} << 40)) return false;
  return true;
}

inline bool tma_strides_ok(const FwdParams& p) {
  return tma_strides_ok({p.q_head_stride, p.q_row_stride, p.q_batch_stride, p.k_head_stride,
                         p.k_row_stride, p.k_batch_stride, p.v_head_stride, p.v_row_stride,
                         p.v_batch_stride});
}

// Of the variants, the sm90 rules kernels run those that hide whole regions of keys (lengths,
// window and causal alignment cut each query row's key range, segment ids the key tiles whose
// ids a query tile does not have) and some that change the logits: the forward the soft cap,
// ALiBi and a bias, the backward the soft cap or at H = 128 a bias with no broadcast dim (dbias
// written once an element; the sums of a broadcast one's dbias and of dalibi run on sm80, and
// so does a bias beside the soft cap, whose derivative the backward takes back from P, and at
// H = 64, whose bias stage would not fit in shared memory). Mask and dropout run on sm80, and
// so does a bias whose rows of keys are not 16-byte aligned (the forward copies them by bulk
// copies, which need that): one broadcast over the keys, or with S or a stride not a multiple
// of 8.
inline bool sm90_bias_ok(const FwdParams& p) {
  const BcastStrides& st = p.bias_strides;
  return !p.bias || (st.col == 1 && p.s % 8 == 0 && st.row % 8 == 0 && st.head % 8 == 0 &&
                     st.batch % 8 == 0 && st.outer % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(p.bias) % 16 == 0);
}
inline bool sm90_fwd_variants_ok(const FwdParams& p) {
  return !p.mask && !p.dropout_seeds && sm90_bias_ok(p);
}
inline bool sm90_bwd_variants_ok(const BwdParams& p) {
  return sm90_fwd_variants_ok(p) && !p.alibi_slopes &&
         (!p.bias || (p.h == 128 && dbias_direct(p) && !(p.softcap > 0.f)));
}

inline bool use_fwd_sm90(const FwdParams& p) {
  return !sm90_disabled_by_env() && p.s > 0 && sm90_fwd_variants_ok(p) && tma_strides_ok(p) &&
         tma_strides_ok({p.o_head_stride, p.o_row_stride, p.o_batch_stride}) &&
         p.b < (int64_t{1} << 31) && current_cc_major() == 9;
}

inline bool use_bwd_sm90(const BwdParams& p) {
  return !sm90_disabled_by_env() && p.s > 0 && p.t > 0 && sm90_bwd_variants_ok(p) &&
         tma_strides_ok(p) &&
         tma_strides_ok({p.do_head_stride, p.do_row_stride, p.do_batch_stride}) &&
         p.b < (int64_t{1} << 31) && current_cc_major() == 9;
}
#endif

// The workspace of the persistent plain sm90 forward's split last round (FwdParams::split_o,
// sm90/flash_fwd_sm90.cuh FwdTail): two pieces a CTA of up to 192 rows (H = 64's three
// warpgroups) of fp32 O and (m, l), and a counter per tile (fewer than the SMs) and warpgroup.
// 0 where that kernel does not run or does not split (fewer than 32 key tiles of 128). With
// `base`, the workspace there: sets o, ml and cnt.
inline int64_t fwd_split_bytes(const FwdParams& p, float** o = nullptr, float** ml = nullptr,
                               unsigned long long** cnt = nullptr, void* base = nullptr) {
#ifdef JAXFLASH_SM90
  if (p.is_causal || live_variant(p) || p.h != p.hv || (p.h != 64 && p.h != 128) ||
      p.s < 32 * 128 || !use_fwd_sm90(p))
    return 0;
  const int64_t rows = 2 * sm_count() * 192, o_bytes = rows * p.hv * 4, ml_bytes = rows * 8;
  if (base) {
    char* at = static_cast<char*>(base);
    *o = reinterpret_cast<float*>(at);
    *ml = reinterpret_cast<float*>(at + o_bytes);
    *cnt = reinterpret_cast<unsigned long long*>(at + o_bytes + ml_bytes);
  }
  return o_bytes + ml_bytes + sm_count() * 3 * 8;
#else
  (void)p, (void)o, (void)ml, (void)cnt, (void)base;
  return 0;
#endif
}

// The head dims the sm90 kernels have (instantiations/{fwd,bwd}_sm90_hdim<d>_*, compiled with
// d): H == Hv in {64, 128, 256}. Every other pair, and a smaller Hv on these kernels, runs on
// sm80.
template <int kHeadDim, int kHeadDimV>
constexpr bool has_fwd_sm90() {
  return kHeadDim == kHeadDimV && (kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256) &&
         contains(FwdHeadDims{}, kHeadDim);
}

// The d256 kernels have no rules kernel (the forward's 80-key tiles, the backward's split
// columns; the rules kernels' are 128 keys).
template <int kHeadDim, typename Params>
inline bool sm90_covers(const Params& p) {
  return kHeadDim != 256 || live_variant(p) == nullptr;
}

template <int kHeadDim, int kHeadDimV>
constexpr bool has_bwd_sm90() {
  return kHeadDim == kHeadDimV && (kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256) &&
         contains(BwdHeadDims{}, kHeadDim);
}

// Warns once per process that the TMA descriptors could not be built.
inline void warn_no_tma(const char* direction) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    std::fprintf(stderr, "jaxflash: cannot build TMA descriptors; using the sm80 %s\n", direction);
}

// The forward the handler launches: sm90 where it applies, else sm80.
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_fwd_best(const FwdParams& p, cudaStream_t stream) {
#ifdef JAXFLASH_SM90
  if constexpr (has_fwd_sm90<kHeadDim, kHeadDimV>()) {
    if (p.hv == kHeadDimV && sm90_covers<kHeadDim>(p) && use_fwd_sm90(p)) {
      if (run_fwd_sm90<T, kHeadDim, kCausal>(p, stream)) return;
      warn_no_tma("forward");
    }
  }
#endif
  run_fwd<T, kHeadDim, kHeadDimV, kCausal>(p, stream);
}

// The backward the handler launches: sm90 where it applies, else sm80.
template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
void run_bwd_best(const BwdParams& p, cudaStream_t stream) {
#ifdef JAXFLASH_SM90
  if constexpr (has_bwd_sm90<kHeadDim, kHeadDimV>()) {
    if (p.hv == kHeadDimV && sm90_covers<kHeadDim>(p) && use_bwd_sm90(p)) {
      if (run_bwd_sm90<T, kHeadDim, kCausal>(p, stream)) return;
      warn_no_tma("backward");
    }
  }
#endif
  run_bwd<T, kHeadDim, kHeadDimV, kCausal>(p, stream);
}

}  // namespace jaxflash::cuda
