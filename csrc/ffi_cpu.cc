// CPU FFI handlers: decode buffers -> params -> cpu kernels.
#include <vector>

#include "cpu/attention_cpu.h"
#include "ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

static ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                         float scale, bool is_causal) {
  FwdParams p{};
  if (auto e = make_fwd_params(q, k, v, *o, *lse, scale, is_causal, p); e.failure()) return e;
  cpu::run_fwd(p);
  return ffi::Error::Success();
}

static ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                         ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, float scale, bool is_causal) {
  BwdParams p{};
  if (auto e = make_bwd_params(q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal, p);
      e.failure())
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
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_bwd_cpu, BwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // o
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attr<float>("scale")
                                  .Attr<bool>("is_causal"));

}  // namespace jaxflash
