// The key-range rules of the sm90 kernels (forward and backward): lengths, window, causal and
// its alignment, as one band of key - query distances per batch element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"

namespace jaxflash::cuda::sm90 {

// The causal, window, length and alignment rules of p (jaxflash/reference.py) for batch b:
// query t sees key s iff t < q_len, s < kv_len and -wl <= s - t - shift <= hi. Bounds that
// are off are 2^40 (beyond any key distance, and sums of them stay in int64).
struct Rules {
  int q_len = 0, kv_len = 0;
  int64_t shift = 0, wl = 0, hi = 0;

  Rules() = default;

  __device__ Rules(const FwdParams& p, int64_t b) {
    constexpr int64_t kOff = int64_t{1} << 40;
    const int64_t q_raw = p.q_lengths ? p.q_lengths[b] : p.t;
    const int64_t kv_raw = p.kv_lengths ? p.kv_lengths[b] : p.s;
    q_len = static_cast<int>(max(int64_t{0}, min(q_raw, p.t)));
    kv_len = static_cast<int>(max(int64_t{0}, min(kv_raw, p.s)));
    shift = p.bottom_right ? kv_raw - q_raw : 0;
    wl = p.window_left >= 0 ? min(p.window_left, kOff) : kOff;
    hi = p.window_right >= 0 ? min(p.window_right, kOff) : kOff;
    if (p.is_causal) hi = min(hi, int64_t{0});
  }

  // Keys [lo, hi) that some query row in [m0, m0 + rows) may see; empty as lo == hi.
  __device__ int2 key_range(int m0, int rows) const {
    const int64_t last = int64_t{min(m0 + rows, q_len)} - 1;
    if (last < m0) return make_int2(0, 0);
    const int64_t lo = max(int64_t{0}, min(m0 + shift - wl, int64_t{kv_len}));
    const int64_t end = min(int64_t{kv_len}, last + shift + hi + 1);
    return make_int2(static_cast<int>(lo), static_cast<int>(max(end, lo)));
  }

  // Queries [lo, end) that may see some key in [n0, n0 + cols); empty as lo == end.
  __device__ int2 query_range(int n0, int cols) const {
    const int64_t last = int64_t{min(n0 + cols, kv_len)} - 1;
    if (last < n0) return make_int2(0, 0);
    const int64_t lo = max(int64_t{0}, min(n0 - shift - hi, int64_t{q_len}));
    const int64_t end = min(int64_t{q_len}, last - shift + wl + 1);
    return make_int2(static_cast<int>(lo), static_cast<int>(max(end, lo)));
  }
};

}  // namespace jaxflash::cuda::sm90
