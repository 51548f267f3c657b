// MXFP4 experts whose weights are stored in the tensor-core A-operand order
// (graphcap/opsdb/mxfp4.py: operand_order): a warp reads a 16-row block's 64-value chunk as
// 512 contiguous bytes, 16 a lane, and decodes each lane's E2M1 values straight into its
// bf16 operand registers; the scale (and the decode's 2^126) is one bf16 multiply a pair.
// Tokens are the right operand. experts_kernel: mma.sync, 8 tokens a product, its lanes'
// activations from global memory; a tile of 8 or 16 rows of one expert (32 in the sweep's
// build) reads each of its weights once. experts_wgmma_kernel (Hopper): warpgroup products
// of 32 or 64 tokens, the activations staged in shared memory, so an expert's weights are
// decoded once for all its rows. align_kernel groups the routing for both. Built on first
// use (graphcap/opsdb/cuda/__init__.py).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "mxfp4_operands.cuh"
#include "wgmma.cuh"

namespace {

using namespace graphcap_mxfp4;

// The expert of the tile starting at padded row `row0` (cum_padded: each expert's end).
__device__ __forceinline__ int expert_of(const int* cum_padded, int num_experts, int row0,
                                         int lane) {
  int e = 0;
  for (int base = 0; base < num_experts; base += 32) {
    const int i = base + lane;
    e += __popc(__ballot_sync(0xffffffffu, i < num_experts && cum_padded[i] <= row0));
  }
  return e;
}

// One column of a 16-row block's products: rows g (v_g) and g + 8 (v_g8) for `pair`.
// MODE 0: a feature's gate and up (rows g and g + 8 of the block), biases (b13's rows in
// the published order: interleaved or halves), SwiGLU or gpt-oss's clamped GLU (alpha > 0),
// out [pairs, N / 2]. MODE 1: down, bias, times the routing weight, out [pairs, N].
template <int MODE>
__device__ __forceinline__ void store(float v_g, float v_g8, int pair, int rb, int g, int e,
                                      const __nv_bfloat16* __restrict__ bias,
                                      const float* __restrict__ topk_weights,
                                      __nv_bfloat16* __restrict__ out, int64_t out_stride,
                                      int num_pairs, int row_blocks, bool interleaved,
                                      float alpha, float limit) {
  if (pair >= num_pairs) return;
  const __nv_bfloat16* b = bias == nullptr ? nullptr : bias + (int64_t)e * 16 * row_blocks;
  if (MODE == 0) {
    const int f = 8 * rb + g;
    float gate = v_g, up = v_g8;
    if (b != nullptr) {
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
    const int n = 16 * rb + g;
    const float b_g = b == nullptr ? 0.f : __bfloat162float(b[n]);
    const float b_g8 = b == nullptr ? 0.f : __bfloat162float(b[n + 8]);
    out[(int64_t)pair * out_stride + n] = __float2bfloat16((v_g + b_g) * wt);
    out[(int64_t)pair * out_stride + n + 8] = __float2bfloat16((v_g8 + b_g8) * wt);
  }
}

template <int RB, int MB>
struct Chunk {
  uint4 w[RB];
  uint32_t s[RB], x[MB][8];
};

// Chunk c's weight bytes, scales and activations (rows past the tile's pairs read row 0):
// product j's right operand is K 16j + 2t (+1) and 16j + 8 + 2t (+1) of the chunk.
template <int RB, int MB>
__device__ __forceinline__ void load(Chunk<RB, MB>& k, const uint4* const (&wp)[RB],
                                     const uint32_t* const (&sp)[RB],
                                     const __nv_bfloat16* const (&xp)[MB], int c) {
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    k.w[r] = __ldg(wp[r] + c * 32);
    k.s[r] = __ldg(sp[r] + c * 8);
  }
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      k.x[m][i] = __ldg(reinterpret_cast<const uint32_t*>(xp[m] + c * 64 + 8 * i));
}

// Product j's scales: the chunk's group j / 2 of 32, rows g and g + 8 (a lane's four bytes:
// [group, row]).
__device__ __forceinline__ void scales(uint32_t s, int j, uint32_t& s_g, uint32_t& s_g8) {
  const uint32_t at = 2 * (j >> 1);  // the group's row g byte; row g + 8's follows
  s_g = scale_pair(__byte_perm(s, 0, 0x4440u | at));
  s_g8 = scale_pair(__byte_perm(s, 0, 0x4440u | (at + 1)));
}

template <int RB, int MB>
__device__ __forceinline__ void compute(float (&acc)[RB][MB][4], const Chunk<RB, MB>& k) {
#pragma unroll
  for (int r = 0; r < RB; ++r) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4], s_g, s_g8;
      scales(k.s[r], j, s_g, s_g8);
      operand(word(k.w[r], j), s_g, s_g8, a);
#pragma unroll
      for (int m = 0; m < MB; ++m)
        mma(acc[r][m], a[0], a[1], a[2], a[3], k.x[m][2 * j], k.x[m][2 * j + 1]);
    }
  }
}

