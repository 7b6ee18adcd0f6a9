#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace jaxflash::cpu {
namespace {

constexpr int64_t kBlockM = 32;  // query rows per tile
constexpr int64_t kBlockN = 64;  // key rows per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Storage types: fp16 and bf16 are moved as raw 16-bit words and widened to fp32 for math.
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(F16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1f, man = x.bits & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void from_float(float f, float& out) { out = f; }
inline void from_float(float f, BF16& out) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { out.bits = uint16_t((u >> 16) | 0x40); return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1);  // round to nearest even
  out.bits = uint16_t(u >> 16);
}
inline void from_float(float f, F16& out) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) { out.bits = sign | 0x7e00; return; }   // NaN
  if (abs >= 0x477ff000u) { out.bits = sign | 0x7c00; return; }  // overflow to inf
  if (abs < 0x38800000u) {                                        // subnormal or zero
    const float a = std::fabs(f) * 16777216.0f;                   // 2^24: units of the fp16 ulp
    out.bits = sign | uint16_t(std::nearbyint(a));
    return;
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1);
  out.bits = sign | uint16_t((r - (112u << 23)) >> 13);
}

// Copies rows [r0, r0 + rows) of one head of a (B, L, heads, dim) tensor into a dense fp32 tile.
template <typename T>
void load_tile(const T* base, int64_t row_stride, int64_t r0, int64_t rows, int64_t dim,
               float* tile) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = base + (r0 + r) * row_stride;
    for (int64_t d = 0; d < dim; ++d) tile[r * dim + d] = to_float(src[d]);
  }
}

template <typename F>
void parallel_for(int64_t n, F&& body) {
  const int64_t workers =
      std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) body(i);
    });
  for (auto& t : pool) t.join();
}

// Key tiles a query tile [m0, m0 + rows) must visit: causal tiles past the diagonal are skipped.
inline int64_t key_end(const FwdParams& p, int64_t m0, int64_t rows) {
  return p.is_causal ? std::min(p.s, m0 + rows) : p.s;
}

inline bool visible(const FwdParams& p, int64_t t, int64_t s) { return !p.is_causal || s <= t; }

