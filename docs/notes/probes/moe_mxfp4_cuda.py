"""gpt-oss-120b's MXFP4 expert projections by a CUDA kernel that decodes E2M1 straight into
the tensor cores' register operands, against opsdb's ``tl.dot_scaled`` kernels (device side,
and a layout check on the CPU):

    PYTHONPATH=. [PROBE_TOKENS=16,128,512] python3 docs/notes/probes/moe_mxfp4_cuda.py
    PYTHONPATH=. python3 docs/notes/probes/moe_mxfp4_cuda.py         # no GPU: the layout

Nsight Compute of opsdb's kernels (`2026-12-03-ncu-moe-mxfp4-down-81eef98-h200.json`, and
again at 128 and 512 tokens on `a652043`) finds them bound by instruction issue at about
20% of DRAM bandwidth: some 9.5 thread instructions a weight value, most of them moving
bytes into the operand layout. Here the weights are stored once, at load, in the order the
``mma.sync.m16n8k16`` A operand holds them (the weights as the left operand, 16 rows by 16
K a product, tokens as the right operand): a lane's 16 contiguous bytes are its 32 values
of 16 rows by 64 K (four products), so a warp reads 512 contiguous bytes a step and no
value goes through shared memory. K is permuted the same way for weights and activations
(real k = 64c + 16t + 4j + q for chunk c, lane column t, product j, place q) so that a
lane's activation values for a chunk are 32 contiguous bytes. A 32-bit word of 8 nibbles
becomes four bf16 pairs in 3-4 integer instructions each (sign to bit 15, the three
exponent and mantissa bits to bits 6-8: the E2M1 value times 2^-126, subnormal included),
and one bf16 multiply a pair applies the scale and the 2^126 together (2^(s-1): scales up
to 128, which the shuffle checks). gpt-oss's gate and up rows (interleaved in w13) are
stored as rows g and g + 8 of a 16-row block, so a lane holds a feature's gate and up for
the same tokens and applies the clamped GLU and biases in registers; down applies its
bias and routing weight. Prediction: about 3 thread instructions a value, the gate/up
projection at 128-512 tokens 2.5-3x faster than opsdb's (1.07 / 1.51 ms at 128 / 512),
which would carry the 120b slice's full arm past #31's 1.93x over eager.

Built with torch.utils.cpp_extension.load_inline (nvcc, ninja) for sm_90. Per token count:
CUDA-graph device ms of opsdb's kernels and of this one over a sweep of its tiles, and the
largest difference between their rows. JSON in $OUT/moe-mxfp4-cuda.json. Without a GPU:
the stored order decoded as the kernel decodes it (the same integer and bf16 operations in
torch) and placed as the product reads it equals the dequantized weights."""

import os
import sys

import torch

from graphcap.opsdb import reference
from graphcap.opsdb.triton import moe_routing

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;  // a * b + (-0): exact for a power-of-two b
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Nibbles P and P + 4 of q as a bf16 pair (low, high), each the E2M1 value times 2^-126.
template <int P>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t q) {
  const uint32_t t = q << (12 - 4 * P);
  return (t & 0x80008000u) | ((t & 0x70007000u) >> 6);
}

// 2^(s - 1) as a bf16 pair: the E8M0 scale 2^(s - 127) times the decode's 2^126.
__device__ __forceinline__ uint32_t scale_pair(uint32_t s) {
  const uint32_t v = (s + 126u) << 7;
  return v | (v << 16);
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

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
      const uint32_t q = word(k.w[r], j);
      const uint32_t a0 = bf16x2_mul(e2m1_pair<0>(q), s_g);
      const uint32_t a1 = bf16x2_mul(e2m1_pair<1>(q), s_g8);
      const uint32_t a2 = bf16x2_mul(e2m1_pair<2>(q), s_g);
      const uint32_t a3 = bf16x2_mul(e2m1_pair<3>(q), s_g8);
#pragma unroll
      for (int m = 0; m < MB; ++m)
        mma(acc[r][m], a0, a1, a2, a3, word(k.x[m][j >> 1], 2 * (j & 1)),
            word(k.x[m][j >> 1], 2 * (j & 1) + 1));
    }
  }
}