// Both expert kernels' parameters (the launch passes them in this order).
#define GRAPHCAP_EXPERTS_PARAMS                                                              \
  const __nv_bfloat16 *__restrict__ x, int64_t x_stride, const uint4 *__restrict__ w,        \
      const uint32_t *__restrict__ s, const __nv_bfloat16 *__restrict__ bias,                \
      const int *__restrict__ sorted_pairs, const int *__restrict__ cum_padded,              \
      const float *__restrict__ topk_weights, __nv_bfloat16 *__restrict__ out,               \
      int64_t out_stride, int num_pairs, int num_experts, int top_k, int row_blocks,         \
      int chunks, bool interleaved, float alpha, float limit

// MODE as store's. A tile: 8 * MB padded rows of one expert; a warp: RB blocks of
// 16 weight rows over all K, a chunk (64 K) loaded while the one before is multiplied.
template <int MODE, int MB, int RB>
__global__ void __launch_bounds__(256) experts_kernel(GRAPHCAP_EXPERTS_PARAMS) {
  constexpr int BM = 8 * MB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * BM;
  const int e = expert_of(cum_padded, num_experts, row0, lane);
  if (row0 >= cum_padded[num_experts - 1]) return;
  const int rb0 = (blockIdx.y * warps + warp) * RB;
  if (rb0 >= row_blocks) return;

  const __nv_bfloat16* xp[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    const int pair = sorted_pairs[row0 + 8 * m + g];
    const int64_t xrow = pair < num_pairs ? (MODE == 0 ? pair / top_k : pair) : 0;
    xp[m] = x + xrow * x_stride + 2 * t;
  }
  const uint4* wp[RB];
  const uint32_t* sp[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int rb = min(rb0 + r, row_blocks - 1);
    const int64_t first = ((int64_t)e * row_blocks + rb) * chunks;
    wp[r] = w + first * 32 + lane;
    sp[r] = s + first * 8 + g;
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

#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int rb = rb0 + r;
    if (rb >= row_blocks) break;
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int col = 0; col < 2; ++col)
        store<MODE>(acc[r][m][col], acc[r][m][2 + col], sorted_pairs[row0 + 8 * m + 2 * t + col],
                    rb, g, e, bias, topk_weights, out, out_stride, num_pairs, row_blocks,
                    interleaved, alpha, limit);
  }
}

// A warpgroup tile's accumulators (its warps' BLK row blocks rbs, N = 8 * MB columns) to
// out by store<MODE>.
#define GRAPHCAP_STORE_ARGS                                                                \
  sorted_pairs, bias, topk_weights, out, out_stride, num_pairs, row_blocks, interleaved,  \
      alpha, limit
