// CPU FFI handlers: decode buffers -> params -> cpu kernels.
// Both take every variant operand (see VariantArgs in ffi_params.h); `has_*` attrs mark the
// live ones, the others are zero-element placeholders.
#include <vector>

#include "cpu/attention_cpu.h"
#include "ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

static ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                         ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                         ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer dropout_seeds,
                         ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                         float scale, bool is_causal, bool has_bias, bool has_mask,
                         bool has_q_lengths, bool has_kv_lengths, bool has_segment_ids,
                         bool has_alibi, int64_t window_left, int64_t window_right,
                         bool bottom_right, float softcap, float dropout_rate) {
  FwdParams p{};
  if (auto e = make_fwd_params(q, k, v, *o, *lse, scale, is_causal, p); e.failure()) return e;
  const VariantArgs args{bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                         alibi_slopes, dropout_seeds};
  const VariantAttrs attrs{has_bias, has_mask, has_q_lengths, has_kv_lengths, has_segment_ids,
                           has_alibi, window_left, window_right, bottom_right, softcap,
                           dropout_rate};
  if (auto e = add_variants(q, args, attrs, p); e.failure()) return e;
  cpu::run_fwd(p);
  return ffi::Error::Success();
}

static ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                         ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                         ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths,
                         ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                         ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer alibi_slopes,
                         ffi::AnyBuffer dropout_seeds, ffi::Result<ffi::AnyBuffer> dq,
                         ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                         ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dalibi,
                         float scale, bool is_causal, bool has_bias, bool has_mask,
                         bool has_q_lengths, bool has_kv_lengths, bool has_segment_ids,
                         bool has_alibi, int64_t window_left, int64_t window_right,
                         bool bottom_right, float softcap, float dropout_rate,
                         bool deterministic) {
  BwdParams p{};
  if (auto e = make_bwd_params(q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal, p);
      e.failure())
    return e;
  const VariantArgs args{bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                         alibi_slopes, dropout_seeds};
  const VariantAttrs attrs{has_bias, has_mask, has_q_lengths, has_kv_lengths, has_segment_ids,
                           has_alibi, window_left, window_right, bottom_right, softcap,
                           dropout_rate};
  if (auto e = add_variants(q, args, attrs, p); e.failure()) return e;
  if (auto e = add_variant_grads(args, attrs, *dbias, *dalibi, deterministic, p); e.failure())
    return e;
  std::vector<float> delta(p.b * p.n * p.t), dq_accum(p.b * p.t * p.n * p.h);
  p.delta = delta.data();
  p.dq_accum = dq_accum.data();
  cpu::run_bwd(p);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_fwd_cpu, FwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // q_lengths
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths
                                  .Arg<ffi::AnyBuffer>()  // q_segment_ids
                                  .Arg<ffi::AnyBuffer>()  // kv_segment_ids
                                  .Arg<ffi::AnyBuffer>()  // alibi_slopes
                                  .Arg<ffi::AnyBuffer>()  // dropout_seeds
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_mask")
                                  .Attr<bool>("has_q_lengths")
                                  .Attr<bool>("has_kv_lengths")
                                  .Attr<bool>("has_segment_ids")
                                  .Attr<bool>("has_alibi")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("bottom_right")
                                  .Attr<float>("softcap")
                                  .Attr<float>("dropout_rate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_bwd_cpu, BwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // o
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // q_lengths
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths
                                  .Arg<ffi::AnyBuffer>()  // q_segment_ids
                                  .Arg<ffi::AnyBuffer>()  // kv_segment_ids
                                  .Arg<ffi::AnyBuffer>()  // alibi_slopes
                                  .Arg<ffi::AnyBuffer>()  // dropout_seeds
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // dalibi
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_mask")
                                  .Attr<bool>("has_q_lengths")
                                  .Attr<bool>("has_kv_lengths")
                                  .Attr<bool>("has_segment_ids")
                                  .Attr<bool>("has_alibi")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<bool>("bottom_right")
                                  .Attr<float>("softcap")
                                  .Attr<float>("dropout_rate")
                                  .Attr<bool>("deterministic"));

}  // namespace jaxflash
