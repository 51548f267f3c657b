"""opsdb's CUDA MXFP4 expert kernel with the tile's activations staged in shared memory
(device side; ran at 9fda93e, `2026-12-04-moe-mxfp4-xs-9fda93e-h200.json`: not adopted):

    PYTHONPATH=. [PROBE_TOKENS=128,512,2048] python3 docs/notes/probes/moe_mxfp4_xs.py

At 16 rows an expert and beyond (512 tokens of gpt-oss-120b) opsdb's kernel
(`graphcap/opsdb/cuda/moe_mxfp4.cu`) is neither issue- nor DRAM-bound: each lane holds the
next chunk's activations in registers beside the current one's (a second buffer of 8 * MB
registers), so a 16-row tile with 4 row blocks a warp takes 128 registers and 17-25%
occupancy, and 32-row tiles, which would decode an expert's weights once instead of once
a 16-row tile, lose (`2026-12-04-ncu-moe-mxfp4-cuda-78a53a7-h200.json`). Here the CTA's
threads copy each chunk's activation rows into shared memory (``cp.async``, two buffers,
rows padded to 144 bytes so a warp's 16-byte reads meet no bank twice) and every warp
reads its right operands from there: no activation registers carried across chunks.
Prediction: 32-row tiles with 2-4 row blocks a warp at 512 tokens about 1.5x faster than
opsdb's best (0.653 ms gate/up, 0.386 down). Per token count: CUDA-graph device ms of the
Triton kernels and of this kernel's tiles, and the largest difference between their rows
(JSON in $OUT/moe-mxfp4-xs.json). It reads the operand order of 9fda93e (K permuted a lane,
scales as 16-bit pairs); from 3a2fec6 on the order keeps each product's K, so its rows here
are wrong and only its timings mean what they did."""

import os
import sys
from pathlib import Path

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include "mxfp4_operands.cuh"

namespace {
using namespace graphcap_mxfp4;

constexpr int ROW = 9;  // uint4 a staged row: a chunk's 64 values, and 16 bytes of padding

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

template <int RB>
__device__ __forceinline__ void load_w(uint4 (&w)[RB], uint32_t (&s)[RB],
                                       const uint4* const (&wp)[RB],
                                       const uint16_t* const (&sp)[RB], int c) {
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    w[r] = __ldg(wp[r] + c * 32);
    s[r] = __ldg(sp[r] + c * 16);
  }
}

template <int MB, int RB>
__device__ __forceinline__ void compute(float (&acc)[RB][MB][4], const uint4 (&w)[RB],
                                        const uint32_t (&s)[RB], const uint4* xs, int g,
                                        int t) {
  uint4 xv[MB][2];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    xv[m][0] = xs[(8 * m + g) * ROW + 2 * t];
    xv[m][1] = xs[(8 * m + g) * ROW + 2 * t + 1];
  }
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const uint32_t s_g = scale_pair(s[r] & 0xffu), s_g8 = scale_pair(s[r] >> 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      operand(word(w[r], j), s_g, s_g8, a);
#pragma unroll
      for (int m = 0; m < MB; ++m)
        mma(acc[r][m], a[0], a[1], a[2], a[3], word(xv[m][j >> 1], 2 * (j & 1)),
            word(xv[m][j >> 1], 2 * (j & 1) + 1));
    }
  }
}