template <int MODE, int MB, int BLK>
__device__ __forceinline__ void store_tile(const float (&acc)[BLK][4 * MB], const int (&rbs)[BLK],
                                           int row0, int t, int g, int e,
                                           const int* __restrict__ sorted_pairs,
                                           const __nv_bfloat16* __restrict__ bias,
                                           const float* __restrict__ topk_weights,
                                           __nv_bfloat16* __restrict__ out, int64_t out_stride,
                                           int num_pairs, int row_blocks, bool interleaved,
                                           float alpha, float limit) {
#pragma unroll
  for (int b = 0; b < BLK; ++b) {
    if (rbs[b] >= row_blocks) break;
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int col = 0; col < 2; ++col)
        store<MODE>(acc[b][4 * m + col], acc[b][4 * m + 2 + col],
                    sorted_pairs[row0 + 8 * m + 2 * t + col], rbs[b], g, e, bias,
                    topk_weights, out, out_stride, num_pairs, row_blocks, interleaved, alpha,
                    limit);
  }
}

// The row block (of 16 weight rows) of a warpgroup tile's warp `warp`, its block b of BLK.
template <int BLK, int WG>
__device__ __forceinline__ int row_block(int warp, int b) {
  return ((blockIdx.y * WG + (warp >> 2)) * BLK + b) * 4 + (warp & 3);
}

// Pins every accumulator (zeroing it first where `zero`): the compiler sees only the
// asynchronous products' issue, so reads and writes must not move across them.
template <int BLK, int M>
__device__ __forceinline__ void pin_all(float (&acc)[BLK][M], bool zero) {
#pragma unroll
  for (int b = 0; b < BLK; ++b)
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (zero) acc[b][i] = 0.f;
      graphcap_wgmma::pin(acc[b][i]);
    }
}

// A step of a warpgroup tile: each block's weights (wr) and scales (sr) decoded into
// operand registers a, then multiplied by the stage's activations (descriptor d) into acc,
// one committed group. All of the step's operands are decoded before its first product:
// ptxas serializes products whose register operands are written while products run.
template <int MB, int BLK>
__device__ __forceinline__ void decode_multiply(float (&acc)[BLK][4 * MB],
                                                const uint4 (&wr)[BLK],
                                                const uint32_t (&sr)[BLK],
                                                uint32_t (&a)[BLK][4][4], uint64_t d) {
  namespace wg = graphcap_wgmma;
#pragma unroll
  for (int b = 0; b < BLK; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t s_g, s_g8;
      scales(sr[b], j, s_g, s_g8);
      operand(word(wr[b], j), s_g, s_g8, a[b][j]);
#pragma unroll
      for (int i = 0; i < 4; ++i) wg::pin(a[b][j][i]);
    }
  wg::fence();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int b = 0; b < BLK; ++b)
      wg::product<8 * MB>(acc[b], a[b][j], d + ((2 * j * MB * 128) >> 4));
  wg::commit();
}

// A compile-time int argument (the warpgroup loop's stage and chunk offset).
template <int K>
struct Const {
  static constexpr int value = K;
};

// f(Const<0>{}), ..., f(Const<COUNT - 1>{}), in order.
template <int... I>
struct Ints {};
template <int COUNT, int... I>
struct Count : Count<COUNT - 1, COUNT - 1, I...> {};
template <int... I>
struct Count<0, I...> {
  using type = Ints<I...>;
};
template <typename F, int... I>
__device__ __forceinline__ void each(F&& f, Ints<I...>) {
  (f(Const<I>{}), ...);
}
template <int COUNT, typename F>
__device__ __forceinline__ void each(F&& f) {
  each(f, typename Count<COUNT>::type{});
}

#ifndef GRAPHCAP_WGMMA_STAGES  // at most this many stages
#define GRAPHCAP_WGMMA_STAGES 4
#endif
#ifndef GRAPHCAP_WGMMA_SMEM  // in at most this many bytes of shared memory
#define GRAPHCAP_WGMMA_SMEM (48 * 1024)
#endif