template <typename T>
void fwd_typed(const FwdParams& p) {
  const int64_t G = p.group(), H = p.h, Hv = p.hv;
  const int64_t m_tiles = (p.t + kBlockM - 1) / kBlockM;
  parallel_for(p.b * p.n * m_tiles, [&](int64_t job) {
    const int64_t mt = job % m_tiles, n = (job / m_tiles) % p.n, b = job / (m_tiles * p.n);
    const int64_t m0 = mt * kBlockM, rows = std::min(kBlockM, p.t - m0);
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + (n / G) * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + (n / G) * p.v_head_stride;
    T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + n * p.o_head_stride;
    float* lse = p.lse + (b * p.n + n) * p.t;

    std::vector<float> sQ(rows * H), sK(kBlockN * H), sV(kBlockN * Hv), sS(kBlockN);
    std::vector<float> acc(rows * Hv, 0.f), m(rows, kNegInf), l(rows, 0.f);
    load_tile(q, p.q_row_stride, m0, rows, H, sQ.data());  // (rows, H)

    const int64_t n_end = key_end(p, m0, rows);
    for (int64_t n0 = 0; n0 < n_end; n0 += kBlockN) {
      const int64_t cols = std::min(kBlockN, n_end - n0);
      load_tile(k, p.k_row_stride, n0, cols, H, sK.data());   // (cols, H)
      load_tile(v, p.v_row_stride, n0, cols, Hv, sV.data());  // (cols, Hv)
      for (int64_t i = 0; i < rows; ++i) {
        // S = scale * Q K^T for row i, masked entries at -inf
        float row_max = m[i];
        for (int64_t j = 0; j < cols; ++j) {
          float dot = 0.f;
          for (int64_t d = 0; d < H; ++d) dot += sQ[i * H + d] * sK[j * H + d];
          sS[j] = visible(p, m0 + i, n0 + j) ? dot * p.scale : kNegInf;
          row_max = std::max(row_max, sS[j]);
          if (std::isnan(sS[j])) row_max = sS[j];
        }
        if (row_max == kNegInf) continue;  // nothing visible yet in this row
        // online softmax: rescale the running sum and accumulator to the new max
        const float correction = std::exp(m[i] - row_max);
        l[i] *= correction;
        float* a = &acc[i * Hv];
        for (int64_t d = 0; d < Hv; ++d) a[d] *= correction;
        for (int64_t j = 0; j < cols; ++j) {
          const float pj = std::exp(sS[j] - row_max);
          l[i] += pj;
          for (int64_t d = 0; d < Hv; ++d) a[d] += pj * sV[j * Hv + d];  // O += P V
        }
        m[i] = row_max;
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      T* dst = o + (m0 + i) * p.o_row_stride;
      for (int64_t d = 0; d < Hv; ++d) from_float(acc[i * Hv + d] * inv, dst[d]);
      lse[m0 + i] = l[i] > 0.f ? m[i] + std::log(l[i]) : (std::isnan(l[i]) ? l[i] : kNegInf);
    }
  });
}

template <typename T>
void bwd_typed(const BwdParams& p) {
  const int64_t G = p.group(), H = p.h, Hv = p.hv;

  // delta = rowsum(dO * O) - dlse, the softmax-Jacobian term shared by every key.
  parallel_for(p.b * p.n, [&](int64_t bn) {
    const int64_t b = bn / p.n, n = bn % p.n;
    const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + n * p.o_head_stride;
    const T* dout = static_cast<const T*>(p.dout) + b * p.do_batch_stride + n * p.do_head_stride;
    for (int64_t t = 0; t < p.t; ++t) {
      float acc = 0.f;
      for (int64_t d = 0; d < Hv; ++d)
        acc += to_float(o[t * p.o_row_stride + d]) * to_float(dout[t * p.do_row_stride + d]);
      p.delta[bn * p.t + t] = acc - p.dlse[bn * p.t + t];
    }
  });
  std::fill(p.dq_accum, p.dq_accum + p.b * p.t * p.n * H, 0.f);

  // K/V-stationary: each job owns one (batch, kv head), so dK/dV/dQ writes never collide.
  parallel_for(p.b * p.kh, [&](int64_t job) {
    const int64_t b = job / p.kh, kh = job % p.kh;
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + kh * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + kh * p.v_head_stride;
    T* dk = static_cast<T*>(p.dk) + b * p.dk_batch_stride + kh * p.dk_head_stride;
    T* dv = static_cast<T*>(p.dv) + b * p.dv_batch_stride + kh * p.dv_head_stride;
    std::vector<float> sK(kBlockN * H), sV(kBlockN * Hv), dK(kBlockN * H), dV(kBlockN * Hv);
    std::vector<float> sQ(kBlockM * H), sdO(kBlockM * Hv), P(kBlockM * kBlockN),
        dS(kBlockM * kBlockN);

    for (int64_t n0 = 0; n0 < p.s; n0 += kBlockN) {
      const int64_t cols = std::min(kBlockN, p.s - n0);
      load_tile(k, p.k_row_stride, n0, cols, H, sK.data());
      load_tile(v, p.v_row_stride, n0, cols, Hv, sV.data());
      std::fill(dK.begin(), dK.end(), 0.f);
      std::fill(dV.begin(), dV.end(), 0.f);
      for (int64_t n = kh * G; n < (kh + 1) * G; ++n) {
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
        const T* dout =
            static_cast<const T*>(p.dout) + b * p.do_batch_stride + n * p.do_head_stride;
        const float* lse = p.lse + (b * p.n + n) * p.t;
        const float* delta = p.delta + (b * p.n + n) * p.t;
        float* dq = p.dq_accum + b * p.t * p.n * H + n * H;  // fp32 (T, N, H) slice
        // causal: query tiles wholly above this key tile see none of it
        const int64_t m_begin = p.is_causal ? (n0 / kBlockM) * kBlockM : 0;
        for (int64_t m0 = m_begin; m0 < p.t; m0 += kBlockM) {
          const int64_t rows = std::min(kBlockM, p.t - m0);
          load_tile(q, p.q_row_stride, m0, rows, H, sQ.data());
          load_tile(dout, p.do_row_stride, m0, rows, Hv, sdO.data());
          for (int64_t i = 0; i < rows; ++i) {
            const float li = lse[m0 + i];
            for (int64_t j = 0; j < cols; ++j) {
              // P = exp(scale * q.k - lse): the forward's probabilities, recomputed
              float dot = 0.f;
              for (int64_t d = 0; d < H; ++d) dot += sQ[i * H + d] * sK[j * H + d];
              const bool vis = visible(p, m0 + i, n0 + j) && li != kNegInf;
              const float pij = vis ? std::exp(dot * p.scale - li) : 0.f;
              // dP = dO V^T ; dS = P * (dP - delta)
              float dp = 0.f;
              for (int64_t d = 0; d < Hv; ++d) dp += sdO[i * Hv + d] * sV[j * Hv + d];
              P[i * kBlockN + j] = pij;
              dS[i * kBlockN + j] = vis ? pij * (dp - delta[m0 + i]) : 0.f;
            }
          }
          for (int64_t j = 0; j < cols; ++j)
            for (int64_t i = 0; i < rows; ++i) {
              const float pij = P[i * kBlockN + j], dsij = dS[i * kBlockN + j] * p.scale;
              for (int64_t d = 0; d < Hv; ++d) dV[j * Hv + d] += pij * sdO[i * Hv + d];  // dV += P^T dO
              for (int64_t d = 0; d < H; ++d) dK[j * H + d] += dsij * sQ[i * H + d];    // dK += dS^T Q
            }
          for (int64_t i = 0; i < rows; ++i) {
            float* dqi = dq + (m0 + i) * p.n * H;
            for (int64_t j = 0; j < cols; ++j) {
              const float dsij = dS[i * kBlockN + j] * p.scale;
              for (int64_t d = 0; d < H; ++d) dqi[d] += dsij * sK[j * H + d];  // dQ += dS K
            }
          }
        }
      }
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t d = 0; d < H; ++d) from_float(dK[j * H + d], dk[(n0 + j) * p.dk_row_stride + d]);
        for (int64_t d = 0; d < Hv; ++d) from_float(dV[j * Hv + d], dv[(n0 + j) * p.dv_row_stride + d]);
      }
    }
  });

  parallel_for(p.b * p.t, [&](int64_t bt) {
    const int64_t b = bt / p.t, t = bt % p.t;
    T* dq = static_cast<T*>(p.dq) + b * p.dq_batch_stride + t * p.dq_row_stride;
    const float* acc = p.dq_accum + bt * p.n * H;
    for (int64_t n = 0; n < p.n; ++n)
      for (int64_t d = 0; d < H; ++d) from_float(acc[n * H + d], dq[n * p.dq_head_stride + d]);
  });
}

template <template <typename> class Fn, typename P>
void dispatch_dtype(const P& p) {
  switch (p.dtype) {
    case DType::kF32: Fn<float>::run(p); break;
    case DType::kF16: Fn<F16>::run(p); break;
    case DType::kBF16: Fn<BF16>::run(p); break;
  }
}

template <typename T> struct Fwd { static void run(const FwdParams& p) { fwd_typed<T>(p); } };
template <typename T> struct Bwd { static void run(const BwdParams& p) { bwd_typed<T>(p); } };

}  // namespace

void run_fwd(const FwdParams& p) { dispatch_dtype<Fwd>(p); }
void run_bwd(const BwdParams& p) { dispatch_dtype<Bwd>(p); }

}  // namespace jaxflash::cpu
