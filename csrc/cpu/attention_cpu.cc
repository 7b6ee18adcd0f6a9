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

// Copies rows [r0, r0 + rows) of one head of a (B, L, heads, dim) tensor into a dense fp32 tile:
// (rows, dim), or with `transposed` (dim, kBlockN), column r holding row r0 + r and the columns
// past `rows` zero (the B operand of tile_dots).
template <typename T>
void load_tile(const T* base, int64_t row_stride, int64_t r0, int64_t rows, int64_t dim,
               float* tile, bool transposed = false) {
  const int64_t rs = transposed ? 1 : dim, ds = transposed ? kBlockN : 1;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = base + (r0 + r) * row_stride;
    for (int64_t d = 0; d < dim; ++d) tile[r * rs + d * ds] = to_float(src[d]);
  }
  for (int64_t d = 0; transposed && d < dim; ++d)
    std::fill(tile + d * kBlockN + rows, tile + (d + 1) * kBlockN, 0.f);
}

// The tile products below also get an AVX/FMA clone, picked when the module loads: the build
// targets the baseline ISA so that it runs on any x86-64 machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define JAXFLASH_SIMD_CLONES __attribute__((target_clones("fma", "default")))
#else
#define JAXFLASH_SIMD_CLONES
#endif

// C = A B^T for A (rows, dim) row-major and B given transposed (dim, kBlockN): C (rows, kBlockN).
// The inner loop runs along C's row, which vectorises; each C[i, j] still sums d in order.
JAXFLASH_SIMD_CLONES void tile_dots(const float* __restrict a, int64_t rows, int64_t dim,
                                    const float* __restrict bt, float* __restrict c) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict ci = c + i * kBlockN;
    std::fill(ci, ci + kBlockN, 0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const float x = a[i * dim + d];
      const float* __restrict b = bt + d * kBlockN;
      for (int64_t j = 0; j < kBlockN; ++j) ci[j] += x * b[j];
    }
  }
}

// C (rows, dim; row stride ldc) += P X, with P[r, k] at p[r * pr + k * pk] (rows, inner) and X
// (inner, dim) row-major: P V and dS K (pr = kBlockN, pk = 1), P^T dO and dS^T Q (pr = 1,
// pk = kBlockN). A row of C is summed kChunk columns at a time, which stay in registers.
JAXFLASH_SIMD_CLONES void add_product(float* __restrict c, int64_t ldc, const float* __restrict p,
                                      int64_t pr, int64_t pk, int64_t rows, int64_t inner,
                                      const float* __restrict x, int64_t dim) {
  constexpr int64_t kChunk = 32;
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict cr = c + r * ldc;
    const float* __restrict pp = p + r * pr;
    int64_t d0 = 0;
    for (; d0 + kChunk <= dim; d0 += kChunk) {
      float acc[kChunk];
      for (int64_t e = 0; e < kChunk; ++e) acc[e] = cr[d0 + e];
      for (int64_t k = 0; k < inner; ++k) {
        const float w = pp[k * pk];
        const float* __restrict xk = x + k * dim + d0;
        for (int64_t e = 0; e < kChunk; ++e) acc[e] += w * xk[e];
      }
      for (int64_t e = 0; e < kChunk; ++e) cr[d0 + e] = acc[e];
    }
    for (int64_t k = 0; d0 < dim && k < inner; ++k) {  // the columns past the last whole chunk
      const float w = pp[k * pk];
      for (int64_t d = d0; d < dim; ++d) cr[d] += w * x[k * dim + d];
    }
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

// The dropout hash: the same 32-bit finaliser as jaxflash/reference.py `_mix`.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0xd35a2d97u;
  return x ^ (x >> 15);
}

// The variant rules seen from one (batch b, query head n): visibility, the logit transform,
// dropout, and the tile ranges that skip masked work.
template <typename T>
struct Head {
  const FwdParams& p;
  int64_t q_len, kv_len;  // valid query rows and keys, in [0, T] and [0, S]
  int64_t shift;          // key position of query 0 (causal alignment)
  float slope = 0.f;
  const int32_t* qseg = nullptr;   // (T)
  const int32_t* kvseg = nullptr;  // (S)
  const uint8_t* mask = nullptr;   // at (b, n); rows/cols via mask_strides
  const T* bias = nullptr;         // at (b, n); rows/cols via bias_strides
  uint32_t drop_head = 0;          // dropout hash of (seeds[b], n)
  float keep_scale = 1.f;          // 1 / (1 - dropout_rate)