// A warpgroup tile's stage: the activations (N = 8 * MB rows of a chunk), then each warp's
// BLK blocks of weights and of scales; BYTES of dynamic shared memory for STAGES of them.
template <int MB, int BLK, int WG>
struct WgmmaStages {
  static constexpr int THREADS = 128 * WG, WEIGHTS = MB * 8 * 128;
  static constexpr int SCALES = WEIGHTS + THREADS * BLK * 16, STAGE = SCALES + THREADS * BLK * 4;
  static constexpr int STAGES = GRAPHCAP_WGMMA_SMEM / STAGE < GRAPHCAP_WGMMA_STAGES
                                    ? GRAPHCAP_WGMMA_SMEM / STAGE : GRAPHCAP_WGMMA_STAGES;
  static constexpr int BYTES = STAGES * STAGE;
  static_assert(STAGES >= 2, "a warpgroup tile's stages exceed its shared memory");
};

// MODE as store's, on Hopper's warpgroup products (sm_90a). A tile: N = 8 * MB padded rows
// of one expert. A step: one chunk (64 K). A warpgroup: BLK blocks of 64 weight rows (its
// warps' 16 each). A chunk's activations (core matrices of 8 rows of 16 bytes) and each
// lane's weights and scales are copied to shared memory (dynamic: WgmmaStages' BYTES)
// STAGES - 1 steps ahead, into STAGES stages that the loop (STAGES steps a turn) addresses
// by constants; a step's weights are decoded into operand registers once and multiplied by
// all N rows in one product a 16-K step.
template <int MODE, int MB, int BLK, int WG>
__global__ void __launch_bounds__(128 * WG) experts_wgmma_kernel(GRAPHCAP_EXPERTS_PARAMS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace wg = graphcap_wgmma;
  using Tile = WgmmaStages<MB, BLK, WG>;
  constexpr int N = 8 * MB, THREADS = Tile::THREADS, PIECES = N * 8;
  constexpr int PER = (PIECES + THREADS - 1) / THREADS;
  constexpr int WEIGHTS = Tile::WEIGHTS, SCALES = Tile::SCALES, STAGE = Tile::STAGE;
  constexpr int STAGES = Tile::STAGES, AHEAD = STAGES - 1;  // chunks the copies run ahead
  extern __shared__ __align__(128) uint8_t xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * N;
  const int e = expert_of(cum_padded, num_experts, row0, lane);
  if (row0 >= cum_padded[num_experts - 1]) return;

  // This thread's 16-byte pieces of a chunk: row n, K offset 8 * kc, at its core matrix.
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(xs);
  const __nv_bfloat16* src[PER];
  uint32_t dst[PER];
  bool valid[PER], mine[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int p = threadIdx.x + i * THREADS, n = (p >> 6) * 8 + (p & 7), kc = (p >> 3) & 7;
    mine[i] = p < PIECES;
    const int pair = mine[i] ? sorted_pairs[row0 + n] : num_pairs;
    valid[i] = pair < num_pairs;
    const int64_t xrow = valid[i] ? (MODE == 0 ? pair / top_k : pair) : 0;
    src[i] = x + xrow * x_stride + 8 * kc;
    dst[i] = wg::opaque(base + (kc * MB + (p >> 6)) * 128 + (p & 7) * 16);
  }
  const uint4* wp[BLK];
  const uint32_t* sp[BLK];
  int rbs[BLK];
#pragma unroll
  for (int b = 0; b < BLK; ++b) {
    rbs[b] = row_block<BLK, WG>(warp, b);
    const int64_t first = ((int64_t)e * row_blocks + min(rbs[b], row_blocks - 1)) * chunks;
    wp[b] = w + first * 32 + lane;
    sp[b] = s + first * 8 + g;
  }
  const uint32_t wdst = wg::opaque(base + WEIGHTS + threadIdx.x * BLK * 16);
  const uint32_t sdst = wg::opaque(base + SCALES + threadIdx.x * BLK * 4);
  // Copies of the turn's chunk k (of the pointers') into stage S (an empty group past the
  // last chunk).
  auto stage = [&](auto s, auto k, bool live) {
    constexpr int S = decltype(s)::value, K = decltype(k)::value;
    if (live) {
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if (mine[i]) wg::copy16(dst[i] + S * STAGE, src[i] + 64 * K, valid[i]);
#pragma unroll
      for (int b = 0; b < BLK; ++b) {
        wg::copy16(wdst + S * STAGE + b * 16, wp[b] + 32 * K);
        wg::copy4(sdst + S * STAGE + b * 4, sp[b] + 8 * K);
      }
    }
    wg::copy_commit();
  };

  float acc[BLK][N / 2];
  pin_all(acc, true);

  const uint64_t desc0 = wg::descriptor(base, MB * 128, 128);
  uint32_t a[BLK][4][4];
  // Chunk c, the turn's step k (its stage).
  auto step = [&](auto k, int c) {
    constexpr int K = decltype(k)::value;
    wg::copy_wait<AHEAD - 1>();
    __syncthreads();  // chunk c in place; every warpgroup done with chunk c - 1's stage
    stage(Const<(K + AHEAD) % STAGES>{}, Const<K + AHEAD>{}, c + AHEAD < chunks);
    const uint8_t* wbuf = xs + K * STAGE + WEIGHTS + threadIdx.x * BLK * 16;
    const uint8_t* sbuf = xs + K * STAGE + SCALES + threadIdx.x * BLK * 4;
    uint4 wr[BLK];
    uint32_t sr[BLK];
#pragma unroll
    for (int b = 0; b < BLK; ++b) {
      wr[b] = reinterpret_cast<const uint4*>(wbuf)[b];
      sr[b] = reinterpret_cast<const uint32_t*>(sbuf)[b];
    }
    decode_multiply<MB, BLK>(acc, wr, sr, a, desc0 + (uint64_t)((K * STAGE) >> 4));
    wg::wait<0>();
  };

  each<AHEAD>([&](auto k) { stage(k, k, decltype(k)::value < chunks); });
  for (int c = 0; c < chunks; c += STAGES) {  // a turn: the pointers' chunks 0 to STAGES - 1
    each<STAGES>([&](auto k) {
      if (c + decltype(k)::value < chunks) step(k, c + decltype(k)::value);
    });
#pragma unroll
    for (int b = 0; b < BLK; ++b) {
      wp[b] += STAGES * 32;
      sp[b] += STAGES * 8;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) src[i] += STAGES * 64;
  }
  pin_all(acc, false);

  store_tile<MODE, MB, BLK>(acc, rbs, row0, t, g, e, GRAPHCAP_STORE_ARGS);
#endif
}

