// Decoding of XLA FFI buffers into FwdParams/BwdParams, with validation shared by the CPU and
// CUDA handlers. Anything malformed becomes an ffi::Error, never an abort.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

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
  p.batch_inner = q.dimensions()[q.dimensions().size() - 4];
  return ffi::Error::Success();
}

// The optional operands of the variant-aware handlers, in binding order. The `has_*` attrs
// say which are live; a dead one is a zero-element placeholder (its shape is not read).
struct VariantArgs {
  ffi::AnyBuffer bias;            // (..., B|1, N|1, T|1, S|1), dtype of q
  ffi::AnyBuffer mask;            // (..., B|1, N|1, T|1, S|1) bool
  ffi::AnyBuffer q_lengths;       // (..., B) int32
  ffi::AnyBuffer kv_lengths;      // (..., B) int32
  ffi::AnyBuffer q_segment_ids;   // (..., B, T) int32
  ffi::AnyBuffer kv_segment_ids;  // (..., B, S) int32
  ffi::AnyBuffer alibi_slopes;    // (..., B, N) float32
  ffi::AnyBuffer dropout_seeds;   // (..., B, 2) uint32; live when dropout_rate > 0
};

// Every attribute of a jaxflash call, decoded as one struct (`.Attrs<CallAttrs>()`); the
// Python side (_calls.py) always passes all of them. `has_*` say which variant operands are
// live; a dead one is a zero-element placeholder (its shape is not read).
struct CallAttrs {
  float scale;
  bool is_causal;
  bool has_bias, has_mask, has_q_lengths, has_kv_lengths, has_segment_ids, has_alibi;
  int64_t window_left, window_right;  // -1: unbounded
  bool bottom_right;
  float softcap;       // 0: off
  float dropout_rate;  // 0: off
  bool deterministic;  // backward: bit-identical across runs (the forward always is)
  bool has_o_f32;      // forward: also returns o_f32; backward: its o_f32 operand is live
};

// The variant operands follow the fixed ones (`.RemainingArgs()`), in VariantArgs order.
inline ffi::Error variant_args(ffi::RemainingArgs rest, std::optional<VariantArgs>& out) {
  constexpr size_t kCount = 8;
  if (rest.size() != kCount)
    return invalid("expected " + std::to_string(kCount) + " variant operands, got " +
                   std::to_string(rest.size()));
  for (size_t i = 0; i < kCount; ++i)
    if (auto b = rest.get<ffi::AnyBuffer>(i); b.has_error()) return b.error();
  auto at = [&](size_t i) { return *rest.get<ffi::AnyBuffer>(i); };
  out.emplace(VariantArgs{at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7)});
  return ffi::Error::Success();
}

// Checks a broadcast (..., B|1, N|1, T|1, S|1) operand against q's leading dims and the
// full (B, N, T, S), and returns its element strides (0 on broadcast dims).
inline ffi::Error bcast_strides(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer q,
                                const FwdParams& p, BcastStrides& st) {
  auto d = x.dimensions();
  auto qd = q.dimensions();
  const size_t r = qd.size();
  const int64_t full[4] = {p.batch_inner, p.n, p.t, p.s};
  bool ok = d.size() == r;
  for (size_t i = 0; ok && i + 4 < r; ++i) ok = d[i] == qd[i];
  for (size_t i = 0; ok && i < 4; ++i) ok = d[r - 4 + i] == 1 || d[r - 4 + i] == full[i];
  if (!ok)
    return invalid(std::string(name) + " has shape " + dims_str(d) +
                   ", expected q's leading dims then (B|1, N|1, T|1, S|1) with (B, N, T, S) = (" +
                   std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " +
                   std::to_string(full[2]) + ", " + std::to_string(full[3]) + ")");
  const int64_t db = d[r - 4], dn = d[r - 3], dt = d[r - 2], ds = d[r - 1];
  st.col = ds > 1 ? 1 : 0;
  st.row = dt > 1 ? ds : 0;
  st.head = dn > 1 ? dt * ds : 0;
  st.batch = db > 1 ? dn * dt * ds : 0;
  st.outer = db * dn * dt * ds;
  return ffi::Error::Success();
}

