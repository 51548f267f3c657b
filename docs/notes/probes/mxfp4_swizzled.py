"""MXFP4 weights stored so that a thread's loaded bytes are its tensor-core operand
registers (device side, and on the CPU):

    PYTHONPATH=. python3 docs/notes/probes/mxfp4_swizzled.py            # H200: timing
    TRITON_INTERPRET=1 PYTHONPATH=. python3 docs/notes/probes/mxfp4_swizzled.py check
    PYTHONPATH=. python3 docs/notes/probes/mxfp4_swizzled.py ttgir      # sm_90, no GPU

One expert's projection ``y = x @ dequant(W)^T`` (x [M, K] bf16, M <= 16; W [N, K] E2M1
packed two to a byte along K, an E8M0 scale per 32 values) with the weights as the
left operand of the product. In the stored order (``swizzle``) each run of 16
consecutive bytes of a row holds exactly the values one thread of a warp needs in the
A-operand registers of Hopper's register-A tensor-core product (16-row blocks; a thread's
two rows 8 apart and its two pairs of K 8 apart, over four 16-wide K steps): the kernel
loads the bytes in 128-bit pieces, decodes each nibble into bf16 (its three bits placed
in bf16's exponent and mantissa: the value times 2^-126, subnormals exact), and a
reshape and permute give the [N, K] tile whose layout the compiler can take from the
load unchanged. ``natural`` stores W as it comes ([N, K/2]); its decode is the same.
A third variant decodes the stored order four bytes an inline-PTX block (the device
only: the interpreter runs no PTX).

``check``: both kernels against the dequantized reference on small shapes (the
interpreter). ``ttgir``: compiles both for sm_90 and reports how the byte tile reaches
the product (the shared-memory load's bytes per register run, the conversions).
Timing: gpt-oss-120b's gate/up and down shapes at 1, 4 and 16 rows, both kernels beside
a bf16 matmul of the same weights, weights cycled past L2. JSON in
$OUT/mxfp4-swizzled.json."""

import json
import os
import re
import sys

import torch
import triton
import triton.language as tl


def swizzle(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] packed E2M1 (value k in byte k // 2, the low nibble for even k) ->
    [N/4, 2K]. Value (n, k) with n = 16B + 8g + 2j + d and k = 64C + 16t + 8h + 2q + e
    lands in row 4B + j, byte 128C + 64d + 16q + 4t + 2h + g (nibble e): the 16 bytes
    at 16q of a 64-byte run are lane q of row group j's values."""
    n, half = packed.shape
    assert n % 16 == 0 and half % 32 == 0, (n, half)
    b, c = n // 16, half // 32
    v = packed.view(b, 2, 4, 2, c, 4, 2, 4)  # B g j d C t h q
    return v.permute(0, 2, 4, 3, 7, 5, 6, 1).reshape(n // 4, 4 * half)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K/2] E2M1 and [N, K/32] E8M0 -> [N, K] float32."""
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32,
                         device=packed.device)
    table = torch.cat([table, -table])
    lo, hi = table[(packed & 15).long()], table[(packed >> 4).long()]
    w = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    return w * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)


@triton.jit
def _e2m1_bf16(nibble, INTERPRET: tl.constexpr):
    """E2M1 in the low four bits -> bf16 times 2^-126 (its bits placed in bf16's; under
    the interpreter, which flushes bf16 subnormals and multiplies bit-cast bf16 as
    integers, computed in float32 instead)."""
    if INTERPRET:
        e = ((nibble >> 1) & 3).to(tl.float32)
        mant = (nibble & 1).to(tl.float32)
        v = tl.where(e == 0, 0.5 * mant, tl.exp2(e - 1.0) * (1.0 + 0.5 * mant))
        return tl.where((nibble & 8) != 0, -v, v) * 1.1754943508222875e-38  # 2^-126
    bits = ((nibble & 7).to(tl.uint16) << 6) | ((nibble & 8).to(tl.uint16) << 12)
    return bits.to(tl.bfloat16, bitcast=True)


def _e2m1_ptx(shift: int, sign_shift: int) -> str:
    """Inline PTX: four bytes of ``$4`` -> their low nibbles' values in ``$0, $1`` and
    their high nibbles' in ``$2, $3`` (two 16-bit values a register, in element order).
    Each nibble's three value bits are masked from bytes 0 and 2 (then 1 and 3, a byte
    down) and shifted by ``shift`` (``shift - 4`` for the high nibble), its sign bit by
    ``sign_shift`` (``sign_shift - 4``): two values an instruction; a byte permute puts
    them in order."""
    lines = [".reg .b32 w8, a0, a1, t;", "shr.b32 w8, $4, 8;"]
    for out, (mask, sign, up, up_sign) in ((0, (0x00070007, 0x00080008, shift, sign_shift)),
                                           (2, (0x00700070, 0x00800080, shift - 4,
                                                sign_shift - 4))):
        for reg, src in (("a0", "$4"), ("a1", "w8")):
            lines.append(f"and.b32 {reg}, {src}, {mask:#010x}; shl.b32 {reg}, {reg}, {up}; "
                         f"and.b32 t, {src}, {sign:#010x}; shl.b32 t, t, {up_sign}; "
                         f"or.b32 {reg}, {reg}, t;")
        lines += [f"prmt.b32 ${out}, a0, a1, 0x5410;", f"prmt.b32 ${out + 1}, a0, a1, 0x7632;"]
    return "{\n" + "\n".join(lines) + "\n}"