// moe_routing.align_pairs's contract in one CTA: each expert's pairs grouped (in any order
// within the expert), its rows padded to a multiple of `block`; sorted_pairs' other rows n.
// A pair of an id outside [0, num_experts) is in no group (the sum skips it).
template <typename Id>
__global__ void __launch_bounds__(1024) align_kernel(const Id* __restrict__ ids, int n,
                                                     int num_experts, int block,
                                                     int* __restrict__ sorted_pairs,
                                                     int capacity, int* __restrict__ cum_padded) {
  extern __shared__ int next[];  // an expert's count, then its next row
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) next[i] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    const Id e = ids[p];
    if (e >= 0 && e < num_experts) atomicAdd(&next[e], 1);
  }
  for (int i = threadIdx.x; i < capacity; i += blockDim.x) sorted_pairs[i] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int end = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int count = next[e];
      next[e] = end;
      end += (count + block - 1) / block * block;
      cum_padded[e] = end;
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    const Id e = ids[p];
    if (e >= 0 && e < num_experts) sorted_pairs[atomicAdd(&next[e], 1)] = p;
  }
}

}  // namespace

// Launch KERNEL (a grid of `tiles` by `blocks` CTAs of `threads`, SMEM bytes of dynamic
// shared memory) where COND holds.
#define GRAPHCAP_LAUNCH(COND, SMEM, ...)                                                   \
  if (COND) {                                                                              \
    if ((SMEM) > 48 * 1024)                                                                \
      C10_CUDA_CHECK(cudaFuncSetAttribute(__VA_ARGS__,                                     \
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM)); \
    __VA_ARGS__<<<dim3(tiles, blocks), threads, SMEM, stream>>>(                           \
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0),                \
        reinterpret_cast<const uint4*>(w.data_ptr()),                                      \
        reinterpret_cast<const uint32_t*>(s.data_ptr()), bias_ptr,                         \
        sorted_pairs.data_ptr<int>(), cum_padded.data_ptr<int>(),                          \
        topk_weights.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), \
        out.stride(0), (int)num_pairs, num_experts, (int)top_k, row_blocks, chunks,       \
        interleaved, (float)alpha, (float)limit);                                          \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                        \
    return;                                                                                \
  }
