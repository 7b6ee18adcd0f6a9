// CPU FFI handlers: decode buffers -> params -> cpu kernels. The variant operands follow q, k,
// v (forward) or q .. dlse, o_f32 (backward) as remaining args; CallAttrs says which are live.
// has_o_f32 works as on CUDA: the forward also writes O before its rounding to q's dtype (for
// float32 inputs, a copy of o) and the backward takes delta from it.
#include <vector>

#include "cpu/attention_cpu.h"
#include "ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

static ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::RemainingArgs variants, ffi::Result<ffi::AnyBuffer> o,
                         ffi::Result<ffi::AnyBuffer> lse, ffi::RemainingRets extra,
                         CallAttrs attrs) {
  FwdParams p{};
  if (auto e = decode_fwd(q, k, v, variants, *o, *lse, extra, attrs, p); e.failure()) return e;
  cpu::run_fwd(p);
  return ffi::Error::Success();
}

static ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                         ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                         ffi::AnyBuffer o_f32, ffi::RemainingArgs variants,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                         ffi::Result<ffi::AnyBuffer> dalibi, CallAttrs attrs) {
  BwdParams p{};
  if (auto e = decode_bwd(q, k, v, o, lse, dout, dlse, o_f32, variants, *dq, *dk, *dv, *dbias,
                          *dalibi, attrs, p);
      e.failure())
    return e;
  std::vector<float> delta(p.b * p.n * p.t), dq_accum(p.b * p.t * p.n * p.h);
  p.delta = delta.data();
  p.dq_accum = dq_accum.data();
  cpu::run_bwd(p);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_fwd_cpu, FwdCpu, bind_fwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_bwd_cpu, BwdCpu, bind_bwd(ffi::Ffi::Bind()));

}  // namespace jaxflash