  Head(const FwdParams& p_, int64_t b, int64_t n) : p(p_) {
    const int64_t q_raw = p.q_lengths ? p.q_lengths[b] : p.t;
    const int64_t kv_raw = p.kv_lengths ? p.kv_lengths[b] : p.s;
    q_len = std::clamp<int64_t>(q_raw, 0, p.t);
    kv_len = std::clamp<int64_t>(kv_raw, 0, p.s);
    shift = p.bottom_right ? kv_raw - q_raw : 0;
    if (p.mask) {
      const BcastStrides& st = p.mask_strides;
      mask = p.mask + st.batch_at(b, p.batch_inner) + n * st.head;
    }
    if (p.bias) {
      const BcastStrides& st = p.bias_strides;
      bias = static_cast<const T*>(p.bias) + st.batch_at(b, p.batch_inner) + n * st.head;
    }
    if (p.alibi_slopes) slope = p.alibi_slopes[b * p.n + n];
    if (p.q_segment_ids) {
      qseg = p.q_segment_ids + b * p.t;
      kvseg = p.kv_segment_ids + b * p.s;
    }
    if (p.dropout_seeds) {
      const uint32_t* seed = p.dropout_seeds + 2 * b;
      drop_head = mix32(uint32_t(n) ^ mix32(seed[0] ^ mix32(seed[1])));
      keep_scale = 1.f / (1.f - p.dropout_rate);
    }
  }

  // Row t's logits over keys n0 .. n0 + cols - 1, in place: q.k in; scale, soft cap, + bias,
  // - alibi out, -inf where hidden. With dcap, dcap[j] = d logit / d (scale q.k). The lengths
  // and the band bound the row's keys (key_range of the one row); each variant then runs as a
  // pass of its own over them (the plain pass vectorises), and segment ids and the mask are
  // tested per key.
  void row_logits(float* s, int64_t t, int64_t n0, int64_t cols, float* dcap) const {
    int64_t lo = 0, hi = 0;
    key_range(t, 1, lo, hi);
    const int64_t j0 = std::clamp<int64_t>(lo - n0, 0, cols);
    const int64_t j1 = std::clamp<int64_t>(hi - n0, j0, cols);
    std::fill(s, s + j0, kNegInf);
    std::fill(s + j1, s + cols, kNegInf);
    const float scale = p.scale;
    for (int64_t j = j0; j < j1; ++j) s[j] *= scale;
    if (p.softcap > 0.f) {
      const float cap = p.softcap;
      for (int64_t j = j0; j < j1; ++j) {
        const float th = std::tanh(s[j] / cap);
        s[j] = cap * th;
        if (dcap) dcap[j] = 1.f - th * th;
      }
    } else if (dcap) {
      std::fill(dcap + j0, dcap + j1, 1.f);
    }
    if (bias) {
      const T* row = bias + t * p.bias_strides.row;
      const int64_t cs = p.bias_strides.col;
      for (int64_t j = j0; j < j1; ++j) s[j] += to_float(row[(n0 + j) * cs]);
    }
    if (p.alibi_slopes)
      for (int64_t j = j0; j < j1; ++j) s[j] -= slope * float(std::abs(n0 + j - (t + shift)));
    if (qseg)
      for (int64_t j = j0; j < j1; ++j)
        if (qseg[t] != kvseg[n0 + j]) s[j] = kNegInf;
    if (mask) {
      const uint8_t* row = mask + t * p.mask_strides.row;
      const int64_t cs = p.mask_strides.col;
      for (int64_t j = j0; j < j1; ++j)
        if (!row[(n0 + j) * cs]) s[j] = kNegInf;
    }
  }

  uint32_t drop_row(int64_t t) const { return mix32(uint32_t(t) ^ drop_head); }
  // Multiplier of p[t, s] after dropout: 0 or 1 / (1 - rate); 1 without dropout.
  float keep(uint32_t row_hash, int64_t s) const {
    if (!p.dropout_seeds) return 1.f;
    return mix32(uint32_t(s) ^ row_hash) >= p.dropout_threshold ? keep_scale : 0.f;
  }