#define GRAPHCAP_MMA(MODE, MB, RB) \
  GRAPHCAP_LAUNCH(mode == MODE && mb == MB && a == RB, 0, experts_kernel<MODE, MB, RB>)
#define GRAPHCAP_WGMMA(MODE, MB, BLK, WG)                                      \
  GRAPHCAP_LAUNCH(mode == MODE && mb == MB && a == BLK && b == WG,             \
                  (WgmmaStages<MB, BLK, WG>::BYTES), experts_wgmma_kernel<MODE, MB, BLK, WG>)

#define GRAPHCAP_EXPERTS_ARGS                                                              \
  torch::Tensor x, torch::Tensor w, torch::Tensor s, c10::optional<torch::Tensor> bias,   \
      torch::Tensor sorted_pairs, torch::Tensor cum_padded, torch::Tensor topk_weights,    \
      torch::Tensor out, int64_t mode, int64_t mb, int64_t a, int64_t b, int64_t num_pairs, \
      int64_t top_k, bool interleaved, double alpha, double limit

#define GRAPHCAP_EXPERTS_SETUP                                                             \
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&       \
                  x.stride(0) % 8 == 0 && x.size(1) == w.size(2) * 64,                     \
              "x: bf16 rows of the weights' K, contiguous along K, 16-byte aligned");      \
  TORCH_CHECK(w.dim() == 5 && w.is_contiguous() && s.is_contiguous() && out.stride(1) == 1, \
              "weights and scales in operand order, contiguous");                          \
  const int num_experts = cum_padded.numel();                                              \
  const int row_blocks = w.size(1), chunks = w.size(2);                                    \
  const __nv_bfloat16* bias_ptr = bias.has_value()                                         \
      ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;                \
  /* Tiles past the rows in use return at once (their first row is at or past the last    \
     entry of cum_padded, a multiple of the tile), so none reads past sorted_pairs. */    \
  const int tiles = (sorted_pairs.numel() + 8 * mb - 1) / (8 * mb);                        \
  auto stream = at::cuda::getCurrentCUDAStream();

// mma.sync tiles: 8 * mb rows, a = row blocks a warp, b = warps.
void experts(GRAPHCAP_EXPERTS_ARGS) {
  GRAPHCAP_EXPERTS_SETUP
  const int blocks = (row_blocks + a * b - 1) / (a * b), threads = 32 * b;
#ifdef GRAPHCAP_MXFP4_SWEEP  // every tile, for docs/notes/probes/moe_mxfp4_cuda.py
#define GRAPHCAP_MMA_RB(MODE, MB) \
  GRAPHCAP_MMA(MODE, MB, 1) GRAPHCAP_MMA(MODE, MB, 2) GRAPHCAP_MMA(MODE, MB, 4)
  GRAPHCAP_MMA_RB(0, 1) GRAPHCAP_MMA_RB(0, 2) GRAPHCAP_MMA_RB(0, 4)
  GRAPHCAP_MMA_RB(1, 1) GRAPHCAP_MMA_RB(1, 2) GRAPHCAP_MMA_RB(1, 4)
#else  // the tiles moe.py picks
  GRAPHCAP_MMA(0, 1, 2) GRAPHCAP_MMA(0, 2, 4) GRAPHCAP_MMA(1, 1, 2) GRAPHCAP_MMA(1, 2, 4)
#endif
  TORCH_CHECK(false, "no MXFP4 experts kernel for mode ", mode, ", ", 8 * mb, " rows, ", a,
              " row blocks a warp, ", b, " warps");
}

