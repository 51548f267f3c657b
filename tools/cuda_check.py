"""Compile opsdb's CUDA MXFP4 expert kernels for sm_90a without a GPU or nvcc, and report
each instantiation's registers, stack and loop instructions a weight value:

    .venv/bin/python tools/cuda_check.py [--define NAME=VALUE] [--tiles 0:1:2,0:4:1:2] \
        [--sass OUT.sass]

NVRTC (``nvidia-cuda-nvrtc-cu12``) compiles the kernel part of
``graphcap/opsdb/cuda/moe_mxfp4.cu`` (its headers inlined, the torch wrapper left out) to
PTX and ptxas (``nvidia-cuda-nvcc-cu12``) to a cubin; the wheels (about 50 MB, with the
runtime's and CCCL's headers) are fetched from PyPI once into ~/.cache/graphcap-cuda-check.
``--tiles`` lists MODE:MB:RB (``mma.sync``) or MODE:MB:BLK:WG (warpgroup) tiles (default:
every tile of the sweep's build); ``--define NAME=VALUE`` sets a macro (a variant under
test, as the probes' ``PROBE_VARIANTS`` build them). The loop figure is the instructions
of the longest backward branch holding the products, over the weight values a warp
decodes in it (16 x 16 a product): a static count, no timing. ptxas's warnings and its
notes of lost performance (serialized warpgroup products) follow the table."""

import argparse
import collections
import ctypes
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "graphcap-cuda-check"
WHEELS = ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12",
          "nvidia-cuda-cccl-cu12")
SIGNATURE = ("const __nv_bfloat16*, int64_t, const uint4*, const uint32_t*, "
             "const __nv_bfloat16*, const int*, const int*, const float*, __nv_bfloat16*, "
             "int64_t, int, int, int, int, int, bool, float, float")


def toolkit() -> Path:
    """The unpacked wheels (fetched on first use)."""
    nvidia = CACHE / "nvidia"
    if not (nvidia / "cuda_nvrtc").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--platform", "manylinux2014_x86_64",
                        "--python-version", "3.11", "-d", str(CACHE), *WHEELS], check=True)
        for wheel in CACHE.glob("nvidia_cuda_*.whl"):
            zipfile.ZipFile(wheel).extractall(CACHE)
        (nvidia / "cuda_nvcc" / "bin" / "ptxas").chmod(0o755)  # zip keeps no mode bits
    return nvidia


def instance(tile) -> str:
    """A tile's kernel: MODE, MB, RB (mma.sync) or MODE, MB, BLK, WG (warpgroup)."""
    name = "experts_kernel" if len(tile) == 3 else "experts_wgmma_kernel"
    return f"{name}<{', '.join(str(v) for v in tile)}>"


def source(tiles, defines) -> str:
    cuda = ROOT / "graphcap" / "opsdb" / "cuda"
    headers = "\n".join(line for name in ("mxfp4_operands.cuh", "wgmma.cuh")
                        for line in (cuda / name).read_text().splitlines()
                        if not line.startswith("#"))
    text = (cuda / "moe_mxfp4.cu").read_text()
    kernels = text[text.index("namespace {"):text.index("}  // namespace\n\n")]
    instances = "\n".join(f"template __global__ void {instance(t)}({SIGNATURE});"
                          for t in tiles)
    return ("#include <cuda/std/cstdint>\nusing cuda::std::uint32_t; using cuda::std::uint16_t;"
            " using cuda::std::int64_t; using cuda::std::uint64_t; using cuda::std::uint8_t;\n"
            "#include <cuda_bf16.h>\n"
            + "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + headers + "\n"
            + kernels.replace("namespace {", "namespace check {") + instances + "\n}\n")


