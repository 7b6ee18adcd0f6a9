// CUDA FFI handlers: decode buffers -> params, validate what the CUDA kernels cover, then
// dispatch to one compiled (dtype, head dim, causal) instantiation on XLA's stream.
// Both bind every variant operand and attr exactly as the CPU handlers (ffi_cpu.cc), and the
// kernels run them all.
#include <cuda_runtime.h>

#include <string>

#include "cuda/dispatch.h"
#include "cuda/sm90/select.h"
#include "ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {
namespace {

ffi::Error cuda_error(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxflash: ") + what + ": " + cudaGetErrorString(err));
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The head dims (H == Hv) a direction has kernels for in this build, e.g. "64, 128".
template <typename Compiled>
std::string head_dims_str(Compiled compiled) {
  std::string out;
  for (int h : {32, 64, 96, 128, 192, 256})
    if (compiled(h, h)) out += (out.empty() ? "" : ", ") + std::to_string(h);
  return out;
}

std::string got_head_dims(const FwdParams& p) {
  return ", got H=" + std::to_string(p.h) + ", Hv=" + std::to_string(p.hv);
}

// What the CUDA kernels cover beyond what make_fwd_params already checked.
ffi::Error validate_cuda(const FwdParams& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return invalid("the CUDA kernels take float16 or bfloat16 inputs, got float32");
  if (!cuda::fwd_head_dims_compiled(p.h, p.hv))
    return invalid("the CUDA forward kernel supports head dims H and Hv in (" +
                   head_dims_str(cuda::fwd_head_dims_compiled) + ") with Hv <= H" +
                   got_head_dims(p));
  // Kernels index rows with int (with a tile of headroom) and copy rows in 16-byte chunks.
  if (p.t >= (int64_t{1} << 30) || p.s >= (int64_t{1} << 30))
    return invalid("the CUDA kernels take sequence lengths below 2^30, got T=" +
                   std::to_string(p.t) + ", S=" + std::to_string(p.s));
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o)})
    if (!aligned16(ptr)) return invalid("the CUDA kernels need 16-byte aligned q, k, v, o");
  if (p.o_f32 && !aligned16(p.o_f32))
    return invalid("the CUDA kernels need a 16-byte aligned o_f32");
  return ffi::Error::Success();
}

// `bytes` of XLA's scratch memory, 16-byte aligned, or null when bytes is 0; clears
// `allocated` when the allocation fails.
void* scratch_bytes(ffi::ScratchAllocator& scratch, int64_t bytes, bool& allocated) {
  if (bytes == 0) return nullptr;
  auto buf = scratch.Allocate(static_cast<size_t>(bytes), 16);
  allocated = allocated && buf.has_value();
  return buf.value_or(nullptr);
}

// The mask's tile summary (cuda/launch.h MaskTiles), in scratch, for the variant kernels.
ffi::Error add_mask_tiles(ffi::ScratchAllocator& scratch, cudaStream_t stream, FwdParams& p) {
  bool allocated = true;
  auto* tiles =
      static_cast<uint8_t*>(scratch_bytes(scratch, cuda::MaskTiles::bytes(p), allocated));
  if (!allocated)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxflash: could not allocate the mask's tile summary");
  if (tiles) cuda::summarize_mask(p, tiles, stream);
  p.mask_tiles = tiles;
  return ffi::Error::Success();
}

struct FwdLaunch {
  const FwdParams& p;
  cudaStream_t stream;
  template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
  void operator()() const {
    if (p.o_f32)  // only the sm80 variant kernel writes it (flash_fwd.cuh run_fwd)
      cuda::run_fwd<T, kHeadDim, kHeadDimV, kCausal>(p, stream);
    else
      cuda::run_fwd_best<T, kHeadDim, kHeadDimV, kCausal>(p, stream);  // sm90 where it applies
  }
};

struct BwdLaunch {
  const BwdParams& p;
  cudaStream_t stream;
  template <typename T, int kHeadDim, int kHeadDimV, bool kCausal>
  void operator()() const {
    cuda::run_bwd_best<T, kHeadDim, kHeadDimV, kCausal>(p, stream);  // sm90 where it applies
  }
};