template <int MODE, int MB, int RB>
__global__ void __launch_bounds__(256) experts_xs_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint4* __restrict__ w,
    const uint16_t* __restrict__ s, const __nv_bfloat16* __restrict__ bias,
    const int* __restrict__ sorted_pairs, const int* __restrict__ cum_padded,
    const float* __restrict__ topk_weights, __nv_bfloat16* __restrict__ out,
    int64_t out_stride, int num_pairs, int num_experts, int top_k, int row_blocks,
    int chunks, bool interleaved, float alpha, float limit) {
  constexpr int BM = 8 * MB, STAGE = (BM * 8 + 127) / 128;  // copies a thread (128+)
  extern __shared__ uint4 xs[];  // [2][BM][ROW]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * BM;
  int e = 0;
  for (int base = 0; base < num_experts; base += 32) {
    const int i = base + lane;
    e += __popc(__ballot_sync(0xffffffffu, i < num_experts && cum_padded[i] <= row0));
  }
  if (row0 >= cum_padded[num_experts - 1]) return;  // the whole CTA
  const int rb0 = (blockIdx.y * warps + warp) * RB;
  const bool active = rb0 < row_blocks;  // idle warps still copy and meet the barriers

  const __nv_bfloat16* src[STAGE];
  int dst[STAGE];
  bool copies[STAGE];
#pragma unroll
  for (int k = 0; k < STAGE; ++k) {
    const int i = threadIdx.x + k * blockDim.x, row = i >> 3;
    copies[k] = i < BM * 8;
    const int pair = copies[k] ? sorted_pairs[row0 + row] : num_pairs;
    const int64_t xrow = pair < num_pairs ? (MODE == 0 ? pair / top_k : pair) : 0;
    src[k] = x + xrow * x_stride + (i & 7) * 8;
    dst[k] = row * ROW + (i & 7);
  }
  auto stage = [&](int c, int buf) {
#pragma unroll
    for (int k = 0; k < STAGE; ++k)
      if (copies[k]) cp_async16(xs + buf * BM * ROW + dst[k], src[k] + c * 64);
    asm volatile("cp.async.commit_group;");
  };

  const uint4* wp[RB];
  const uint16_t* sp[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int rb = min(rb0 + r, row_blocks - 1);
    const int64_t first = ((int64_t)e * row_blocks + rb) * chunks;
    wp[r] = w + first * 32 + lane;
    sp[r] = s + first * 16 + g * 2 + (t >> 1);
  }
  float acc[RB][MB][4];
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][m][i] = 0.f;

  uint4 wa[RB], wb[RB];
  uint32_t sa[RB], sb[RB];
  if (active) load_w(wa, sa, wp, sp, 0);
  stage(0, 0);
  // Two chunks an iteration: the weights of the next in the other register set.
  for (int c = 0; c < chunks; c += 2) {
    const bool second = c + 1 < chunks;
    if (second) {
      stage(c + 1, 1);
      if (active) load_w(wb, sb, wp, sp, c + 1);
      asm volatile("cp.async.wait_group 1;");
    } else {
      asm volatile("cp.async.wait_group 0;");
    }
    __syncthreads();
    if (active) compute(acc, wa, sa, xs, g, t);
    __syncthreads();
    if (!second) break;
    const bool third = c + 2 < chunks;
    if (third) {
      stage(c + 2, 0);
      if (active) load_w(wa, sa, wp, sp, c + 2);
      asm volatile("cp.async.wait_group 1;");
    } else {
      asm volatile("cp.async.wait_group 0;");
    }
    __syncthreads();
    if (active) compute(acc, wb, sb, xs + BM * ROW, g, t);
    __syncthreads();
  }
  if (!active) return;

#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int rb = rb0 + r;
    if (rb >= row_blocks) break;
#pragma unroll
    for (int m = 0; m < MB; ++m) {
#pragma unroll
      for (int col = 0; col < 2; ++col) {
        const int pair = sorted_pairs[row0 + 8 * m + 2 * t + col];
        if (pair >= num_pairs) continue;
        if (MODE == 0) {
          const int f = 8 * rb + g;
          float gate = acc[r][m][col], up = acc[r][m][2 + col];
          if (bias != nullptr) {
            const __nv_bfloat16* b = bias + (int64_t)e * 16 * row_blocks;
            gate += __bfloat162float(b[interleaved ? 2 * f : f]);
            up += __bfloat162float(b[interleaved ? 2 * f + 1 : 8 * row_blocks + f]);
          }
          float h;
          if (alpha > 0.f) {
            if (limit > 0.f) {
              gate = fminf(gate, limit);
              up = fminf(fmaxf(up, -limit), limit);
            }
            h = (up + 1.f) * gate / (1.f + __expf(-alpha * gate));
          } else {
            h = gate / (1.f + __expf(-gate)) * up;
          }
          out[(int64_t)pair * out_stride + f] = __float2bfloat16(h);
        } else {
          const float wt = topk_weights[pair];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int n = 16 * rb + g + 8 * half;
            const float b =
                bias == nullptr ? 0.f : __bfloat162float(bias[(int64_t)e * 16 * row_blocks + n]);
            out[(int64_t)pair * out_stride + n] =
                __float2bfloat16((acc[r][m][2 * half + col] + b) * wt);
          }
        }
      }
    }
  }
}

}  // namespace

