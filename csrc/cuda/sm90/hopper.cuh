// Thin wrappers over the sm90 PTX the Hopper kernels are built from: mbarrier, TMA
// (cp.async.bulk.tensor), wgmma fences and shared-memory matrix descriptors, setmaxnreg,
// named barriers; and on the host, the TMA descriptors of BTNH tensors. Addresses are
// shared-window byte addresses (smem_addr in ../mma.cuh). Callers compile the device functions
// only under __CUDA_ARCH_FEAT_SM90_ALL (sm_90a).
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; no libcuda call here)
#include <cuda_runtime.h>

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace jaxflash::cuda::sm90 {

// ---- mbarrier ----

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the inits visible to the other threads and to the TMA unit (before a __syncthreads).
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also raises the phase's expected transaction count by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Raises the phase's expected transaction count by `bytes` without an arrival (the phase
// cannot complete before this thread's own arrival, which may come later).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` has completed (the first phase has parity 0).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- TMA ----

__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// L2 eviction priorities for TMA copies (the createpolicy encodings of the cache-policy
// operand): kLast for tiles that many CTAs read again (K/V in the forward, Q/dO and the
// dq_accum sums in the backward), kFirst for those read once.
enum class L2Hint : uint64_t {
  kFirst = 0x12F0000000000000ull,
  kLast = 0x14F0000000000000ull,
};

// Copies the box at coordinates (c0 innermost .. c3) of a rank-4 tensor map into shared
// memory at dst; completion (all box bytes, out-of-bounds ones zero-filled) is signalled to
// the mbarrier as transaction bytes.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3, L2Hint hint) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar),
      "l"(static_cast<uint64_t>(hint))
      : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global src into
// shared memory at dst; completion is signalled to the mbarrier as transaction bytes.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// The 8x8 16-bit matrix held in the mma fragment layout (lane l: row l / 4, columns 2 (l % 4)
// and + 1, the lower column in the low half), transposed across the warp into that layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Copies the shared tile at src into the box at coordinates (c0 innermost .. c3) of a rank-4
// tensor map (rows out of bounds are not written); tracked by this thread's bulk async-groups.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// The lane index from %laneid by a volatile asm, which ptxas neither hoists nor merges: for
// rare paths whose per-lane addresses should be computed where they are used.
__device__ __forceinline__ int lane_id_volatile() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

__device__ __forceinline__ void sts_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y));
}

__device__ __forceinline__ void sts_f32(uint32_t addr, float x) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(x));
}

// Four 8x8 16-bit matrices, each transposed on the way: register i holds matrix i in the
// mma fragment layout (lane l: row l / 4, columns 2 (l % 4) and + 1), and lane l gives the
// address of row l % 8 of stored matrix l / 8 (16 bytes: a column of the fragment).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Adds the shared tile at src element-wise into the box at coordinates (c0 innermost .. c3)
// of a rank-4 tensor map, in the L2 with eviction priority `hint` (elements out of bounds are
// skipped); tracked by this thread's bulk async-groups.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, uint32_t src, int c0,
                                                  int c1, int c2, int c3, L2Hint hint) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group.L2::cache_hint"
      " [%0, {%2, %3, %4, %5}], [%1], %6;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(static_cast<uint64_t>(hint))
      : "memory");
}

// Waits until this thread's bulk groups are complete (their writes performed).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Orders this thread's generic-proxy global accesses with its async-proxy (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

__device__ __forceinline__ void red_or_release(int* ptr, int v) {
  asm volatile("red.release.gpu.global.or.b32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_release(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until all but this thread's kPending newest bulk groups have read their shared
// sources (their writes to global memory complete on their own, within the kernel).
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// ---- wgmma ----

// Orders this thread's register (accumulator, A fragment) and shared-memory writes before
// the wgmma.mma_async that follow.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins the accumulator registers in program order relative to the surrounding volatile asm,
// so the compiler neither reads them before wgmma_wait nor writes them during a wgmma.
template <int kN>
__device__ __forceinline__ void fence_regs(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor with 128-byte swizzle (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets (all >> 4, 14 bits each), swizzle
// mode 1 in bits 62-63; base offset 0, as every swizzle atom starts on a 1024-byte boundary.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32 | uint64_t{1} << 62;
}

// The descriptor of the tile `bytes` (a multiple of 16) past the one of d: the start address
// field (bits 0-13, address >> 4) takes the offset in one 32-bit add, which cannot carry out
// of it as shared addresses stay below 256 KB; the upper word is d's.
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d) + (bytes >> 4));
}

