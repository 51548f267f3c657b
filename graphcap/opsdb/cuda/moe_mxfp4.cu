// MXFP4 experts whose weights are stored in the mma.sync A-operand order
// (graphcap/opsdb/mxfp4.py: operand_order): a warp reads a 16-row block's 64-value chunk as
// 512 contiguous bytes, 16 a lane, and decodes each lane's E2M1 values straight into its
// bf16 operand registers; the scale (and the decode's 2^126) is one bf16 multiply a pair.
// Tokens are the right operand (8 per product): a tile of 8 or 16 rows of one expert (32
// in the sweep's build) reads each of its weights once. Built on first use
// (graphcap/opsdb/cuda/__init__.py).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "mxfp4_operands.cuh"

namespace {

using namespace graphcap_mxfp4;

template <int RB, int MB>
struct Chunk {
  uint4 w[RB], x[MB][2];
  uint32_t s[RB];
};

// Chunk c's weight bytes, scales and activations (rows past the tile's pairs read row 0).
template <int RB, int MB>
__device__ __forceinline__ void load(Chunk<RB, MB>& k, const uint4* const (&wp)[RB],
                                     const uint16_t* const (&sp)[RB],
                                     const __nv_bfloat16* const (&xp)[MB], int c) {
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    k.w[r] = __ldg(wp[r] + c * 32);
    k.s[r] = __ldg(sp[r] + c * 16);
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    const uint4* xv = reinterpret_cast<const uint4*>(xp[m] + c * 64);
    k.x[m][0] = __ldg(xv);
    k.x[m][1] = __ldg(xv + 1);
  }
}

template <int RB, int MB>
__device__ __forceinline__ void compute(float (&acc)[RB][MB][4], const Chunk<RB, MB>& k) {
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const uint32_t s_g = scale_pair(k.s[r] & 0xffu), s_g8 = scale_pair(k.s[r] >> 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      operand(word(k.w[r], j), s_g, s_g8, a);
#pragma unroll
      for (int m = 0; m < MB; ++m)
        mma(acc[r][m], a[0], a[1], a[2], a[3], word(k.x[m][j >> 1], 2 * (j & 1)),
            word(k.x[m][j >> 1], 2 * (j & 1) + 1));
    }
  }
}

// MODE 0: gate/up (rows g and g + 8 of a block: a feature's gate and up), biases (b13's
// rows in the published order: interleaved or halves), SwiGLU or gpt-oss's clamped GLU
// (alpha > 0), out [pairs, N / 2]. MODE 1: down, bias, times the routing
// weight, out [pairs, N]. A tile: 8 * MB padded rows of one expert; a warp: RB blocks of
// 16 weight rows over all K, a chunk (64 K) loaded while the one before is multiplied.
template <int MODE, int MB, int RB>
__global__ void __launch_bounds__(256) experts_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint4* __restrict__ w,
    const uint16_t* __restrict__ s, const __nv_bfloat16* __restrict__ bias,
    const int* __restrict__ sorted_pairs, const int* __restrict__ cum_padded,
    const float* __restrict__ topk_weights, __nv_bfloat16* __restrict__ out,
    int64_t out_stride, int num_pairs, int num_experts, int top_k, int row_blocks,
    int chunks, bool interleaved, float alpha, float limit) {
  constexpr int BM = 8 * MB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * BM;
  int e = 0;
  for (int base = 0; base < num_experts; base += 32) {
    const int i = base + lane;
    e += __popc(__ballot_sync(0xffffffffu, i < num_experts && cum_padded[i] <= row0));
  }
  if (row0 >= cum_padded[num_experts - 1]) return;
  const int rb0 = (blockIdx.y * warps + warp) * RB;
  if (rb0 >= row_blocks) return;

  const __nv_bfloat16* xp[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    const int pair = sorted_pairs[row0 + 8 * m + g];
    const int64_t xrow = pair < num_pairs ? (MODE == 0 ? pair / top_k : pair) : 0;
    xp[m] = x + xrow * x_stride + 16 * t;
  }
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

  Chunk<RB, MB> a, b;
  load(a, wp, sp, xp, 0);
  int c = 0;
  for (; c + 2 < chunks; c += 2) {
    load(b, wp, sp, xp, c + 1);
    compute(acc, a);
    load(a, wp, sp, xp, c + 2);
    compute(acc, b);
  }
  if (c + 1 < chunks) {
    load(b, wp, sp, xp, c + 1);
    compute(acc, a);
    compute(acc, b);
  } else {
    compute(acc, a);
  }

  for (int r = 0; r < RB; ++r) {
    const int rb = rb0 + r;
    if (rb >= row_blocks) break;
    for (int m = 0; m < MB; ++m) {
      for (int col = 0; col < 2; ++col) {
        const int pair = sorted_pairs[row0 + 8 * m + 2 * t + col];
        if (pair >= num_pairs) continue;
        if (MODE == 0) {
          const int f = 8 * rb + g;  // the feature: its gate is row g, its up row g + 8
          float gate = acc[r][m][col], up = acc[r][m][2 + col];
          if (bias != nullptr) {
            const __nv_bfloat16* b = bias + (int64_t)e * 16 * row_blocks;
            gate += __bfloat162float(b[interleaved ? 2 * f : f]);
            up += __bfloat162float(b[interleaved ? 2 * f + 1 : 8 * row_blocks + f]);
          }
          float h;
          if (alpha > 0.f) {  // gpt-oss's clamped GLU
            if (limit > 0.f) {
              gate = fminf(gate, limit);
              up = fminf(fmaxf(up, -limit), limit);
            }
            h = (up + 1.f) * gate / (1.f + __expf(-alpha * gate));
          } else {  // SwiGLU
            h = gate / (1.f + __expf(-gate)) * up;
          }
          out[(int64_t)pair * out_stride + f] = __float2bfloat16(h);
        } else {
          const float wt = topk_weights[pair];
          for (int half = 0; half < 2; ++half) {
            const int n = 16 * rb + g + 8 * half;
            const float b =
                bias == nullptr ? 0.f : __bfloat162float(bias[(int64_t)e * 16 * row_blocks + n]);
            const float y = (acc[r][m][2 * half + col] + b) * wt;
            out[(int64_t)pair * out_stride + n] = __float2bfloat16(y);
          }
        }
      }
    }
  }
}

}  // namespace