void experts_xs(torch::Tensor x, torch::Tensor w, torch::Tensor s,
                c10::optional<torch::Tensor> bias, torch::Tensor sorted_pairs,
                torch::Tensor cum_padded, torch::Tensor topk_weights,
                torch::Tensor out, int64_t mode, int64_t mb, int64_t rb, int64_t warps,
                int64_t num_pairs, int64_t top_k, bool interleaved, double alpha, double limit) {
  TORCH_CHECK(warps >= 4 && x.stride(1) == 1 && x.stride(0) % 8 == 0, "x rows, 4+ warps");
  const int num_experts = cum_padded.numel();
  const int row_blocks = w.size(1), chunks = w.size(2);
  const __nv_bfloat16* b = bias.has_value()
      ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  const dim3 grid((sorted_pairs.numel() + 8 * mb - 1) / (8 * mb),
                  (row_blocks + warps * rb - 1) / (warps * rb));
  const dim3 block(32 * warps);
  const size_t smem = 2 * 8 * mb * 9 * 16;
  auto stream = at::cuda::getCurrentCUDAStream();
#define PROBE_LAUNCH(MODE, MB, RB)                                                          \
  if (mode == MODE && mb == MB && rb == RB) {                                               \
    experts_xs_kernel<MODE, MB, RB><<<grid, block, smem, stream>>>(                         \
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0),                  \
        reinterpret_cast<const uint4*>(w.data_ptr()),                                       \
        reinterpret_cast<const uint16_t*>(s.data_ptr()), b, sorted_pairs.data_ptr<int>(),   \
        cum_padded.data_ptr<int>(), topk_weights.data_ptr<float>(),                         \
        reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), out.stride(0), (int)num_pairs,    \
        num_experts, (int)top_k, row_blocks, chunks, interleaved, (float)alpha,             \
        (float)limit);                                                                      \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                         \
    return;                                                                                 \
  }
#define PROBE_LAUNCH_RB(MODE, MB) \
  PROBE_LAUNCH(MODE, MB, 1) PROBE_LAUNCH(MODE, MB, 2) PROBE_LAUNCH(MODE, MB, 4)
  PROBE_LAUNCH_RB(0, 2) PROBE_LAUNCH_RB(0, 4) PROBE_LAUNCH_RB(1, 2) PROBE_LAUNCH_RB(1, 4)
  TORCH_CHECK(false, "no tile ", mb, " ", rb);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("experts_xs", &experts_xs); }
"""

_MODULE = []


def module():
    """The probe's kernel (built once a process; nvcc and ninja)."""
    if not _MODULE:
        from torch.utils.cpp_extension import load_inline

        import graphcap.opsdb.cuda as cuda_kernels
        _MODULE.append(load_inline(
            "graphcap_moe_mxfp4_xs", cpp_sources="", cuda_sources=SOURCE,
            extra_include_paths=[str(Path(cuda_kernels.__file__).parent)],
            extra_cuda_cflags=["-O3"]))
    return _MODULE[0]


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe_mxfp4_cuda
    from moe_mxfp4_decode import compare_tiles

    moe_mxfp4_cuda.KERNELS["xs"] = lambda: module().experts_xs
    sweep = [dict(kernel="xs", m=m, rb=rb, warps=w) for m in (16, 32) for rb in (1, 2, 4)
             for w in (4, 8)]
    compare_tiles(moe_mxfp4_cuda.gate_up, moe_mxfp4_cuda.down, sweep,
                  "gpt-oss-120b's MXFP4 gate/up and down: opsdb's tl.dot_scaled kernels against "
                  "opsdb's CUDA kernel with the activations staged in shared memory",
                  "moe-mxfp4-xs")


if __name__ == "__main__":
    main()