  // Keys [lo, hi) that rows [m0, m0 + rows) can see through causal/window/lengths.
  bool key_range(int64_t m0, int64_t rows, int64_t& lo, int64_t& hi) const {
    const int64_t last = std::min(m0 + rows, q_len) - 1;
    if (last < m0) return false;
    lo = 0;
    hi = kv_len;
    if (p.is_causal) hi = std::min(hi, last + shift + 1);
    if (p.window_right >= 0) hi = std::min(hi, last + shift + p.window_right + 1);
    if (p.window_left >= 0) lo = std::max(lo, m0 + shift - p.window_left);
    return lo < hi;
  }

  // Queries [lo, hi) that can see some key in [n0, n0 + cols).
  bool query_range(int64_t n0, int64_t cols, int64_t& lo, int64_t& hi) const {
    const int64_t last = std::min(n0 + cols, kv_len) - 1;
    if (last < n0) return false;
    lo = 0;
    hi = q_len;
    if (p.is_causal) lo = std::max(lo, n0 - shift);
    if (p.window_right >= 0) lo = std::max(lo, n0 - shift - p.window_right);
    if (p.window_left >= 0) hi = std::min(hi, last - shift + p.window_left + 1);
    return lo < hi;
  }

  // False when segment ids or the mask hide the whole (rows x cols) tile.
  bool tile_live(int64_t m0, int64_t rows, int64_t n0, int64_t cols) const {
    if (qseg) {  // disjoint id ranges cannot share an id
      const auto [qmin, qmax] = std::minmax_element(qseg + m0, qseg + m0 + rows);
      const auto [kmin, kmax] = std::minmax_element(kvseg + n0, kvseg + n0 + cols);
      if (*qmax < *kmin || *kmax < *qmin) return false;
    }
    if (mask) {
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          if (mask[(m0 + i) * p.mask_strides.row + (n0 + j) * p.mask_strides.col]) return true;
      return false;
    }
    return true;
  }
};

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
    float* o_f32 = p.o_f32 ? p.o_f32 + b * p.o_batch_stride + n * p.o_head_stride : nullptr;
    float* lse = p.lse + (b * p.n + n) * p.t;
    const Head<T> hd(p, b, n);

    std::vector<float> sQ(rows * H), sKT(H * kBlockN), sV(kBlockN * Hv), sS(rows * kBlockN);
    std::vector<float> acc(rows * Hv, 0.f), m(rows, kNegInf), l(rows, 0.f);
    load_tile(q, p.q_row_stride, m0, rows, H, sQ.data());  // (rows, H)

    int64_t lo = 0, hi = 0;
    hd.key_range(m0, rows, lo, hi);
    for (int64_t n0 = lo; n0 < hi; n0 += kBlockN) {
      const int64_t cols = std::min(kBlockN, hi - n0);
      if (!hd.tile_live(m0, rows, n0, cols)) continue;
      load_tile(k, p.k_row_stride, n0, cols, H, sKT.data(), true);  // (H, kBlockN)
      load_tile(v, p.v_row_stride, n0, cols, Hv, sV.data());        // (cols, Hv)
      tile_dots(sQ.data(), rows, H, sKT.data(), sS.data());         // Q K^T: (rows, kBlockN)
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = m0 + i;
        // S = logits of row i, masked entries at -inf
        float* s_i = &sS[i * kBlockN];
        hd.row_logits(s_i, t, n0, cols, nullptr);
        float row_max = m[i];
        bool nan = false;
        for (int64_t j = 0; j < cols; ++j) {
          row_max = std::max(row_max, s_i[j]);
          nan |= std::isnan(s_i[j]);
        }
        if (nan) row_max = std::numeric_limits<float>::quiet_NaN();
        if (row_max == kNegInf) {  // nothing visible yet in this row
          std::fill(s_i, s_i + cols, 0.f);
          continue;
        }
        // online softmax: rescale the running sum and accumulator to the new max
        const float correction = std::exp(m[i] - row_max);
        l[i] *= correction;
        float* a = &acc[i * Hv];
        for (int64_t d = 0; d < Hv; ++d) a[d] *= correction;
        const uint32_t row_hash = hd.drop_row(t);
        for (int64_t j = 0; j < cols; ++j) {  // S -> P after dropout
          const float pj = std::exp(s_i[j] - row_max);
          l[i] += pj;  // lse and the normaliser ignore dropout
          s_i[j] = pj * hd.keep(row_hash, n0 + j);
        }
        m[i] = row_max;
      }
      add_product(acc.data(), Hv, sS.data(), kBlockN, 1, rows, cols, sV.data(), Hv);  // O += P V
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      T* dst = o + (m0 + i) * p.o_row_stride;
      for (int64_t d = 0; d < Hv; ++d) from_float(acc[i * Hv + d] * inv, dst[d]);
      float* dst_f32 = o_f32 ? o_f32 + (m0 + i) * p.o_row_stride : nullptr;
      for (int64_t d = 0; dst_f32 && d < Hv; ++d) dst_f32[d] = acc[i * Hv + d] * inv;
      lse[m0 + i] = l[i] > 0.f ? m[i] + std::log(l[i]) : (std::isnan(l[i]) ? l[i] : kNegInf);
    }
  });
}