// Warpgroup tiles (sm_90a builds only): 8 * mb rows, a = 64-row blocks a warpgroup,
// b = warpgroups.
void experts_wgmma(GRAPHCAP_EXPERTS_ARGS) {
  GRAPHCAP_EXPERTS_SETUP
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major == 9 && props->minor == 0,
              "the warpgroup MXFP4 experts kernel runs on compute capability 9.0 (sm_90a)");
  const int blocks = (row_blocks + 4 * a * b - 1) / (4 * a * b);
  const int threads = 128 * b;
#ifdef GRAPHCAP_MXFP4_SWEEP
#define GRAPHCAP_WGMMA_TILES(MODE, MB) \
  GRAPHCAP_WGMMA(MODE, MB, 1, 1) GRAPHCAP_WGMMA(MODE, MB, 1, 2) GRAPHCAP_WGMMA(MODE, MB, 2, 1) \
  GRAPHCAP_WGMMA(MODE, MB, 2, 2)
  GRAPHCAP_WGMMA_TILES(0, 2) GRAPHCAP_WGMMA_TILES(0, 4) GRAPHCAP_WGMMA_TILES(0, 8)
  GRAPHCAP_WGMMA_TILES(1, 2) GRAPHCAP_WGMMA_TILES(1, 4) GRAPHCAP_WGMMA_TILES(1, 8)
#else
  GRAPHCAP_WGMMA(0, 4, 1, 2) GRAPHCAP_WGMMA(0, 8, 1, 2) GRAPHCAP_WGMMA(1, 4, 1, 2)
  GRAPHCAP_WGMMA(1, 8, 1, 2)
#endif
  TORCH_CHECK(false, "no warpgroup MXFP4 experts kernel for mode ", mode, ", ", 8 * mb,
              " rows, ", a, " blocks a warpgroup, ", b, " warpgroups");
}

// (sorted_pairs [n + E * (block - 1)], cum_padded [E]) of top-k expert ids (int32 or int64).
std::vector<torch::Tensor> align(torch::Tensor topk_ids, int64_t num_experts, int64_t block) {
  TORCH_CHECK(topk_ids.is_cuda() && topk_ids.is_contiguous() &&
                  (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "topk_ids: contiguous int32 or int64 on the GPU");
  TORCH_CHECK(num_experts > 0 && num_experts <= 12288 && block > 0,
              "1 to 12288 experts and a positive block");
  const int n = topk_ids.numel(), capacity = n + num_experts * (block - 1);
  auto opts = topk_ids.options().dtype(at::kInt);
  auto sorted_pairs = torch::empty({capacity}, opts);
  auto cum_padded = torch::empty({num_experts}, opts);
  auto stream = at::cuda::getCurrentCUDAStream();
  const size_t smem = num_experts * sizeof(int);
  if (topk_ids.scalar_type() == at::kInt)
    align_kernel<int><<<1, 1024, smem, stream>>>(topk_ids.data_ptr<int>(), n, num_experts, block,
        sorted_pairs.data_ptr<int>(), capacity, cum_padded.data_ptr<int>());
  else
    align_kernel<int64_t><<<1, 1024, smem, stream>>>(topk_ids.data_ptr<int64_t>(), n,
        num_experts, block, sorted_pairs.data_ptr<int>(), capacity, cum_padded.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sorted_pairs, cum_padded};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts", &experts);
  m.def("experts_wgmma", &experts_wgmma);
  m.def("align", &align);
}