void experts(torch::Tensor x, torch::Tensor w, torch::Tensor s, c10::optional<torch::Tensor> bias,
             torch::Tensor sorted_pairs, torch::Tensor cum_padded, torch::Tensor topk_weights,
             torch::Tensor out, int64_t mode, int64_t mb, int64_t rb, int64_t warps,
             int64_t num_pairs, int64_t top_k, bool interleaved, double alpha, double limit) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.stride(0) % 8 == 0 && x.size(1) == w.size(2) * 64,
              "x: bf16 rows of the weights' K, contiguous along K, 16-byte aligned");
  TORCH_CHECK(w.dim() == 5 && w.is_contiguous() && s.is_contiguous() && out.stride(1) == 1,
              "weights and scales in operand order, contiguous");
  const int num_experts = cum_padded.numel();
  const int row_blocks = w.size(1), chunks = w.size(2);
  const __nv_bfloat16* b = bias.has_value()
      ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  // Tiles past the rows in use return at once (their first row is at or past the last
  // entry of cum_padded, a multiple of the tile), so none reads past sorted_pairs.
  const dim3 grid((sorted_pairs.numel() + 8 * mb - 1) / (8 * mb),
                  (row_blocks + warps * rb - 1) / (warps * rb));
  const dim3 block(32 * warps);
  auto stream = at::cuda::getCurrentCUDAStream();
#define GRAPHCAP_LAUNCH(MODE, MB, RB)                                                       \
  if (mode == MODE && mb == MB && rb == RB) {                                               \
    experts_kernel<MODE, MB, RB><<<grid, block, 0, stream>>>(                               \
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0),                  \
        reinterpret_cast<const uint4*>(w.data_ptr()),                                       \
        reinterpret_cast<const uint16_t*>(s.data_ptr()), b,                                 \
        sorted_pairs.data_ptr<int>(), cum_padded.data_ptr<int>(),                           \
        topk_weights.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),   \
        out.stride(0), (int)num_pairs, num_experts, (int)top_k, row_blocks, chunks,         \
        interleaved, (float)alpha, (float)limit);                                           \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                         \
    return;                                                                                 \
  }
#ifdef GRAPHCAP_MXFP4_SWEEP  // every tile, for docs/notes/probes/moe_mxfp4_cuda.py
#define GRAPHCAP_LAUNCH_RB(MODE, MB) \
  GRAPHCAP_LAUNCH(MODE, MB, 1) GRAPHCAP_LAUNCH(MODE, MB, 2) GRAPHCAP_LAUNCH(MODE, MB, 4)
  GRAPHCAP_LAUNCH_RB(0, 1) GRAPHCAP_LAUNCH_RB(0, 2) GRAPHCAP_LAUNCH_RB(0, 4)
  GRAPHCAP_LAUNCH_RB(1, 1) GRAPHCAP_LAUNCH_RB(1, 2) GRAPHCAP_LAUNCH_RB(1, 4)
#else  // the tiles moe.py picks (rows a tile, row blocks a warp): the sweep's best
  GRAPHCAP_LAUNCH(0, 1, 2) GRAPHCAP_LAUNCH(0, 2, 4) GRAPHCAP_LAUNCH(1, 1, 2)
  GRAPHCAP_LAUNCH(1, 2, 4)
#endif
  TORCH_CHECK(false, "no MXFP4 experts kernel for mode ", mode, ", ", 8 * mb, " rows, ", rb,
              " row blocks a warp");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("experts", &experts); }