// A per-batch operand (..., B, last) must hold b * last elements of `type` with that last dim.
inline ffi::Error per_batch(const char* name, ffi::AnyBuffer x, ffi::DataType type,
                            const char* type_name, int64_t b, int64_t last, bool has_last) {
  auto d = x.dimensions();
  const bool ok = x.element_type() == type && static_cast<int64_t>(x.element_count()) == b * last &&
                  d.size() >= 1 && (!has_last || d[d.size() - 1] == last);
  if (!ok)
    return invalid(std::string(name) + " must be " + type_name + " with " + std::to_string(b) +
                   " x " + std::to_string(last) + " elements (batch first), got " +
                   dims_str(d));
  return ffi::Error::Success();
}

inline ffi::Error dead(const char* name, ffi::AnyBuffer x) {
  if (x.element_count() != 0)
    return invalid(std::string(name) + " is marked absent but has shape " +
                   dims_str(x.dimensions()));
  return ffi::Error::Success();
}

// Decodes the live variant operands and attrs into p (after make_fwd_params).
inline ffi::Error add_variants(ffi::AnyBuffer q, const VariantArgs& a, const CallAttrs& at,
                               FwdParams& p) {
  if (at.has_bias) {
    if (a.bias.element_type() != q.element_type()) return invalid("bias must have q's dtype");
    if (auto e = bcast_strides("bias", a.bias, q, p, p.bias_strides); e.failure()) return e;
    p.bias = a.bias.untyped_data();
  } else if (auto e = dead("bias", a.bias); e.failure()) {
    return e;
  }
  if (at.has_mask) {
    if (a.mask.element_type() != ffi::DataType::PRED) return invalid("mask must be bool");
    if (auto e = bcast_strides("mask", a.mask, q, p, p.mask_strides); e.failure()) return e;
    p.mask = static_cast<const uint8_t*>(a.mask.untyped_data());
  } else if (auto e = dead("mask", a.mask); e.failure()) {
    return e;
  }
  struct Opt {
    bool live;
    const char* name;
    ffi::AnyBuffer buf;
    ffi::DataType type;
    const char* type_name;
    int64_t last;
    bool has_last;
  };
  const Opt opts[] = {
      {at.has_q_lengths, "q_lengths", a.q_lengths, ffi::DataType::S32, "int32", 1, false},
      {at.has_kv_lengths, "kv_lengths", a.kv_lengths, ffi::DataType::S32, "int32", 1, false},
      {at.has_segment_ids, "q_segment_ids", a.q_segment_ids, ffi::DataType::S32, "int32", p.t, true},
      {at.has_segment_ids, "kv_segment_ids", a.kv_segment_ids, ffi::DataType::S32, "int32", p.s, true},
      {at.has_alibi, "alibi_slopes", a.alibi_slopes, ffi::DataType::F32, "float32", p.n, true},
      {at.dropout_rate > 0.f, "dropout_seeds", a.dropout_seeds, ffi::DataType::U32, "uint32", 2, true},
  };
  for (const Opt& o : opts) {
    auto e = o.live ? per_batch(o.name, o.buf, o.type, o.type_name, p.b, o.last, o.has_last)
                    : dead(o.name, o.buf);
    if (e.failure()) return e;
  }
  if (at.has_q_lengths) p.q_lengths = static_cast<const int32_t*>(a.q_lengths.untyped_data());
  if (at.has_kv_lengths) p.kv_lengths = static_cast<const int32_t*>(a.kv_lengths.untyped_data());
  if (at.has_segment_ids) {
    p.q_segment_ids = static_cast<const int32_t*>(a.q_segment_ids.untyped_data());
    p.kv_segment_ids = static_cast<const int32_t*>(a.kv_segment_ids.untyped_data());
  }
  if (at.has_alibi) p.alibi_slopes = static_cast<const float*>(a.alibi_slopes.untyped_data());
  if (at.window_left < -1 || at.window_right < -1)
    return invalid("window_left/window_right must be >= 0, or -1 for unbounded");
  p.window_left = at.window_left;
  p.window_right = at.window_right;
  p.bottom_right = at.bottom_right;
  if (!(at.softcap >= 0.f) || std::isinf(at.softcap))
    return invalid("softcap must be finite and >= 0 (0 = off)");
  p.softcap = at.softcap;
  if (!(at.dropout_rate >= 0.f && at.dropout_rate < 1.f))
    return invalid("dropout_rate must be in [0, 1)");
  p.dropout_rate = at.dropout_rate;
  if (at.dropout_rate > 0.f) {
    p.dropout_seeds = static_cast<const uint32_t*>(a.dropout_seeds.untyped_data());
    // floor(rate * 2^32) in double, exactly as jaxflash.reference.dropout_threshold
    const double th = std::floor(static_cast<double>(at.dropout_rate) * 4294967296.0);
    p.dropout_threshold = static_cast<uint32_t>(std::min(th, 4294967295.0));
  }
  return ffi::Error::Success();
}

