"""Triton's interpreter (the CPU tests) accepts code the GPU compiler refuses, such as a
variable whose type differs between the branches of a runtime ``if``. Kernels not yet
proven on the H200 are compiled here for sm_90, down to a cubin, without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

COMPILE_QKV = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphcap.opsdb.triton.qkv import _qkv_kernel

    for dt in ("bf16", "fp16", "fp32"):
        for norm in (True, False):
            ptrs = {name: f"*{dt}" for name in ("qkv_ptr", "qw_ptr", "kw_ptr", "q_ptr",
                                                "k_ptr", "v_ptr")}
            ints = {name: "i32" for name in ("qkv_stride", "pos_stride", "cache_stride",
                                             "n_q", "n_k", "head_size", "half")}
            sig = {**ptrs, **ints, "pos_ptr": "*i64", "cache_ptr": "*fp32", "eps": "fp32",
                   "HAS_NORM": "constexpr", "BLOCK_D": "constexpr"}
            sig = {name: sig[name] for name in _qkv_kernel.arg_names}
            src = ASTSource(_qkv_kernel, sig, constexprs={"HAS_NORM": norm, "BLOCK_D": 128})
            assert "cubin" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm
    print("compiled")
''')


def compiles(code: str) -> None:
    """Run ``code`` in a fresh process outside the interpreter; it prints 'compiled'."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_the_fused_qkv_kernel_compiles_for_sm90_in_every_dtype():
    compiles(COMPILE_QKV)


COMPILE_LINEAR = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphcap.opsdb.triton.linear import _skinny_linear_kernel as kernel

    # (NORM, SWIGLU, RESIDUAL, HAS_BIAS, SPLIT_K): every mode the ops use, split or not.
    modes = [(True, False, False, False, 1), (True, False, False, True, 1),
             (True, True, False, False, 1), (False, False, True, False, 1),
             (False, False, True, False, 4), (False, False, False, False, 2)]
    for dt in ("bf16", "fp32"):
        for norm, swiglu, residual, bias, split in modes:
            sig = {**{n: f"*{dt}" for n in ("X", "W", "Y", "NORM_W", "RES", "BIAS")},
                   "PARTIAL": "*fp32", "COUNTS": "*i32", "eps": "fp32",
                   **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn",
                                          "stride_ym", "stride_rm")}}
            consts = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": split,
                      "NORM": norm, "SWIGLU": swiglu, "RESIDUAL": residual,
                      "HAS_BIAS": bias, "IEEE": dt == "fp32", "INTERPRET": False}
            sig.update({n: "constexpr" for n in consts})
            sig = {name: sig[name] for name in kernel.arg_names}
            src = ASTSource(kernel, sig, constexprs=consts)
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4, "num_stages": 3})
            assert "cubin" in out.asm
    print("compiled")
''')


def test_the_fused_linear_kernel_compiles_for_sm90_in_every_mode():
    compiles(COMPILE_LINEAR)
