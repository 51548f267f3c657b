"""Registers and spills of graphcap's decode-path Triton kernels compiled for sm_90, per
mode and tile, with no GPU (host side):

    pip install --target /tmp/t36 --no-deps triton==3.6.0   # the H200's Triton
    PYTHONPATH=/tmp/t36:. python3 docs/notes/probes/kernel_registers.py [skinny|decode|gemv]

Each kernel is compiled by Triton to PTX for sm_90 and assembled by the ptxas Triton
ships (``ptxas -v``): registers a thread, bytes of spill stores and loads a thread, the
shared memory Triton asks for, and the product instruction (``wgmma`` or ``mma.sync``).
A spill is a read and write of local memory (L1, then L2) inside the loop. ``skinny``:
the few-row kernel (:mod:`graphcap.opsdb.triton.linear`) in each mode the decode path
runs, at 16 and 64 rows, over BLOCK_K and num_warps, today's tiles (``config``) marked;
``decode``: the decode attention kernel with and without the rotary, ``KEY_LATE`` and
``EARLY_V``, at its two block sizes; ``gemv``: the one-row form; ``pipeline``: the decode
attention kernel at each block size and ``num_stages`` 2 to 9, with what Triton's
pipeliner made of its loop over the row's pages (read from the compiled kernel's TTGIR):
the shared-memory buffers of its key and value blocks (one: the next block is asked for
only once this one's products are done; two or more: it is asked for while they run), of
its block-table slices, and the programs an SM holds by shared memory and registers. JSON in
$OUT/kernel-registers.json."""

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from graphcap.bench.common import environment
from graphcap.opsdb.triton import decode, gemv, linear

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
MODES = {"norm": (True, False, False), "norm+swiglu": (True, True, False),
         "residual": (False, False, True), "plain": (False, False, False)}


def compiled(kernel, sig: dict, consts: dict, options: dict, plain=(), ttgir=False) -> dict:
    """Registers, spills (bytes a thread), shared memory and product instruction. Every
    pointer and int argument but those in ``plain`` is taken as a multiple of 16 (bytes,
    elements), as a launch specialises them where they are: contiguous vectors then.
    ``ttgir``: the kernel's TTGIR too (what the pipeliner made of its loops)."""
    sig = {**sig, **{n: "constexpr" for n in consts}}
    sig = {name: sig[name] for name in kernel.arg_names if name in sig}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if sig[name][0] in "*i" and name not in plain}
    out = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options=options)
    ptx = out.asm["ptx"]
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([PTXAS, f"-arch={arch}", "-v", path, "-o", path + ".cubin"],
                              capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {**({"ttgir": out.asm["ttgir"]} if ttgir else {}),
            "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "shared": out.metadata.shared,
            "product": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx
            else "none"}


def skinny() -> list:
    sig = {**{n: "*bf16" for n in ("X", "W", "Y", "NORM_W", "RES", "BIAS")},
           "PARTIAL": "*fp32", "COUNTS": "*i32", "eps": "fp32",
           **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym",
                                  "stride_rm", "UP")}}
    rows = []
    for (mode, (norm, swiglu, residual)), m in itertools.product(MODES.items(), (16, 64)):
        n, k = (3072, 1024) if swiglu else (1024, 2048) if residual else (4096, 1024)
        today = linear.config(m, n, k, norm=norm, swiglu=swiglu, sms=132)
        tiles = [dict(today, BLOCK_K=bk, num_warps=w)
                 for bk, w in itertools.product((64, 128, 256), (4, 8))]
        for t in tiles:
            consts = {"BLOCK_M": t["BLOCK_M"], "BLOCK_N": t["BLOCK_N"],
                      "BLOCK_K": t["BLOCK_K"], "SPLIT_K": t["SPLIT_K"], "NORM": norm,
                      "SWIGLU": swiglu, "RESIDUAL": residual, "HAS_BIAS": False,
                      "IEEE": False, "INTERPRET": False, "PDL": True, "PREFETCH": True,
                      "LINE": 64, "NORM_LATE": False}
            got = compiled(linear._skinny_linear_kernel, sig, consts,
                           {"num_warps": t["num_warps"], "num_stages": t["num_stages"],
                            "launch_pdl": True}, plain=() if m % 16 == 0 else ("M",))
            rows.append({"kernel": "skinny", "mode": mode, "rows": m, "n": n, "k": k,
                         "tiles": t, "today": t == today, **got})
            print(rows[-1], flush=True)
    return rows


DECODE_SIG = {**{n: "*bf16" for n in ("q_ptr", "kc_ptr", "vc_ptr", "sinks_ptr", "out_ptr",
                                    "k_ptr", "v_ptr", "qw_ptr", "kw_ptr")},
           "table_ptr": "*i32", "lens_ptr": "*i32", "mid_o_ptr": "*fp32",
           "mid_lse_ptr": "*fp32", "counts_ptr": "*i32", "loc_ptr": "*i64",
           "pos_ptr": "*i64", "cs_ptr": "*fp32", "scale": "fp32", "softcap": "fp32",
           "eps": "fp32", **{n: "i32" for n in (
               "q_stride_b", "q_stride_h", "out_stride_b", "out_stride_h", "k_stride_b",
               "k_stride_h", "v_stride_b", "v_stride_h", "table_stride", "pos_stride",
               "cs_stride", "width", "kv_heads", "head_dim", "split_len", "window",
               "half", "pages", "cs_rows")}}
DECODE_PLAIN = ("table_stride", "pos_stride", "width", "kv_heads")