// MODE 0: gpt-oss's gate/up (rows g and g + 8 of a block: a feature's gate and up),
// biases and clamped GLU, out [pairs, N / 2]. MODE 1: down, bias, times the routing
// weight, out [pairs, N]. A tile: 8 * MB padded rows of one expert; a warp: RB blocks of
// 16 weight rows over all K, a chunk (64 K) loaded while the one before is multiplied.
template <int MODE, int MB, int RB>
__global__ void __launch_bounds__(256) experts_kernel(
    const __nv_bfloat16* __restrict__ x, int64_t x_stride, const uint4* __restrict__ w,
    const uint16_t* __restrict__ s, const __nv_bfloat16* __restrict__ bias,
    const int* __restrict__ sorted_pairs, const int* __restrict__ cum_padded,
    const float* __restrict__ topk_weights, __nv_bfloat16* __restrict__ out,
    int64_t out_stride, int num_pairs, int num_experts, int top_k, int row_blocks,
    int chunks, float alpha, float limit) {
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
          const int f = 8 * rb + g;  // the feature: w13 rows 2f (gate), 2f + 1 (up)
          const __nv_bfloat16* b = bias + (int64_t)e * 16 * row_blocks + 2 * f;
          float gate = acc[r][m][col] + __bfloat162float(b[0]);
          float up = acc[r][m][2 + col] + __bfloat162float(b[1]);
          if (limit > 0.f) {
            gate = fminf(gate, limit);
            up = fminf(fmaxf(up, -limit), limit);
          }
          const float h = (up + 1.f) * gate / (1.f + __expf(-alpha * gate));
          out[(int64_t)pair * out_stride + f] = __float2bfloat16(h);
        } else {
          const float wt = topk_weights[pair];
          for (int half = 0; half < 2; ++half) {
            const int n = 16 * rb + g + 8 * half;
            const float b = __bfloat162float(bias[(int64_t)e * 16 * row_blocks + n]);
            const float y = (acc[r][m][2 * half + col] + b) * wt;
            out[(int64_t)pair * out_stride + n] = __float2bfloat16(y);
          }
        }
      }
    }
  }
}

}  // namespace

void experts(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor bias,
             torch::Tensor sorted_pairs, torch::Tensor cum_padded, torch::Tensor topk_weights,
             torch::Tensor out, int64_t mode, int64_t mb, int64_t rb, int64_t warps,
             int64_t num_pairs, int64_t top_k, int64_t row_blocks, int64_t chunks,
             double alpha, double limit) {
  const int num_experts = cum_padded.numel();
  const dim3 grid((sorted_pairs.numel() + 8 * mb - 1) / (8 * mb),
                  (row_blocks + warps * rb - 1) / (warps * rb));
  const dim3 block(32 * warps);
  auto stream = at::cuda::getCurrentCUDAStream();
#define GRAPHCAP_LAUNCH(MODE, MB, RB)                                                       \
  if (mode == MODE && mb == MB && rb == RB) {                                               \
    experts_kernel<MODE, MB, RB><<<grid, block, 0, stream>>>(                               \
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0),                  \
        reinterpret_cast<const uint4*>(w.data_ptr()),                                       \
        reinterpret_cast<const uint16_t*>(s.data_ptr()),                                    \
        reinterpret_cast<const __nv_bfloat16*>(bias.data_ptr()),                            \
        sorted_pairs.data_ptr<int>(), cum_padded.data_ptr<int>(),                           \
        topk_weights.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),   \
        out.stride(0), (int)num_pairs, num_experts, (int)top_k, (int)row_blocks,            \
        (int)chunks, (float)alpha, (float)limit);                                           \
    return;                                                                                 \
  }
  GRAPHCAP_LAUNCH(0, 1, 1) GRAPHCAP_LAUNCH(0, 1, 2) GRAPHCAP_LAUNCH(0, 1, 4)
  GRAPHCAP_LAUNCH(0, 2, 1) GRAPHCAP_LAUNCH(0, 2, 2) GRAPHCAP_LAUNCH(0, 2, 4)
  GRAPHCAP_LAUNCH(1, 1, 1) GRAPHCAP_LAUNCH(1, 1, 2) GRAPHCAP_LAUNCH(1, 1, 4)
  GRAPHCAP_LAUNCH(1, 2, 1) GRAPHCAP_LAUNCH(1, 2, 2) GRAPHCAP_LAUNCH(1, 2, 4)
  TORCH_CHECK(false, "no kernel for mode ", mode, " mb ", mb, " rb ", rb);
}
"""

CPP_SOURCE = """
void experts(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor bias,
             torch::Tensor sorted_pairs, torch::Tensor cum_padded, torch::Tensor topk_weights,
             torch::Tensor out, int64_t mode, int64_t mb, int64_t rb, int64_t warps,
             int64_t num_pairs, int64_t top_k, int64_t row_blocks, int64_t chunks,
             double alpha, double limit);