# bf16: the three bits at 6..8 (exponent's low two, mantissa's top), the sign at 15.
_E2M1_BF16_PTX = tl.constexpr(_e2m1_ptx(6, 12))


@triton.jit
def _decode(b, ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """Bytes ``b`` -> [..., 2] bf16 (low nibble, high nibble), times 2^-126."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16_PTX, "=r,=r,=r,=r,r", [b],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    else:
        lo, hi = _e2m1_bf16(b, INTERPRET), _e2m1_bf16(b >> 4, INTERPRET)
    return tl.join(lo, hi)


@triton.jit
def stored_tile(W, row0, stride_w, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """Weight rows ``row0 ..`` (``BLOCK_N`` of them, ``row0`` a multiple of 16), K
    ``k0 ..`` (``BLOCK_K``, a multiple of 64) of ``swizzle``'s order: [BLOCK_N, BLOCK_K]
    bf16 times 2^-126."""
    rows = row0 // 4 + tl.arange(0, BLOCK_N // 4)
    cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
    v = _decode(tl.load(W + rows[:, None] * stride_w + cols[None, :]), ASM, INTERPRET)
    v = tl.reshape(v, (BLOCK_N // 16, 4, BLOCK_K // 64, 2, 4, 4, 2, 2, 2))
    v = tl.permute(v, (0, 7, 1, 3, 2, 5, 6, 4, 8))  # B g j d C t h q e
    return tl.reshape(v, (BLOCK_N, BLOCK_K))


@triton.jit
def scaled_product(w, S, n, stride_s, k0, x, acc, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + (w * 2^(scale - 1)) @ x``: ``w`` a decoded tile (times 2^-126), its rows'
    E8M0 scales read from ``S`` (row stride ``stride_s``) for K ``k0 ..``."""
    s = tl.load(S + n[:, None] * stride_s + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :])
    # 2^(s - 127) for the scale, 2^126 for the decode's bias: 2^(s - 1), as bf16
    # (exact for s <= 128; past it the weights' scale would overflow bf16 anyway).
    if INTERPRET:
        f = tl.exp2(s.to(tl.float32) - 1.0)
    else:
        f = (s.to(tl.uint16) + 126 << 7).to(tl.bfloat16, bitcast=True)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)),
                   (BLOCK_N, BLOCK_K))
    if INTERPRET:  # its bf16 products multiply the bits
        return tl.dot(w * f, x.to(tl.float32), acc)
    return tl.dot((w * f).to(tl.bfloat16), x, acc)