// ---- registers and barriers ----

// Warpgroup-wide: every thread of the warpgroup executes it (.sync.aligned).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (wgmma,
// TMA) reads of them, once a barrier has passed.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// bar.sync on hardware barrier `id` (1..15; 0 is __syncthreads) for `threads` threads.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// bar.arrive: counts this thread towards barrier `id` without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- TMA descriptors (host) ----

// cuTensorMapEncodeTiled from the driver, found once through the runtime so that the
// extension does not link libcuda; null when the driver lacks it.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return EncodeTiledFn{nullptr};
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// Tile t of a grid that runs sections of `sec` units (heads, or (b, kv head) pairs) of `tiles`
// tiles each, the tile index slowest within a section (every unit's tile 0 first; the last
// section may be narrower): {tile, unit}.
// (All non-negative: unsigned division is the cheaper.)
__device__ __forceinline__ int2 section_tile(unsigned t, unsigned sec, unsigned units,
                                             unsigned tiles) {
  const unsigned first = t / (sec * tiles) * sec;
  const unsigned width = min(sec, units - first);
  const unsigned loc = t - first * tiles;
  return make_int2(static_cast<int>(loc / width), static_cast<int>(first + loc % width));
}

// section_tile over every unit's first `tiles - deferred` tiles, then the last `deferred` tiles
// of all the units, tile slowest.
__device__ __forceinline__ int2 section_tile_deferred(unsigned t, unsigned sec, unsigned units,
                                                      unsigned tiles, unsigned deferred) {
  const unsigned head = units * (tiles - deferred);
  if (t < head) return section_tile(t, sec, units, tiles - deferred);
  t -= head;
  return make_int2(static_cast<int>(tiles - deferred + t / units), static_cast<int>(t % units));
}

// The next of this launch's claims (0, 1, ...) on a tile counter that no pass zeroes before
// the kernel: the 64-bit word holds (the launch's %gridid, low 32 bits; claims so far), and a
// word of another launch (or uninitialised scratch) is taken over at 0. Without the memset
// node that zeroed an int before each launch, one-sequence causal forwards measured 0-10%
// faster (T = 256 to 4k), batches of 16k tokens level (NOTES.md, thirty-third session).
// In two halves, so that the add's round trip overlaps other work: claim_add issues it,
// claim_tile(ctr, claim_add(ctr)) gives the claim.
__device__ __forceinline__ unsigned long long claim_add(unsigned long long* ctr) {
  return atomicAdd(ctr, 1ull);
}
__device__ __forceinline__ int claim_tile(unsigned long long* ctr, unsigned long long old) {
  unsigned long long gid;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(gid));
  const unsigned long long tag = gid << 32, kHi = 0xffffffff00000000ull;
  while ((old & kHi) != tag) {  // another launch's word (we added to it): ours from 0
    const unsigned long long seen = atomicCAS(ctr, old + 1, tag + 1);
    if (seen == old + 1) return 0;
    // someone else added to it (try again on their value) or took it over (add to ours)
    old = (seen & kHi) == tag ? atomicAdd(ctr, 1ull) : seen - 1;
  }
  return static_cast<int>(old & 0xffffffffu);
}

// The (H, heads, L, B) view of a BTNH (or BSKH) tensor, innermost first, and a box of
// (128 / sizeof(T), 1, box_rows, 1): box_rows rows of one (batch, head), 128 bytes of each, in
// 128-byte swizzle. Rows past L read as zeros (a reduce skips them) and never cross
// into the next batch.
template <typename T>
bool encode_btnh(CUtensorMap* map, const void* ptr, int64_t h, int64_t heads, int64_t len,
                 int64_t batch, int64_t head_stride, int64_t row_stride, int64_t batch_stride,
                 int box_rows) {
  const EncodeTiledFn fn = encode_tiled();
  if (fn == nullptr) return false;
  constexpr int64_t kBytes = sizeof(T);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(h), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(len), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_stride * kBytes),
                                 static_cast<cuuint64_t>(row_stride * kBytes),
                                 static_cast<cuuint64_t>(batch_stride * kBytes)};
  const cuuint32_t box[4] = {128 / sizeof(T), 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dtype = std::is_same_v<T, float>           ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                    : std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return fn(map, dtype, 4, const_cast<void*>(ptr), dims, strides, box, elem_strides,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace jaxflash::cuda::sm90