// One (rows x cols) tile of the backward: Pd = dropped probabilities (for dV), dS = dL/dlogits
// (for dbias and dalibi), dR = dL/d(q.k) (for dQ and dK). All (rows, kBlockN). K and V come
// transposed (load_tile, transposed).
template <typename T>
void grad_tile(const Head<T>& hd, const float* lse, const float* delta, int64_t m0, int64_t rows,
               int64_t n0, int64_t cols, const float* sQ, const float* sKT, const float* sVT,
               const float* sdO, int64_t H, int64_t Hv, float* Pd, float* dS, float* dR) {
  tile_dots(sQ, rows, H, sKT, Pd);    // q.k, turned into Pd below
  tile_dots(sdO, rows, Hv, sVT, dR);  // dP before dropout, turned into dR below
  float dcap[kBlockN];
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = m0 + i;
    const float li = lse[t];
    const uint32_t row_hash = hd.drop_row(t);
    float* s_i = Pd + i * kBlockN;
    hd.row_logits(s_i, t, n0, cols, dcap);
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = i * kBlockN + j;
      if (li == kNegInf || s_i[j] == kNegInf) {  // hidden, or a row that sees nothing
        Pd[e] = dS[e] = dR[e] = 0.f;
        continue;
      }
      // P = exp(logit - lse): the forward's probabilities, recomputed
      const float pij = std::exp(s_i[j] - li);
      // dP = (dO V^T) * keep ; dS = P * (dP - delta)
      const float keep = hd.keep(row_hash, n0 + j), dp = dR[e];
      Pd[e] = pij * keep;
      dS[e] = pij * (dp * keep - delta[t]);
      dR[e] = dS[e] * dcap[j] * hd.p.scale;
    }
  }
}

// dbias = dS summed over the bias's broadcast dims. A pass of its own, recomputing P and dS, so
// that each job owns a disjoint slab of dbias: no races and a fixed summation order.
template <typename T>
void dbias_typed(const BwdParams& p) {
  const BcastStrides& st = p.bias_strides;
  const int64_t G = p.group(), H = p.h, Hv = p.hv;
  // sizes of the bias dims: full or 1 (a 0 stride marks a broadcast dim)
  const int64_t nb = st.batch ? p.batch_inner : 1, nn = st.head ? p.n : 1;
  const int64_t nt = st.row ? p.t : 1, ns = st.col ? p.s : 1;
  const int64_t outer = p.b / p.batch_inner;
  const int64_t t_tiles = nt > 1 ? (p.t + kBlockM - 1) / kBlockM : 1;
  parallel_for(outer * nb * nn * t_tiles, [&](int64_t job) {
    const int64_t mt = job % t_tiles, hn = (job / t_tiles) % nn;
    const int64_t hb = (job / (t_tiles * nn)) % nb, ov = job / (t_tiles * nn * nb);
    // query rows of this slab: one tile of T, or all of T when the bias broadcasts over T
    const int64_t t0 = nt > 1 ? mt * kBlockM : 0;
    const int64_t t1 = nt > 1 ? std::min(p.t, t0 + kBlockM) : p.t;
    std::vector<float> acc((nt > 1 ? t1 - t0 : 1) * ns, 0.f);  // (rows of dbias, S|1)
    std::vector<float> sKT(H * kBlockN), sVT(Hv * kBlockN), sQ(kBlockM * H), sdO(kBlockM * Hv),
        Pd(kBlockM * kBlockN), dS(kBlockM * kBlockN), dR(kBlockM * kBlockN);
    const int64_t b_begin = nb > 1 ? hb : 0, b_end = nb > 1 ? hb + 1 : p.batch_inner;
    const int64_t n_begin = nn > 1 ? hn : 0, n_end = nn > 1 ? hn + 1 : p.n;
    for (int64_t bi = b_begin; bi < b_end; ++bi) {
      const int64_t b = ov * p.batch_inner + bi;
      for (int64_t n = n_begin; n < n_end; ++n) {
        const Head<T> hd(p, b, n);
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
        const T* dout =
            static_cast<const T*>(p.dout) + b * p.do_batch_stride + n * p.do_head_stride;
        const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + (n / G) * p.k_head_stride;
        const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + (n / G) * p.v_head_stride;
        const float* lse = p.lse + (b * p.n + n) * p.t;
        const float* delta = p.delta + (b * p.n + n) * p.t;
        for (int64_t m0 = t0; m0 < t1; m0 += kBlockM) {
          const int64_t rows = std::min(kBlockM, t1 - m0);
          int64_t lo = 0, hi = 0;
          if (!hd.key_range(m0, rows, lo, hi)) continue;
          load_tile(q, p.q_row_stride, m0, rows, H, sQ.data());
          load_tile(dout, p.do_row_stride, m0, rows, Hv, sdO.data());
          for (int64_t n0 = lo; n0 < hi; n0 += kBlockN) {
            const int64_t cols = std::min(kBlockN, hi - n0);
            if (!hd.tile_live(m0, rows, n0, cols)) continue;
            load_tile(k, p.k_row_stride, n0, cols, H, sKT.data(), true);
            load_tile(v, p.v_row_stride, n0, cols, Hv, sVT.data(), true);
            grad_tile(hd, lse, delta, m0, rows, n0, cols, sQ.data(), sKT.data(), sVT.data(),
                      sdO.data(), H, Hv, Pd.data(), dS.data(), dR.data());
            for (int64_t i = 0; i < rows; ++i) {
              float* a = &acc[(nt > 1 ? m0 + i - t0 : 0) * ns];
              for (int64_t j = 0; j < cols; ++j) a[ns > 1 ? n0 + j : 0] += dS[i * kBlockN + j];
            }
          }
        }
      }
    }
    T* dst = static_cast<T*>(p.dbias) + ov * st.outer + hb * st.batch + hn * st.head + t0 * st.row;
    const int64_t acc_rows = nt > 1 ? t1 - t0 : 1;
    for (int64_t r = 0; r < acc_rows; ++r)
      for (int64_t c = 0; c < ns; ++c) from_float(acc[r * ns + c], dst[r * st.row + c * st.col]);
  });
}