"""


def row_order(rows: int, interleaved: bool) -> torch.Tensor:
    """The stored rows' original rows: gpt-oss's gate row 2f and up row 2f + 1 of the 8
    features of a block as its rows g and g + 8."""
    if not interleaved:
        return torch.arange(rows)
    block, i = torch.arange(rows) // 16, torch.arange(rows) % 16
    feature = 8 * block + i % 8
    return 2 * feature + (i >= 8).long()


# Nibble n of a lane's word: the block's row g + 8 * (n & 1), product place q.
NIBBLE_ROW = torch.tensor([n & 1 for n in range(8)])
NIBBLE_PLACE = torch.tensor([((n >> 1) & 1) * 2 + (n >> 2) for n in range(8)])


def shuffle(w: torch.Tensor, s: torch.Tensor, interleaved: bool):
    """MXFP4 rows ``w`` [E, N, K / 2] (low nibble first) and scales ``s`` [E, N, K / 32] in
    the kernel's order: bytes [E, N / 16, K / 64, 32 lanes, 16] and scales
    [E, N / 16, K / 64, 8 (g), 2 (group of the chunk), 2 (rows g, g + 8)]."""
    e, n, kb = w.shape
    k = 2 * kb
    assert n % 16 == 0 and k % 64 == 0, (n, k)
    if int(s.max()) > 128:
        raise ValueError("the kernel folds 2^126 into the scale: scales above 128 overflow")
    order = row_order(n, interleaved).to(w.device)
    w, s = w[:, order], s[:, order]
    nib = torch.stack([w & 15, w >> 4], -1).reshape(e, n // 16, 2, 8, k // 64, 4, 4, 4)
    # nib[e, R, half, g, c, t, j, q]; a lane (g, t), word j, nibble n: half n & 1, place q(n)
    nib = nib.permute(0, 1, 4, 3, 5, 6, 2, 7)  # [e, R, c, g, t, j, half, q]
    idx = (NIBBLE_ROW * 4 + NIBBLE_PLACE).to(w.device)
    nib = nib.reshape(*nib.shape[:6], 8)[..., idx]  # [e, R, c, g, t, j, n]
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)  # [.., j, 4 bytes]
    packed = packed.reshape(e, n // 16, k // 64, 32, 16).contiguous()
    sc = s.reshape(e, n // 16, 2, 8, k // 64, 2).permute(0, 1, 4, 3, 5, 2)
    return packed, sc.contiguous()


def decode_as_kernel(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The stored order decoded with the kernel's integer and bf16 operations and placed
    where its products read each value: the weights [E, N, K] (stored rows, real K), as
    float32."""
    e, blocks, chunks = packed.shape[:3]
    b = packed.view(e, blocks, chunks, 8, 4, 4, 4).to(torch.int64)  # [e, R, c, g, t, j, byte]
    q = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    out = torch.empty(e, blocks, 2, 8, chunks, 4, 4, 4)  # [e, R, half, g, c, t, j, place]
    for p in range(4):
        t_ = (q << (12 - 4 * p)) & 0xFFFFFFFF
        pair = (t_ & 0x80008000) | ((t_ & 0x70007000) >> 6)
        half = p & 1  # pairs 0 and 2: row g; 1 and 3: row g + 8
        s_ = scales[:, :, :, :, [0, 0, 1, 1], half].to(torch.int64)  # lane column t's group
        scale = bf16_of((s_ + 126) << 7).unsqueeze(-1)  # [e, R, c, g, t, 1]
        for hi in range(2):  # nibble p (low half) and p + 4 (high half)
            value = bf16_of((pair >> (16 * hi)) & 0xFFFF) * scale
            out[:, :, half, :, :, :, :, (p >> 1) * 2 + hi] = value.float().permute(
                0, 1, 3, 2, 4, 5)
    return out.reshape(e, blocks * 16, chunks * 64)


