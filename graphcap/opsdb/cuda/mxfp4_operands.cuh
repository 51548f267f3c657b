// E2M1 bytes in the mma.sync A-operand order (graphcap/opsdb/mxfp4.py) to bf16 operand
// registers, and the product: shared by moe_mxfp4.cu and the probes that vary its tiles.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace graphcap_mxfp4 {

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;  // a * b + (-0): exact for a power-of-two b
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// q shifted left by S bits (right by -S): a right shift as a high multiply, so that it and
// most left shifts issue to the FMA pipe beside the masks on the integer one.
template <int S>
__device__ __forceinline__ uint32_t shifted(uint32_t q) {
  return S > 0 ? q << S : S < 0 ? __umulhi(q, 1u << (32 + S)) : q;
}

// A register of a lane's word as bf16 bits (low, high), each the E2M1 value times 2^-126:
// its magnitudes (to bits 6-8 and 22-24) shifted by MAG, its signs (to 15 and 31) by SIGN
// (graphcap/opsdb/mxfp4.py: SHIFTS places them so).
template <int MAG, int SIGN>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t q) {
  return (shifted<MAG>(q) & 0x01c001c0u) | (shifted<SIGN>(q) & 0x80008000u);
}

// 2^(s - 1) as a bf16 pair: the E8M0 scale 2^(s - 127) times the decode's 2^126.
// One multiply-add (FMA pipe): (s + 126) << 7 in both halves.
__device__ __forceinline__ uint32_t scale_pair(uint32_t s) { return s * 0x00800080u + 0x3f003f00u; }

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

// Word q of a lane's 16 bytes (one product's 8 values: rows g and g + 8) as the A operand,
// times the rows' scales (scale_pair of row g's and row g + 8's E8M0 byte).
__device__ __forceinline__ void operand(uint32_t q, uint32_t s_g, uint32_t s_g8,
                                        uint32_t (&a)[4]) {
  a[0] = bf16x2_mul(e2m1_pair<0, 0>(q), s_g);
  a[1] = bf16x2_mul(e2m1_pair<6, 6>(q), s_g8);
  a[2] = bf16x2_mul(e2m1_pair<3, 2>(q), s_g);
  a[3] = bf16x2_mul(e2m1_pair<-4, 1>(q), s_g8);
}

}  // namespace graphcap_mxfp4