@triton.jit
def _gemm_kernel(W, S, X, Y, N, K, stride_w, stride_s, stride_x, stride_y, M,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 SWIZZLED: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if SWIZZLED:
            w = stored_tile(W, pid * BLOCK_N, stride_w, k0, BLOCK_N, BLOCK_K, ASM, INTERPRET)
        else:
            b = tl.load(W + n[:, None] * stride_w + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
            w = tl.reshape(_decode(b, ASM, INTERPRET), (BLOCK_N, BLOCK_K))  # [n, k/2, 2]
        x = tl.load(X + m[None, :] * stride_x + (k0 + ks)[:, None], mask=(m < M)[None, :],
                    other=0.0)
        acc = scaled_product(w, S, n, stride_s, k0, x, acc, BLOCK_N, BLOCK_K, INTERPRET)
    tl.store(Y + m[None, :] * stride_y + n[:, None], acc.to(Y.dtype.element_ty),
             mask=(m < M)[None, :] & (n < N)[:, None])


def gemm(x, stored, scales, n: int, swizzled: bool, block_n: int | None = None,
         block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
         asm: bool = False):
    """``x @ dequant(W)^T``: N a multiple of the column block and K of 64 (the weights
    are read without masks)."""
    m, k = x.shape
    block_n = block_n or (128 if n % 128 == 0 else 64)
    block_k = block_k or (128 if k % 128 == 0 else 64)
    assert n % block_n == 0 and k % block_k == 0, (n, k, block_n, block_k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(n, block_n),)](
        stored, scales, x, y, n, k, stored.stride(0), scales.stride(0), x.stride(0),
        y.stride(0), m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=16, SWIZZLED=swizzled,
        ASM=asm, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps,
        num_stages=num_stages)
    return y


def weights(n: int, k: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 129, (n, k // 32), generator=g, dtype=torch.uint8)
    return packed.to(device), scales.to(device)


def check() -> None:
    for n, k, m in ((32, 128, 3), (64, 256, 16), (128, 128, 1), (64, 192, 5)):
        packed, scales = weights(n, k, "cpu", seed=n + k)
        x = torch.randn(m, k).to(torch.bfloat16)
        want = x.float() @ dequantize(packed, scales).t()
        for swz in (False, True):
            stored = swizzle(packed) if swz else packed
            got = gemm(x, stored, scales, n, swz, block_n=min(n, 64))
            err = (got.float() - want).abs().max().item() / want.abs().max().item()
            print(f"n={n} k={k} m={m} swizzled={swz}: max error {err:.2e} of the largest")
            assert err < 1e-2, err


VARIANTS = {"natural": (False, False), "swizzled": (True, False),
            "swizzled, PTX decode": (True, True)}  # name: (swizzled, asm)


def ttgir() -> dict:
    """Each variant compiled for sm_90 (BLOCK_N 128, BLOCK_K 128, 16 rows): how its byte
    tile is read from shared memory and what one loop body's PTX holds."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"W": "*u8", "S": "*u8", "X": "*bf16", "Y": "*bf16", "N": "i32", "K": "i32",
           "stride_w": "i32", "stride_s": "i32", "stride_x": "i32", "stride_y": "i32",
           "M": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "BLOCK_M": "constexpr",
           "SWIZZLED": "constexpr", "ASM": "constexpr", "INTERPRET": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 8, 9)}
    out = {}
    for name, (swz, asm) in VARIANTS.items():
        src = ASTSource(_gemm_kernel, sig, attrs=attrs, constexprs={
            "BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_M": 16, "SWIZZLED": swz, "ASM": asm,
            "INTERPRET": False})
        asm_out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4, "num_stages": 3}).asm
        ir, ptx = asm_out["ttgir"], asm_out["ptx"]
        layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
        loads = re.findall(r"ttg.local_load .*-> tensor<\w+xi8, (#\w+)>", ir)
        runs = []
        for layout in loads:  # the register bases of the byte tile's shared-memory load
            bases = re.search(r"register = \[(.*?)\], lane", layouts.get(layout, ""))
            runs.append(bases.group(1) if bases else layouts.get(layout))
        out[name] = {
            "byte_tile_register_bases": runs,
            "register_a_products": len(re.findall(
                r"warp_group_dot %\w+, .*dot_op<\{opIdx = 0", ir)),
            "ptx": {op: ptx.count(op) for op in (
                "ld.shared.v4", "ld.shared.b8", "st.shared", "shfl", "wgmma.mma_async",
                "prmt", "cvt", "and.b32", "shl.b32")}}
    print(json.dumps(out, indent=1))
    return out


def timing() -> dict:
    from graphcap.bench.common import environment
    from graphcap.bench.timing import cycled_ms

    dev = torch.device("cuda")
    rows = []
    for name, n, k in (("gate/up", 5760, 2880), ("down", 2880, 2880)):
        copies = 16
        sets = [weights(n, k, dev, seed=i) for i in range(copies)]
        swz = [(swizzle(p), s) for p, s in sets]
        dense = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(4)]
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            arms = {name: [lambda p=p, s=s, x=x, n=n, z=z, a=a: gemm(x, p, s, n, z, asm=a)
                           for p, s in (swz if z else sets)]
                    for name, (z, a) in VARIANTS.items()}
            arms["bf16 cuBLAS"] = [lambda w=w, x=x: x @ w.t() for w in dense]
            ms = {a: round(cycled_ms(calls), 5) for a, calls in arms.items()}
            nbytes = n * k // 2 + n * k // 32
            row = {"proj": name, "n": n, "k": k, "rows": m, "ms": ms,
                   "fp4_tb_s": {a: round(nbytes / (ms[a] * 1e-3) / 1e12, 2)
                                for a in VARIANTS},
                   "max_error_vs_reference": {
                       a: float((gemm(x, *(swz if z else sets)[0], n, z, asm=asm).float()
                                 - x.float() @ dequantize(*sets[0]).t()).abs().max())
                       for a, (z, asm) in VARIANTS.items()}}
            print(row, flush=True)
            rows.append(row)
    return {"what": "MXFP4 weights stored as the tensor cores' operand registers",
            **environment(), "rows": rows}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "time"
    if mode == "check":
        check()
    elif mode == "ttgir":
        ttgir()
    else:
        record = timing()
        record["ttgir"] = ttgir()
        with open(os.path.join(os.environ.get("OUT", "."), "mxfp4-swizzled.json"), "w") as f:
            json.dump(record, f, indent=1)