// The variant outputs of the backward: dbias (bias's shape) and dalibi ((..., B, N) float32),
// zero-element placeholders when bias / alibi_slopes are absent.
inline ffi::Error add_variant_grads(const VariantArgs& a, const CallAttrs& at,
                                    ffi::AnyBuffer dbias, ffi::AnyBuffer dalibi, BwdParams& p) {
  if (at.has_bias) {
    if (dbias.element_type() != a.bias.element_type() ||
        dims_str(dbias.dimensions()) != dims_str(a.bias.dimensions()))
      return invalid("dbias must have bias's shape and dtype, got " + dims_str(dbias.dimensions()));
    p.dbias = dbias.untyped_data();
  } else if (auto e = dead("dbias", dbias); e.failure()) {
    return e;
  }
  if (at.has_alibi) {
    if (auto e = per_batch("dalibi", dalibi, ffi::DataType::F32, "float32", p.b, p.n, true);
        e.failure())
      return e;
    p.dalibi = static_cast<float*>(dalibi.untyped_data());
  } else if (auto e = dead("dalibi", dalibi); e.failure()) {
    return e;
  }
  p.deterministic = at.deterministic;
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
  if (dout.element_type() != q.element_type()) return invalid("dout must have q's dtype");
  // The gradients come in q's dtype, or all in float32 for a caller that sums them further.
  const ffi::DataType grads = dq.element_type();
  if (grads != q.element_type() && grads != ffi::DataType::F32)
    return invalid("dq, dk, dv must have q's dtype or be float32");
  if (dk.element_type() != grads || dv.element_type() != grads)
    return invalid("dq, dk, dv must share one dtype");
  // Empty where the caller's lse has no cotangent (zeros: nothing to write or read).
  if (dlse.element_type() != ffi::DataType::F32 ||
      (dlse.element_count() != lse.element_count() && dlse.element_count() != 0))
    return invalid("dlse must be float32 with lse's shape, or empty (zeros)");

  p.dout = dout.untyped_data();
  p.dlse = dlse.element_count() ? static_cast<const float*>(dlse.untyped_data()) : nullptr;
  p.grads_f32 = grads != q.element_type();
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

// The fp32 copy of O (FwdParams::o_f32): float32 with o's shape.
inline ffi::Error set_o_f32(ffi::AnyBuffer o, ffi::AnyBuffer o_f32, FwdParams& p) {
  auto d = o_f32.dimensions(), od = o.dimensions();
  if (o_f32.element_type() != ffi::DataType::F32 ||
      !std::equal(d.begin(), d.end(), od.begin(), od.end()))
    return invalid("o_f32 must be float32 with o's shape " + dims_str(od) + ", got " +
                   dims_str(d));
  p.o_f32 = static_cast<float*>(o_f32.untyped_data());
  return ffi::Error::Success();
}

// A whole forward call: the fixed operands, the variant operands and the attrs. `extra` are
// the results after o and lse: o_f32 exactly when has_o_f32.
inline ffi::Error decode_fwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::RemainingArgs variants, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                             ffi::RemainingRets extra, const CallAttrs& at, FwdParams& p) {
  std::optional<VariantArgs> args;
  if (auto e = make_fwd_params(q, k, v, o, lse, at.scale, at.is_causal, p); e.failure()) return e;
  if (auto e = variant_args(variants, args); e.failure()) return e;
  if (extra.size() != (at.has_o_f32 ? 1u : 0u))
    return invalid("expected " + std::string(at.has_o_f32 ? "one result" : "no result") +
                   " after o and lse (o_f32 when has_o_f32), got " +
                   std::to_string(extra.size()));
  if (at.has_o_f32) {
    auto o_f32 = extra.get<ffi::AnyBuffer>(0);
    if (o_f32.has_error()) return o_f32.error();
    if (auto e = set_o_f32(o, **o_f32, p); e.failure()) return e;
  }
  return add_variants(q, *args, at, p);
}