ffi::Error FwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::RemainingArgs variants,
                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                   ffi::RemainingRets extra, CallAttrs attrs) {
  FwdParams p{};
  if (auto e = decode_fwd(q, k, v, variants, *o, *lse, extra, attrs, p); e.failure()) return e;
  if (auto e = validate_cuda(p); e.failure()) return e;
  // Nothing to write. S == 0 is not empty: the kernel writes O = 0 and lse = -inf.
  if (p.b == 0 || p.t == 0 || p.n == 0) return ffi::Error::Success();
  if (auto e = add_mask_tiles(scratch, stream, p); e.failure()) return e;
  bool allocated = true;
  p.tile_counter = static_cast<unsigned long long*>(
      scratch_bytes(scratch, sizeof(unsigned long long), allocated));
  if (!allocated)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxflash: could not allocate the forward's tile counter");
  // Without it the persistent forward runs its last round unsplit.
  if (const int64_t split = cuda::fwd_split_bytes(p); split > 0)
    if (void* ws = scratch_bytes(scratch, split, allocated))
      cuda::fwd_split_bytes(p, &p.split_o, &p.split_ml, &p.split_cnt, ws);
  if (!cuda::dispatch_fwd(p, FwdLaunch{p, stream}))
    return invalid("no CUDA forward kernel compiled for this dtype and head dim");
  return cuda_error("forward kernel launch failed");
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                   ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer o_f32,
                   ffi::RemainingArgs variants,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                   ffi::Result<ffi::AnyBuffer> dalibi, CallAttrs attrs) {
  BwdParams p{};
  if (auto e = decode_bwd(q, k, v, o, lse, dout, dlse, o_f32, variants, *dq, *dk, *dv, *dbias,
                          *dalibi, attrs, p);
      e.failure())
    return e;
  // First: implementation=None reaches this handler at such head dims (jaxflash/attention.py).
  if (!cuda::bwd_head_dims_compiled(p.h, p.hv))
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jaxflash: the CUDA backward kernel supports head dims (" +
                          head_dims_str(cuda::bwd_head_dims_compiled) + ") with Hv == H" +
                          (cuda::bwd_head_dims_compiled(192, 128) ? ", and H=192, Hv=128" : "") +
                          got_head_dims(p) +
                          " (the CUDA forward runs them; implementation='xla' differentiates "
                          "through the reference)");
  if (auto e = validate_cuda(p); e.failure()) return e;
  for (const void* ptr : {p.dout, static_cast<const void*>(p.dq), static_cast<const void*>(p.dk),
                          static_cast<const void*>(p.dv)})
    if (!aligned16(ptr)) return invalid("the CUDA kernels need 16-byte aligned dout, dq, dk, dv");
  // Head dim 256's tiles take 209 KB (flash_bwd.cuh Tiles): sm90, not the A100's 163 KB.
  int device = 0, smem_max = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
          cudaSuccess &&
      cuda::bwd_smem_bytes(p.h) > smem_max)
    return invalid("the CUDA backward kernel at head dim " + std::to_string(p.h) + " needs " +
                   std::to_string(cuda::bwd_smem_bytes(p.h) / 1024) +
                   " KB of shared memory per block, this GPU has " +
                   std::to_string(smem_max / 1024) + " KB");
  // With no query or no key there is no attention weight: every gradient is zero (dk and dv
  // may still be non-empty, e.g. T == 0 < S).
  if (p.b == 0 || p.t == 0 || p.n == 0 || p.s == 0) {
    for (ffi::AnyBuffer* buf : {&*dq, &*dk, &*dv, &*dbias, &*dalibi})
      if (buf->size_bytes() > 0) cudaMemsetAsync(buf->untyped_data(), 0, buf->size_bytes(), stream);
    return cuda_error("zero-filling the gradients failed");
  }
  const size_t rows = static_cast<size_t>(p.b * p.n * p.t);  // (B, N, T) = (B, T, N) rows
  const int64_t padded_rows = p.b * p.n * cuda::bwd_t_pad(p.t);  // (B, N, T_pad)
  const cuda::BwdWorkspace w = cuda::bwd_workspace(p);
  bool allocated = true;
  // A 4-byte workspace of `count` elements, or null when count is 0.
  auto allocate = [&](int64_t count) { return scratch_bytes(scratch, count * 4, allocated); };
  p.delta = static_cast<float*>(allocate(padded_rows));
  p.lse_log2 = static_cast<float*>(allocate(padded_rows));
  // Rows as wide as the kernel's tiles (H padded: flash_bwd.cuh Tiles).
  p.dq_accum = static_cast<float*>(allocate(static_cast<int64_t>(rows) * cuda::bwd_width(p.h)));
  p.dbias_accum = static_cast<float*>(allocate(w.dbias_accum));
  p.dalibi_accum = static_cast<float*>(allocate(w.dalibi_accum));
  p.dq_turn = static_cast<int*>(allocate(w.dq_turn));
  p.kv_seg_range = static_cast<int*>(allocate(w.kv_seg_range));
  p.dq_ticket = static_cast<int*>(allocate(w.dq_ticket));
  p.prep_done = static_cast<int*>(allocate(w.prep_done));
  if (!allocated)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxflash: could not allocate the fp32 backward workspaces");
  if (auto e = add_mask_tiles(scratch, stream, p); e.failure()) return e;
  if (!cuda::dispatch_bwd(p, BwdLaunch{p, stream}))
    return invalid("no CUDA backward kernel compiled for this dtype and head dim");
  return cuda_error("backward kernel launch failed");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_fwd_cuda, FwdCuda,
                              bind_fwd(ffi::Ffi::Bind()
                                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                           .Ctx<ffi::ScratchAllocator>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_bwd_cuda, BwdCuda,
                              bind_bwd(ffi::Ffi::Bind()
                                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                           .Ctx<ffi::ScratchAllocator>()));

}  // namespace jaxflash