def compile_ptx(nvidia: Path, code: str, names: list[str]) -> tuple[bytes, dict[str, str]]:
    nvrtc = ctypes.CDLL(str(next((nvidia / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*"))))
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"k.cu", 0, None,
                                    None) == 0
    for name in names:
        nvrtc.nvrtcAddNameExpression(prog, name.encode())
    opts = [b"--gpu-architecture=compute_90a", b"-std=c++17", b"-default-device",
            f"-I{nvidia / 'cuda_runtime' / 'include'}".encode(),
            f"-I{nvidia / 'cuda_cccl' / 'include'}".encode()]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(f"NVRTC failed:\n{log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    lowered = {}
    for name in names:
        out = ctypes.c_char_p()
        nvrtc.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out))
        lowered[name] = out.value.decode()
    return ptx.value, lowered


def loop_count(sass: str) -> tuple[int, collections.Counter]:
    """Instructions inside the longest backward branch holding the products (HMMA) of one
    function's SASS."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in lines]
    best: list[str] = []
    for line, here in zip(lines, addr, strict=True):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < here:
            start = int(m.group(1), 16)
            body = [ln for ln, a in zip(lines, addr, strict=True) if start <= a <= here]
            if any("MMA" in ln for ln in body) and len(body) > len(best):
                best = body  # the products' loop, not the epilogue's
    body = best
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line).group(1)
                              for line in body)
    return len(body), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--define", action="append", default=[])
    parser.add_argument("--tiles", default=None,
                        help="MODE:MB:RB or MODE:MB:BLK:WG (warpgroup), comma-separated "
                             "(default: every tile of the sweep's build)")
    parser.add_argument("--sass", default=None, help="write the SASS here")
    args = parser.parse_args()
    tiles = ([tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]
             if args.tiles else
             [(m, mb, rb) for m in (0, 1) for mb in (1, 2, 4) for rb in (1, 2, 4)]
             + [(m, mb, blk, wg) for m in (0, 1) for mb in (2, 4, 8)
                for blk, wg in ((1, 1), (1, 2), (2, 1), (2, 2))])
    nvidia = toolkit()
    names = [f"check::{instance(t)}" for t in tiles]
    ptx, lowered = compile_ptx(nvidia, source(tiles, args.define), names)
    (CACHE / "k.ptx").write_bytes(ptx)
    cubin = CACHE / "k.cubin"
    done = subprocess.run([str(nvidia / "cuda_nvcc" / "bin" / "ptxas"), "-arch=sm_90a", "-O3",
                           "-v", str(CACHE / "k.ptx"), "-o", str(cubin)],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"ptxas failed:\n{done.stderr}")
    cuobjdump = next(Path(sys.prefix).glob("lib/python3*/site-packages/triton/backends/"
                                           "nvidia/bin/cuobjdump"), None)
    sass = (subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True,
                           text=True).stdout if cuobjdump else "")
    if args.sass:
        Path(args.sass).write_text(sass)
    functions = dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s+Function : |\Z)", sass, re.S))
    for tile, name in zip(tiles, names, strict=True):
        mode, mb, rb = tile[:3]
        low = lowered[name]
        info = done.stderr[done.stderr.index(f"'{low}'"):]
        regs = re.search(r"Used (\d+) registers", info).group(1)
        stack = re.search(r"(\d+) bytes stack frame", info).group(1)
        shape = (f"{rb} blocks a warp" if len(tile) == 3
                 else f"{rb} 64-row blocks a warpgroup, {tile[3]} warpgroups")
        line = (f"{'gate/up' if mode == 0 else 'down':7} {8 * mb:2} rows, {shape}: "
                f"{regs:>3} registers, {stack:>3} bytes of stack")
        if low in functions:
            count, ops = loop_count(functions[low])
            # a warp's values in the loop: 16 x 16 a product (an mma.sync product's left
            # operand serves MB of them)
            values = 256 * (ops["HGMMA"] if len(tile) == 4 else ops["HMMA"] / mb)
            line += (f", loop {count} instructions, {count * 32 / values:.2f} a "
                     f"value ({', '.join(f'{k} {v}' for k, v in ops.most_common(5))})")
        print(line)
    warnings = [ln for ln in done.stderr.splitlines() if "arning" in ln or "Loss" in ln]
    print("\n".join(dict.fromkeys(warnings)) or "ptxas: no warnings")


if __name__ == "__main__":
    main()