// A whole backward call; also binds the dbias/dalibi results of live bias/alibi_slopes, and
// the forward's o_f32 (a zero-element placeholder unless has_o_f32).
inline ffi::Error decode_bwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                             ffi::AnyBuffer dlse, ffi::AnyBuffer o_f32,
                             ffi::RemainingArgs variants, ffi::AnyBuffer dq,
                             ffi::AnyBuffer dk, ffi::AnyBuffer dv, ffi::AnyBuffer dbias,
                             ffi::AnyBuffer dalibi, const CallAttrs& at, BwdParams& p) {
  std::optional<VariantArgs> args;
  if (auto e = make_bwd_params(q, k, v, o, lse, dout, dlse, dq, dk, dv, at.scale, at.is_causal, p);
      e.failure())
    return e;
  if (auto e = variant_args(variants, args); e.failure()) return e;
  if (auto e = at.has_o_f32 ? set_o_f32(o, o_f32, p) : dead("o_f32", o_f32); e.failure())
    return e;
  if (auto e = add_variants(q, *args, at, p); e.failure()) return e;
  return add_variant_grads(*args, at, dbias, dalibi, p);
}

// The operands, results and attributes of the forward and backward calls, shared by the CPU
// and CUDA handlers; `b` is ffi::Ffi::Bind() with the platform's context already bound.
template <typename Binding>
auto bind_fwd(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()                 // k
      .template Arg<ffi::AnyBuffer>()                 // v
      .RemainingArgs()                                // variant operands (VariantArgs)
      .template Ret<ffi::AnyBuffer>()                 // o
      .template Ret<ffi::AnyBuffer>()                 // lse
      .RemainingRets()                                // o_f32 when has_o_f32
      .template Attrs<CallAttrs>();
}

template <typename Binding>
auto bind_bwd(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()                 // k
      .template Arg<ffi::AnyBuffer>()                 // v
      .template Arg<ffi::AnyBuffer>()                 // o
      .template Arg<ffi::AnyBuffer>()                 // lse
      .template Arg<ffi::AnyBuffer>()                 // dout
      .template Arg<ffi::AnyBuffer>()                 // dlse
      .template Arg<ffi::AnyBuffer>()                 // o_f32 (placeholder unless has_o_f32)
      .RemainingArgs()                                // variant operands (VariantArgs)
      .template Ret<ffi::AnyBuffer>()                 // dq
      .template Ret<ffi::AnyBuffer>()                 // dk
      .template Ret<ffi::AnyBuffer>()                 // dv
      .template Ret<ffi::AnyBuffer>()                 // dbias
      .template Ret<ffi::AnyBuffer>()                 // dalibi
      .template Attrs<CallAttrs>();
}

}  // namespace jaxflash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxflash::CallAttrs, xla::ffi::StructMember<float>("scale"),
    xla::ffi::StructMember<bool>("is_causal"), xla::ffi::StructMember<bool>("has_bias"),
    xla::ffi::StructMember<bool>("has_mask"), xla::ffi::StructMember<bool>("has_q_lengths"),
    xla::ffi::StructMember<bool>("has_kv_lengths"),
    xla::ffi::StructMember<bool>("has_segment_ids"), xla::ffi::StructMember<bool>("has_alibi"),
    xla::ffi::StructMember<int64_t>("window_left"),
    xla::ffi::StructMember<int64_t>("window_right"),
    xla::ffi::StructMember<bool>("bottom_right"), xla::ffi::StructMember<float>("softcap"),
    xla::ffi::StructMember<float>("dropout_rate"), xla::ffi::StructMember<bool>("deterministic"),
    xla::ffi::StructMember<bool>("has_o_f32"));