def decode_consts(block_n: int, **flags) -> dict:
    """qwen3-0.6b's decode step (GQA groups of 2, head dim 128, pages of 16 slots, its
    K/V written by the kernel) at ``block_n`` tokens a block."""
    return {"PAGE": 16, "GROUP": 2, "BLOCK_H": 16, "SPLITS": 8, "BLOCK_N": block_n,
            "BLOCK_D": 128, "WINDOW": False, "SOFTCAP": False, "SINKS": False,
            "WRITE": True, "ROPE": False, "HAS_NORM": False, "IEEE": False,
            "INTERPRET": False, "PDL": True, "EARLY_V": False, "KEY_LATE": False,
            "SPLIT_OF_LENGTH": True, "SPLIT_QUANTUM": 0, "CUDA_CORES": False,
            "AHEAD": False, **flags}


def decode_kernel() -> list:
    rows = []
    for (block_n, stages), (rope, late, early) in itertools.product(
            ((128, 3), (64, 2)), ((False, False, False), (True, False, False),
                                  (True, True, False), (False, False, True))):
        consts = decode_consts(block_n, ROPE=rope, HAS_NORM=rope, EARLY_V=early,
                               KEY_LATE=late)
        got = compiled(decode._decode_kernel, DECODE_SIG, consts,
                       {"num_warps": 4, "num_stages": stages, "launch_pdl": True},
                       plain=DECODE_PLAIN)
        rows.append({"kernel": "decode", "BLOCK_N": block_n, "num_stages": stages,
                     "rope": rope, "key_late": late, "early_v": early, **got})
        print(rows[-1], flush=True)
    for block_n, warps in ((32, 4), (64, 8)):  # the products in registers, two rows
        got = compiled(decode._decode_kernel, DECODE_SIG,
                       decode_consts(block_n, BLOCK_H=2, CUDA_CORES=True),
                       {"num_warps": warps, "num_stages": 2, "launch_pdl": True},
                       plain=DECODE_PLAIN)
        rows.append({"kernel": "decode", "BLOCK_N": block_n, "num_warps": warps,
                     "cuda_cores": True, **got})
        print(rows[-1], flush=True)
    return rows


def buffers(ttgir: str, shape: str) -> int:
    """How many shared-memory buffers the pipeliner gave the loads of tiles ``shape``
    (e.g. ``64x128xbf16``): the leading dimension of their allocation, 0 where none."""
    got = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{shape}\b", ttgir)
    return max(map(int, got), default=0)


def pipeline() -> list:
    rows = []
    for block_n, stages in itertools.product((32, 64, 128), range(2, 10)):
        if stages > 8 and block_n == 128:  # four 64 KB buffers: past the 227 KB an SM has
            continue
        got = compiled(decode._decode_kernel, DECODE_SIG, decode_consts(block_n),
                       {"num_warps": 4, "num_stages": stages, "launch_pdl": True},
                       plain=DECODE_PLAIN, ttgir=True)
        ttgir = got.pop("ttgir")
        per_sm = min(227 * 1024 // got["shared"], 65536 // (got["registers"] * 128))
        rows.append({"kernel": "decode", "BLOCK_N": block_n, "num_stages": stages,
                     "kv_buffers": buffers(ttgir, f"{block_n}x128xbf16"),
                     "table_buffers": buffers(ttgir, f"{block_n}xi32"),
                     "programs_per_sm": per_sm, **got})
        print(rows[-1], flush=True)
    return rows


def gemv_kernel() -> list:
    sig = {**{n: "*bf16" for n in ("X", "W", "Y", "NORM_W", "RES", "BIAS")},
           "eps": "fp32", **{n: "i32" for n in ("N", "K", "stride_xm", "stride_wn",
                                                 "stride_ym", "stride_rm", "UP")}}
    rows = []
    for (mode, (norm, swiglu, residual)), ahead in itertools.product(MODES.items(),
                                                                     (False, True)):
        k = 2048 if residual else 1024
        t = gemv.gemv_config(k)
        consts = {"ROWS": 1, "ROWS_P2": 2, "BLOCK_N": t["BLOCK_N"], "BLOCK_K": t["BLOCK_K"],
                  "NORM": norm, "SWIGLU": swiglu, "RESIDUAL": residual, "HAS_BIAS": False,
                  "INTERPRET": False, "PDL": True, "PREFETCH": False, "LINE": 64,
                  "PRELOAD": True, "W_CACHE": "", "NORM_LATE": False, "AHEAD": ahead}
        got = compiled(gemv._gemv_kernel, sig, consts,
                       {"num_warps": t["num_warps"], "launch_pdl": True})
        rows.append({"kernel": "gemv", "mode": mode, "k": k, "tiles": t, "ahead": ahead,
                     **got})
        print(rows[-1], flush=True)
    return rows


SURVEYS = {"skinny": skinny, "decode": decode_kernel, "gemv": gemv_kernel,
           "pipeline": pipeline}

if __name__ == "__main__":
    chosen = sys.argv[1:] or list(SURVEYS)
    out = {"what": "registers and spills of the decode path's Triton kernels for sm_90 "
                   "(ptxas -v of Triton's PTX; no GPU)", **environment(),
           "device": "none: compiled for sm_90 on the host", "target": "sm_90",
           "command": "PYTHONPATH=/tmp/t36:. python3 docs/notes/probes/kernel_registers.py "
                      + " ".join(sys.argv[1:]),
           "rows": [r for name in chosen for r in SURVEYS[name]()]}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "kernel-registers.json"), "w") as f:
        json.dump(out, f, indent=1)