def bf16_of(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64 tensor) as bf16 values."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(
        torch.bfloat16)


def layout_check() -> None:
    """The stored order, decoded as the kernel decodes it, is the dequantized weights."""
    torch.manual_seed(0)
    e, n, k = 3, 64, 192
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    s = torch.randint(115, 129, (e, n, k // 32), dtype=torch.uint8)
    for interleaved in (False, True):
        packed, scales = shuffle(w, s, interleaved)
        got = decode_as_kernel(packed, scales)
        order = row_order(n, interleaved)
        want = torch.stack([reference.mxfp4_dequantize(w[i], s[i]) for i in range(e)])
        assert torch.equal(got, want[:, order].float()), (got - want[:, order]).abs().max()
    print("layout: the stored order decodes to the dequantized weights, both row orders")


_MODULE = []
_STORED: dict = {}


def module():
    """The extension (built once a process; nvcc and ninja)."""
    if not _MODULE:
        from torch.utils.cpp_extension import load_inline
        _MODULE.append(load_inline(
            "graphcap_mxfp4_probe", CPP_SOURCE, CUDA_SOURCE, functions=["experts"],
            extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo"]))
    return _MODULE[0]


def stored(w, s, interleaved):
    """The kernel's order of ``w`` and ``s``, made once (at load, in a model)."""
    key = (w.data_ptr(), s.data_ptr(), interleaved)
    if key not in _STORED:
        _STORED[key] = shuffle(w, s, interleaved)
    return _STORED[key]


def launch(mode, x, w, s, bias, weights, ids, out, tiles, alpha=0.0, limit=0.0):
    experts, rows, kb = w.shape
    packed, scales = stored(w, s, mode == 0)
    sorted_pairs, cum_padded = moe_routing.align_pairs(ids, experts, tiles["m"])
    module().experts(x, packed, scales, bias, sorted_pairs, cum_padded, weights, out, mode,
                     tiles["m"] // 8, tiles["rb"], tiles["warps"], ids.numel(), ids.shape[1],
                     rows // 16, 2 * kb // 64, float(alpha), float(limit))
    return out


def gate_up(x, w13, s13, b13, ids, alpha, limit, tiles):
    """gpt-oss's gate/up rows [T * k, I] (bf16) by the kernel."""
    out = torch.empty(ids.numel(), w13.shape[1] // 2, dtype=torch.bfloat16, device=x.device)
    unused = torch.empty(1, dtype=torch.float32, device=x.device)
    return launch(0, x, w13, s13, b13, unused, ids, out, tiles, alpha, limit)


def down(inter, w2, s2, b2, weights, ids, tiles):
    """The down rows [T * k, H] (bf16), each times its routing weight, by the kernel."""
    out = torch.empty(ids.numel(), w2.shape[1], dtype=torch.bfloat16, device=inter.device)
    return launch(1, inter, w2, s2, b2, weights.reshape(-1).float().contiguous(), ids, out,
                  tiles)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe_mxfp4_decode import compare_tiles

    sweep = [dict(m=m, rb=rb, warps=w) for m in (8, 16) for rb in (1, 2, 4) for w in (4, 8)]
    compare_tiles(gate_up, down, sweep,
                  "gpt-oss-120b's MXFP4 gate/up and down: opsdb's tl.dot_scaled kernels against "
                  "a CUDA kernel decoding E2M1 into mma.sync register operands (weights stored "
                  "in the operand order)", "moe-mxfp4-cuda")


if __name__ == "__main__":
    if torch.cuda.is_available():
        main()
    else:
        layout_check()
