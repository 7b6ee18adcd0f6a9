// The mask's tile summary (launch.h MaskTiles): one pass over the mask as stored, one warp per
// kMaskTile x kMaskTile tile. It runs before the variant kernels of a call with a mask, which
// then skip the tiles with no visible element and the per-element test of all-true tiles.
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"

namespace jaxflash::cuda {
namespace {

constexpr int kThreads = 256;

// Lane l reads 4 adjacent mask bytes of rows l / 16, l / 16 + 2, ... of its tile. `words`: the
// mask's rows are contiguous and every 4-byte group is aligned, so one 32-bit load reads them.
__global__ void __launch_bounds__(kThreads) mask_tiles_kernel(const FwdParams p, MaskTiles mt,
                                                              uint8_t* tiles, int64_t count,
                                                              bool words) {
  const int64_t tile = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (tile >= count) return;  // whole warps
  const int lane = threadIdx.x % 32;
  // tile enumerates (outer, B|1, N|1, T tiles|1, S tiles|1), the summary's layout.
  const int64_t j = tile % mt.cols, i = tile / mt.cols % mt.rows;
  int64_t rest = tile / (mt.cols * mt.rows);
  const int64_t hn = rest % mt.heads;
  rest /= mt.heads;
  const int64_t bb = rest % mt.batches, outer = rest / mt.batches;
  const BcastStrides& st = p.mask_strides;
  const int r0 = static_cast<int>(i) * kMaskTile, c0 = static_cast<int>(j) * kMaskTile;
  // A broadcast dim holds one element, so its tile holds one row or column.
  const int rows = st.row ? min(kMaskTile, static_cast<int>(p.t) - r0) : 1;
  const int cols = st.col ? min(kMaskTile, static_cast<int>(p.s) - c0) : 1;
  const uint8_t* gMask = p.mask + outer * st.outer + bb * st.batch + hn * st.head +
                         r0 * st.row + c0 * st.col;  // (rows, cols) of the tile
  const int c = lane % 16 * 4;
  bool visible = false, hidden = false;
  if (c < cols) {
#pragma unroll 4
    for (int r = lane / 16; r < rows; r += 2) {
      const uint8_t* src = gMask + r * st.row + c;
      if (words) {  // cols is a multiple of 4 here: the whole group is in the tile
        const uint32_t x = *reinterpret_cast<const uint32_t*>(src);
        visible |= x != 0;
        hidden |= __vcmpeq4(x, 0u) != 0;
      } else {
        for (int e = 0; e < 4 && c + e < cols; ++e) {
          const bool m = src[e * st.col] != 0;
          visible |= m;
          hidden |= !m;
        }
      }
    }
  }
  visible = __any_sync(0xffffffffu, visible);
  hidden = __any_sync(0xffffffffu, hidden);
  if (lane == 0) tiles[tile] = (visible ? kMaskVisible : 0) | (hidden ? kMaskHidden : 0);
}

}  // namespace

void summarize_mask(const FwdParams& p, uint8_t* tiles, cudaStream_t stream) {
  const int64_t count = MaskTiles::bytes(p);
  if (count == 0) return;
  const bool words = p.mask_strides.col == 1 && p.s % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(p.mask) % 4 == 0;
  const int64_t blocks = (count * 32 + kThreads - 1) / kThreads;
  mask_tiles_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, MaskTiles(p), tiles,
                                                                           count, words);
}

}  // namespace jaxflash::cuda
