// Decoding of XLA FFI buffers into FwdParams/BwdParams, with validation shared by the CPU and
// CUDA handlers. Anything malformed becomes an ffi::Error, never an abort.
#pragma once

#include <cstdint>
#include <string>

#include "params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

namespace ffi = xla::ffi;

// Leading dims of (..., L, heads, dim): batch (possibly several vmapped dims) flattened.
struct Shape4 {
  int64_t b = 1, l = 0, heads = 0, dim = 0;
};

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string out = "(";
  for (size_t i = 0; i < d.size(); ++i) out += (i ? ", " : "") + std::to_string(d[i]);
  return out + ")";
}

inline ffi::Error shape4(const char* name, ffi::AnyBuffer::Dimensions d, Shape4& out) {
  if (d.size() < 4)
    return ffi::Error::InvalidArgument(std::string("jaxflash: ") + name +
                                       " must have rank >= 4 (..., L, heads, dim), got " +
                                       dims_str(d));
  const size_t r = d.size();
  out.b = 1;
  for (size_t i = 0; i + 3 < r; ++i) out.b *= d[i];
  out.l = d[r - 3];
  out.heads = d[r - 2];
  out.dim = d[r - 1];
  return ffi::Error::Success();
}

inline bool to_dtype(ffi::DataType t, DType& out) {
  switch (t) {
    case ffi::DataType::F32: out = DType::kF32; return true;
    case ffi::DataType::F16: out = DType::kF16; return true;
    case ffi::DataType::BF16: out = DType::kBF16; return true;
    default: return false;
  }
}

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jaxflash: " + msg);
}

// Contiguous (B, L, heads, dim) strides.
inline void set_strides(const Shape4& s, int64_t& batch, int64_t& row, int64_t& head) {
  head = s.dim;
  row = s.heads * s.dim;
  batch = s.l * row;
}

inline bool same(const Shape4& a, const Shape4& b) {
  return a.b == b.b && a.l == b.l && a.heads == b.heads && a.dim == b.dim;
}

inline ffi::Error make_fwd_params(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::AnyBuffer o, ffi::AnyBuffer lse, float scale,
                                  bool is_causal, FwdParams& p) {
  Shape4 sq, sk, sv, so;
  if (auto e = shape4("q", q.dimensions(), sq); e.failure()) return e;
  if (auto e = shape4("k", k.dimensions(), sk); e.failure()) return e;
  if (auto e = shape4("v", v.dimensions(), sv); e.failure()) return e;
  if (auto e = shape4("o", o.dimensions(), so); e.failure()) return e;
  if (!to_dtype(q.element_type(), p.dtype))
    return invalid("q dtype must be float32, float16 or bfloat16");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      o.element_type() != q.element_type())
    return invalid("q, k, v and o must share one dtype");
  if (lse.element_type() != ffi::DataType::F32) return invalid("lse must be float32");
  if (sk.b != sq.b || sv.b != sq.b) return invalid("q, k, v leading (batch) dims differ");
  if (sv.l != sk.l || sv.heads != sk.heads)
    return invalid("k " + dims_str(k.dimensions()) + " and v " + dims_str(v.dimensions()) +
                   " differ in length or heads");
  if (sk.dim != sq.dim) return invalid("q and k head dims differ");
  if (sk.heads <= 0 || sq.heads % sk.heads != 0)
    return invalid("query heads " + std::to_string(sq.heads) +
                   " must be a multiple of key/value heads " + std::to_string(sk.heads));
  if (so.b != sq.b || so.l != sq.l || so.heads != sq.heads || so.dim != sv.dim)
    return invalid("o has shape " + dims_str(o.dimensions()) + ", expected q's with v's head dim");
  auto ld = lse.dimensions();
  if (ld.size() != q.dimensions().size() - 1 || ld[ld.size() - 2] != sq.heads ||
      ld[ld.size() - 1] != sq.l || static_cast<int64_t>(lse.element_count()) != sq.b * sq.heads * sq.l)
    return invalid("lse has shape " + dims_str(ld) + ", expected (..., N, T)");

  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o.untyped_data();
  p.lse = static_cast<float*>(lse.untyped_data());
  set_strides(sq, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set_strides(sk, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set_strides(sv, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  set_strides(so, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.b = sq.b;
  p.t = sq.l;
  p.s = sk.l;
  p.n = sq.heads;
  p.kh = sk.heads;
  p.h = sq.dim;
  p.hv = sv.dim;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.is_causal = is_causal;
  return ffi::Error::Success();
}

inline ffi::Error make_bwd_params(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                                  ffi::AnyBuffer dlse, ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                                  ffi::AnyBuffer dv, float scale, bool is_causal, BwdParams& p) {
  if (auto e = make_fwd_params(q, k, v, o, lse, scale, is_causal, p); e.failure()) return e;
  Shape4 sq, sk, sv, so, sdo, sdq, sdk, sdv;
  shape4("q", q.dimensions(), sq);
  shape4("k", k.dimensions(), sk);
  shape4("v", v.dimensions(), sv);
  shape4("o", o.dimensions(), so);
  if (auto e = shape4("dout", dout.dimensions(), sdo); e.failure()) return e;
  if (auto e = shape4("dq", dq.dimensions(), sdq); e.failure()) return e;
  if (auto e = shape4("dk", dk.dimensions(), sdk); e.failure()) return e;
  if (auto e = shape4("dv", dv.dimensions(), sdv); e.failure()) return e;
  if (!same(sdo, so) || !same(sdq, sq) || !same(sdk, sk) || !same(sdv, sv))
    return invalid("dout/dq/dk/dv shapes must match o/q/k/v");
  for (auto t : {dout.element_type(), dq.element_type(), dk.element_type(), dv.element_type()})
    if (t != q.element_type()) return invalid("dout, dq, dk, dv must have q's dtype");
  if (dlse.element_type() != ffi::DataType::F32 || dlse.element_count() != lse.element_count())
    return invalid("dlse must be float32 with lse's shape");

  p.dout = dout.untyped_data();
  p.dlse = static_cast<const float*>(dlse.untyped_data());
  p.dq = dq.untyped_data();
  p.dk = dk.untyped_data();
  p.dv = dv.untyped_data();
  p.delta = nullptr;
  p.dq_accum = nullptr;
  set_strides(sdo, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  set_strides(sdq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  set_strides(sdk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  set_strides(sdv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  return ffi::Error::Success();
}

}  // namespace jaxflash