// TG: the gradients' type, T or float (params.h grads_f32).
template <typename T, typename TG>
void bwd_typed(const BwdParams& p) {
  const int64_t G = p.group(), H = p.h, Hv = p.hv;
  const auto q_at = [&](int64_t b, int64_t n) {
    return static_cast<const T*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
  };
  const auto do_at = [&](int64_t b, int64_t n) {
    return static_cast<const T*>(p.dout) + b * p.do_batch_stride + n * p.do_head_stride;
  };

  // delta = rowsum(dO * O) - dlse, the softmax-Jacobian term shared by every key; O in fp32
  // from the forward when given (params.h o_f32), else as stored.
  parallel_for(p.b * p.n, [&](int64_t bn) {
    const int64_t b = bn / p.n, n = bn % p.n;
    const int64_t o_at = b * p.o_batch_stride + n * p.o_head_stride;
    const T* o = static_cast<const T*>(p.o) + o_at;
    const T* dout = do_at(b, n);
    for (int64_t t = 0; t < p.t; ++t) {
      float acc = 0.f;
      for (int64_t d = 0; d < Hv; ++d) {
        const int64_t e = t * p.o_row_stride + d;
        acc += (p.o_f32 ? p.o_f32[o_at + e] : to_float(o[e])) *
               to_float(dout[t * p.do_row_stride + d]);
      }
      p.delta[bn * p.t + t] = acc - (p.dlse ? p.dlse[bn * p.t + t] : 0.f);
    }
  });
  std::fill(p.dq_accum, p.dq_accum + p.b * p.t * p.n * H, 0.f);

  // K/V-stationary: each job owns one (batch, kv head), so dK/dV/dQ/dalibi writes never
  // collide and every sum runs in a fixed order (deterministic).
  parallel_for(p.b * p.kh, [&](int64_t job) {
    const int64_t b = job / p.kh, kh = job % p.kh;
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + kh * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + kh * p.v_head_stride;
    TG* dk = static_cast<TG*>(p.dk) + b * p.dk_batch_stride + kh * p.dk_head_stride;
    TG* dv = static_cast<TG*>(p.dv) + b * p.dv_batch_stride + kh * p.dv_head_stride;
    // K row-major for dQ += dS K, K and V transposed for the tiles' dots
    std::vector<float> sK(kBlockN * H), sKT(H * kBlockN), sVT(Hv * kBlockN), dK(kBlockN * H),
        dV(kBlockN * Hv);
    std::vector<float> sQ(kBlockM * H), sdO(kBlockM * Hv), Pd(kBlockM * kBlockN),
        dS(kBlockM * kBlockN), dR(kBlockM * kBlockN), dslope(G, 0.f);
    std::vector<Head<T>> heads;
    for (int64_t n = kh * G; n < (kh + 1) * G; ++n) heads.emplace_back(p, b, n);

    for (int64_t n0 = 0; n0 < p.s; n0 += kBlockN) {
      const int64_t cols = std::min(kBlockN, p.s - n0);
      load_tile(k, p.k_row_stride, n0, cols, H, sK.data());
      load_tile(k, p.k_row_stride, n0, cols, H, sKT.data(), true);
      load_tile(v, p.v_row_stride, n0, cols, Hv, sVT.data(), true);
      std::fill(dK.begin(), dK.end(), 0.f);
      std::fill(dV.begin(), dV.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t n = kh * G + g;
        const Head<T>& hd = heads[g];
        const float* lse = p.lse + (b * p.n + n) * p.t;
        const float* delta = p.delta + (b * p.n + n) * p.t;
        float* dq = p.dq_accum + b * p.t * p.n * H + n * H;  // fp32 (T, N, H) slice
        int64_t lo = 0, hi = 0;
        if (!hd.query_range(n0, cols, lo, hi)) continue;  // no query sees this key tile
        for (int64_t m0 = lo; m0 < hi; m0 += kBlockM) {
          const int64_t rows = std::min(kBlockM, hi - m0);
          if (!hd.tile_live(m0, rows, n0, cols)) continue;
          load_tile(q_at(b, n), p.q_row_stride, m0, rows, H, sQ.data());
          load_tile(do_at(b, n), p.do_row_stride, m0, rows, Hv, sdO.data());
          grad_tile(hd, lse, delta, m0, rows, n0, cols, sQ.data(), sKT.data(), sVT.data(),
                    sdO.data(), H, Hv, Pd.data(), dS.data(), dR.data());
          add_product(dV.data(), Hv, Pd.data(), 1, kBlockN, cols, rows, sdO.data(), Hv);  // P^T dO
          add_product(dK.data(), H, dR.data(), 1, kBlockN, cols, rows, sQ.data(), H);    // dS^T Q
          add_product(dq + m0 * p.n * H, p.n * H, dR.data(), kBlockN, 1, rows, cols, sK.data(),
                      H);  // dQ += dS K
          if (p.dalibi)  // d logit / d slope = -|s - (t + shift)|
            for (int64_t i = 0; i < rows; ++i)
              for (int64_t j = 0; j < cols; ++j)
                dslope[g] -= dS[i * kBlockN + j] * float(std::abs(n0 + j - (m0 + i + hd.shift)));
        }
      }
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t d = 0; d < H; ++d) from_float(dK[j * H + d], dk[(n0 + j) * p.dk_row_stride + d]);
        for (int64_t d = 0; d < Hv; ++d) from_float(dV[j * Hv + d], dv[(n0 + j) * p.dv_row_stride + d]);
      }
    }
    if (p.dalibi)
      for (int64_t g = 0; g < G; ++g) p.dalibi[b * p.n + kh * G + g] = dslope[g];
  });

  parallel_for(p.b * p.t, [&](int64_t bt) {
    const int64_t b = bt / p.t, t = bt % p.t;
    TG* dq = static_cast<TG*>(p.dq) + b * p.dq_batch_stride + t * p.dq_row_stride;
    const float* acc = p.dq_accum + bt * p.n * H;
    for (int64_t n = 0; n < p.n; ++n)
      for (int64_t d = 0; d < H; ++d) from_float(acc[n * H + d], dq[n * p.dq_head_stride + d]);
  });

  if (p.dbias) dbias_typed<T>(p);
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
template <typename T> struct Bwd {
  static void run(const BwdParams& p) { p.grads_f32 ? bwd_typed<T, float>(p) : bwd_typed<T, T>(p); }
};

}  // namespace

void run_fwd(const FwdParams& p) { dispatch_dtype<Fwd>(p); }
void run_bwd(const BwdParams& p) { dispatch_dtype<Bwd>(p); }

}  // namespace jaxflash::cpu
