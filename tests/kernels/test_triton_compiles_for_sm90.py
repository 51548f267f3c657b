"""Triton's interpreter (the CPU tests) accepts code the GPU compiler refuses, such as a
variable whose type differs between the branches of a runtime ``if``. Kernels not yet
proven on the H200 are compiled here for sm_90, down to a cubin, without a GPU."""

from __future__ import annotations

import json
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

    for dt, pdl, heads in (("bf16", True, 1), ("bf16", False, 32), ("fp16", True, 32),
                           ("fp32", True, 1)):
        for norm in (True, False):
            ptrs = {name: f"*{dt}" for name in ("qkv_ptr", "qw_ptr", "kw_ptr", "q_ptr",
                                                "k_ptr", "v_ptr")}
            ints = {name: "i32" for name in ("qkv_stride", "pos_stride", "cache_stride",
                                             "cache_rows", "n_q", "n_k", "head_size",
                                             "half")}
            sig = {**ptrs, **ints, "pos_ptr": "*i64", "cache_ptr": "*fp32", "eps": "fp32",
                   "HAS_NORM": "constexpr", "BLOCK_H": "constexpr", "BLOCK_D": "constexpr",
                   "PDL": "constexpr"}
            sig = {name: sig[name] for name in _qkv_kernel.arg_names}
            src = ASTSource(_qkv_kernel, sig, constexprs={
                "HAS_NORM": norm, "BLOCK_H": heads, "BLOCK_D": 128, "PDL": pdl})
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"launch_pdl": pdl})
            assert "cubin" in out.asm
            assert ("griddepcontrol.wait" in out.asm["ptx"]) == pdl
    print("compiled")
''')

# The compiles run in a process of their own, one for the module (its imports of torch,
# Triton and graphcap made once): slow, and on one worker, which starts it once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sm90-compiles")]

# Runs each code string (a JSON object on stdin, name: code) in a namespace of its own;
# prints, last, each one's error (None where it ran and printed 'compiled').
RUN_EACH = textwrap.dedent('''
    import contextlib, io, json, sys, traceback

    errors = {}
    for name, code in json.load(sys.stdin).items():
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except BaseException:  # noqa: BLE001  the test of this code reports it
            errors[name] = traceback.format_exc()[-3000:]
        else:
            errors[name] = None if "compiled" in printed.getvalue() else "printed no 'compiled'"
    print("ERRORS " + json.dumps(errors))
''')


@pytest.fixture(scope="module")
def errors() -> dict:
    """Every code string of the module (``COMPILE_*``) run outside the interpreter in one
    fresh process: by name, None where it compiled, else its error."""
    codes = {name: code for name, code in globals().items() if name.startswith("COMPILE_")}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", RUN_EACH], input=json.dumps(codes), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ERRORS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("ERRORS "):])


def compiles(errors: dict, name: str) -> None:
    """The code string ``name`` ran outside the interpreter and printed 'compiled'."""
    assert name in errors, f"{name} did not run"
    assert errors[name] is None, errors[name]


def test_the_fused_qkv_kernel_compiles_for_sm90_in_every_dtype(errors):
    compiles(errors, "COMPILE_QKV")


COMPILE_LINEAR = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphcap.opsdb.triton.linear import _skinny_linear_kernel as kernel

    # (NORM, SWIGLU, RESIDUAL, HAS_BIAS, SPLIT_K): every mode the ops use, split or not.
    modes = [(True, False, False, False, 1), (True, False, False, True, 1),
             (True, True, False, False, 1), (False, False, True, False, 1),
             (False, False, True, False, 4), (False, False, False, False, 2)]
    # (dtype, PDL, PREFETCH): weights past PREFETCH_BYTES launch with PDL, unprefetched.
    for dt, pdl, prefetch in (("bf16", True, True), ("bf16", True, False),
                              ("bf16", False, False), ("fp32", True, True),
                              ("fp32", False, False)):
        for norm, swiglu, residual, bias, split in modes:
            sig = {**{n: f"*{dt}" for n in ("X", "W", "Y", "NORM_W", "RES", "BIAS")},
                   "PARTIAL": "*fp32", "COUNTS": "*i32", "eps": "fp32",
                   **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn",
                                          "stride_ym", "stride_rm")},
                   # the up half's offset: int64 past 2**31 elements
                   "UP": "i64" if swiglu else "i32"}
            consts = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": split,
                      "NORM": norm, "SWIGLU": swiglu, "RESIDUAL": residual,
                      "HAS_BIAS": bias, "IEEE": dt == "fp32", "INTERPRET": False,
                      "PDL": pdl, "PREFETCH": prefetch, "LINE": 64 if dt == "bf16" else 32,
                      "NORM_LATE": norm and split == 1 and not bias}
            sig.update({n: "constexpr" for n in consts})
            sig = {name: sig[name] for name in kernel.arg_names}
            src = ASTSource(kernel, sig, constexprs=consts)
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4, "num_stages": 3,
                                          "launch_pdl": pdl})
            assert "cubin" in out.asm
            ptx = out.asm["ptx"]
            # Under PDL: the next kernel released at once, the weights asked of L2, and
            # the wait for the previous kernel before x is read.
            assert ("griddepcontrol.launch_dependents" in ptx) == pdl
            assert ("prefetch.global.L2" in ptx) == prefetch
            if prefetch:
                assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
            if pdl:  # nothing read, written or counted before the first wait
                early = ptx[:ptx.index("griddepcontrol.wait")]
                assert not any(op in early for op in ("ld.global", "st.global", "atom.",
                                                       "red.", "cp.async")), early[-2000:]
    print("compiled")
''')


def test_the_fused_linear_kernel_compiles_for_sm90_in_every_mode(errors):
    compiles(errors, "COMPILE_LINEAR")


COMPILE_GEMV = textwrap.dedent('''
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphcap.opsdb.triton.gemv import _gemv_kernel as kernel

    # (NORM, SWIGLU, RESIDUAL, HAS_BIAS): every mode the ops use
    modes = [(True, False, False, False), (True, False, False, True),
             (True, True, False, False), (False, False, True, False)]
    # every mode at one row (what the ops dispatch), and more rows, PDL off, float32;
    # weights read after the wait (any tensor) and before it (parameters)
    cases = [("bf16", True, 1, mode, pre) for mode in modes for pre in (False, True)] + [
        ("bf16", True, 8, modes[3], False), ("bf16", False, 5, modes[2], False),
        ("fp32", True, 5, modes[0], True)]
    for dt, pdl, rows, (norm, swiglu, residual, bias), pre in cases:
        sig = {**{n: f"*{dt}" for n in ("X", "W", "Y", "NORM_W", "RES", "BIAS")},
               "eps": "fp32", **{n: "i32" for n in ("N", "K", "stride_xm",
                                                     "stride_wn", "stride_ym",
                                                     "stride_rm")},
               "UP": "i64" if swiglu else "i32"}
        consts = {"ROWS": rows, "ROWS_P2": max(2, triton.next_power_of_2(rows)),
                  "BLOCK_N": 2, "BLOCK_K": 1024, "NORM": norm, "SWIGLU": swiglu,
                  "RESIDUAL": residual, "HAS_BIAS": bias, "INTERPRET": False,
                  "PDL": pdl, "PREFETCH": pdl, "LINE": 64 if dt == "bf16" else 32,
                  "PRELOAD": pre, "W_CACHE": ".cg" if norm and pre else "",
                  "NORM_LATE": norm and not pre, "AHEAD": residual or rows == 5}
        sig.update({n: "constexpr" for n in consts})
        sig = {name: sig[name] for name in kernel.arg_names}
        out = triton.compile(ASTSource(kernel, sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "launch_pdl": pdl})
        assert "cubin" in out.asm
        ptx = out.asm["ptx"]
        assert ("griddepcontrol.launch_dependents" in ptx) == pdl
        assert ("prefetch.global.L2" in ptx) == (pdl and not pre)
        # W_CACHE=".cg": the weight slices loaded past L1 (ld.global.cg), x as before
        assert ("ld.global.cg" in ptx) == (consts["W_CACHE"] == ".cg"), consts
        if pdl:
            early = ptx[:ptx.index("griddepcontrol.wait")]
            # nothing written before the wait, nothing but a parameter's weights read
            # ("red." as an instruction, not the end of "shared.")
            assert not re.findall(r"\\b(st\\.global|atom\\.|red\\.)", early), early
            if pre:  # the weights' first slice read before the wait
                assert "ld.global" in early, early[-2000:]
            else:  # the weights asked of L2 before the wait; nothing read
                assert "prefetch.global.L2" in early, early[-2000:]
                assert not any(op in early for op in ("ld.global", "cp.async")), early
    print("compiled")
''')


def test_the_gemv_linear_kernel_compiles_for_sm90_reading_only_parameters_before_the_wait(errors):
    compiles(errors, "COMPILE_GEMV")


COMPILE_PDL_KERNELS = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphcap.opsdb.triton.attention import _attn_varlen_fwd
    from graphcap.opsdb.triton.counters import _zero_kernel
    from graphcap.opsdb.triton.norm import _fused_add_rms_norm_kernel, _rms_norm_kernel
    from graphcap.opsdb.triton.places import _places_kernel

    def build(kernel, types, consts):
        sig = {**types, **{n: "constexpr" for n in consts}}
        sig = {name: sig[name] for name in kernel.arg_names}
        out = triton.compile(ASTSource(kernel, sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32),
                             options={"launch_pdl": consts["PDL"]})
        ptx = out.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == consts["PDL"], kernel
        if consts["PDL"]:
            early = ptx[:ptx.index("griddepcontrol.wait")]
            assert not any(op in early for op in ("ld.global", "st.global", "atom.",
                                                   "red.", "cp.async")), kernel
        assert ("griddepcontrol.launch_dependents" in ptx) == consts["PDL"], kernel
        return ptx

    norm = {"BLOCK_H": 1024, "SINGLE_PASS": True, "N_CHUNKS": 1}
    ints = {n: "i32" for n in ("x_stride", "out_stride", "res_stride", "T", "H")}
    for pdl in (True, False):
        build(_zero_kernel, {"C": "*i32", "n": "i32"}, {"BLOCK": 1024, "PDL": pdl})
        for rows in (True, False):  # a decode step's places, rows and lengths; a prefill's
            build(_places_kernel, {"slots_ptr": "*i32", "pos_ptr": "*i64", "table_ptr": "*i32",
                                   "loc_ptr": "*i64", "rows_ptr": "*i32", "lens_ptr": "*i32",
                                   "requests": "i32", "width": "i32", "page_size": "i32",
                                   "null_page": "i32"},
                  {"BLOCK_W": 64, "ROWS": rows, "PDL": pdl})
        for ahead in (True, False) if pdl else (False,):
            ptx = build(_rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16",
                                           "out_ptr": "*bf16", "ahead_ptr": "*bf16",
                                           "ahead_lines": "i32", "eps": "fp32", **ints},
                        {**norm, "PDL": pdl, "AHEAD": ahead, "LINE": 64})
            # The next matmul's weight is asked of L2 before the wait, not after it.
            assert ("prefetch.global.L2" in ptx) == ahead
            if ahead:
                assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
        build(_fused_add_rms_norm_kernel, {"x_ptr": "*bf16", "res_ptr": "*bf16",
                                           "w_ptr": "*bf16", "eps": "fp32", **ints},
              {**norm, "PDL": pdl})
        strides = {f"stride_{t}{d}": "i32" for t in "qkvo" for d in "th"}
        for variant in (False, True):  # a window, soft-capping and sinks, or none
            build(_attn_varlen_fwd, {"Q": "*bf16", "K": "*bf16", "V": "*bf16",
                                     "Out": "*bf16", "CU": "*i32", "SINKS": "*bf16",
                                     "T": "i32", "qk_scale": "fp32", "sm_scale": "fp32",
                                     "window": "i32", "softcap": "fp32", "NUM_REQ": "i32",
                                     **strides},
                  {"GROUP": 2, "HEAD_DIM": 128, "BLOCK_D": 128, "EVEN_D": True,
                   "BLOCK_M": 16, "BLOCK_N": 16, "CAUSAL": True, "DOT_PRECISION": "tf32",
                   "INTERPRET": False, "PDL": pdl,
                   "WINDOW": variant, "SOFTCAP": variant, "HAS_SINKS": variant,
                   "WIDE": variant})  # int64 row offsets (long requests of wide rows)
    print("compiled")
''')


def test_the_kernels_on_the_pdl_path_compile_with_and_without_it(errors):
    """Each kernel a PDL launch may follow or precede: launched with it, it releases its
    successor and waits for its predecessor; launched without, it does neither."""
    compiles(errors, "COMPILE_PDL_KERNELS")


# The build of a kernel for sm90 (cubin), for the code strings below.
BUILD_SM90 = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(kernel, types, consts, pdl=False):
        sig = {**types, **{n: "constexpr" for n in consts}}
        sig = {name: sig[name] for name in kernel.arg_names}
        out = triton.compile(ASTSource(kernel, sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "launch_pdl": pdl})
        assert "cubin" in out.asm
        assert ("griddepcontrol.wait" in out.asm["ptx"]) == pdl

''')

COMPILE_DECODE = BUILD_SM90 + textwrap.dedent('''
    from graphcap.opsdb.triton.decode import _decode_kernel
    from graphcap.opsdb.triton.kv import _kv_write_kernel

    def DECODE_TYPES(dt):
        return {"q_ptr": f"*{dt}", "kc_ptr": f"*{dt}", "vc_ptr": f"*{dt}",
                "table_ptr": "*i32", "lens_ptr": "*i32", "sinks_ptr": "*fp32",
                "out_ptr": f"*{dt}", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
                "counts_ptr": "*i32", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}",
                "loc_ptr": "*i64", "pos_ptr": "*i64", "qw_ptr": f"*{dt}",
                "kw_ptr": f"*{dt}", "cs_ptr": "*fp32", "scale": "fp32",
                "softcap": "fp32", "eps": "fp32",
                **{n: "i32" for n in (
                    "q_stride_b", "q_stride_h", "out_stride_b", "out_stride_h",
                    "k_stride_b", "k_stride_h", "v_stride_b", "v_stride_h",
                    "table_stride", "pos_stride", "cs_stride", "width",
                    "kv_heads", "head_dim", "split_len", "window", "half", "pages",
                    "cs_rows")}}

    for dt in ("bf16", "fp16", "fp32"):
        build(_kv_write_kernel,
              {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "kc_ptr": f"*{dt}", "vc_ptr": f"*{dt}",
               "loc_ptr": "*i64", **{n: "i32" for n in (
                   "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h", "heads",
                   "head_dim", "slots")}},
              {"BLOCK_H": 8, "BLOCK_D": 128, "INTERPRET": False, "PDL": dt == "bf16"},
              pdl=dt == "bf16")
        for (page, group, splits), variant in zip(((16, 2, 8), (1, 1, 1), (16, 8, 1)),
                                                  (True, False, True)):
            for pdl in (True, False):
                # a decode step's write (with PDL), its rotary where pages are 16 slots,
                # the qk-norm at groups of 2 (qwen3-0.6b's)
                rope = pdl and page == 16
                build(_decode_kernel, DECODE_TYPES(dt),
                      {"PAGE": page, "GROUP": group, "BLOCK_H": 16, "SPLITS": splits,
                       "BLOCK_N": 64, "BLOCK_D": 128, "WINDOW": variant,
                       "SOFTCAP": variant, "SINKS": variant, "WRITE": pdl, "ROPE": rope,
                       "HAS_NORM": rope and group == 2, "IEEE": dt == "fp32",
                       "INTERPRET": False, "PDL": pdl, "EARLY_V": not pdl,
                       "KEY_LATE": group == 2, "SPLIT_OF_LENGTH": variant,
                       "SPLIT_QUANTUM": 16 if variant else 0,
                       "CUDA_CORES": False, "AHEAD": False}, pdl=pdl)
        # the products in registers, for a group of 2 (two rows, not 16)
        build(_decode_kernel, DECODE_TYPES(dt),
              {"PAGE": 16, "GROUP": 2, "BLOCK_H": 2, "SPLITS": 8, "BLOCK_N": 32,
               "BLOCK_D": 128, "WINDOW": True, "SOFTCAP": True, "SINKS": True,
               "WRITE": True, "ROPE": True, "HAS_NORM": True, "IEEE": dt == "fp32",
               "INTERPRET": False, "PDL": True, "EARLY_V": False, "KEY_LATE": True,
               "SPLIT_OF_LENGTH": True, "SPLIT_QUANTUM": 0, "CUDA_CORES": True,
               "AHEAD": True}, pdl=True)
    print("compiled")
''')


def test_the_paged_cache_write_and_decode_attention_kernels_compile_for_sm90(errors):
    compiles(errors, "COMPILE_DECODE")


COMPILE_MOE = BUILD_SM90 + textwrap.dedent('''
    from graphcap.opsdb.triton.moe import _moe_down_kernel, _moe_gate_up_kernel, _moe_sum_kernel
    from graphcap.opsdb.triton.moe_routing import _topk_softmax_kernel

    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    blocks = {"BLOCK_E": 4, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "EVEN_K": True,
              "IEEE": False, "INTERPRET": False}
    # SwiGLU; gpt-oss's clamped GLU with biases; the same over MXFP4 experts
    for glu, mx in ((False, False), (True, False), (True, True)):
        w, s = ("*u8", "*u8") if mx else ("*bf16", "*bf16")
        build(_moe_gate_up_kernel,
              {"x_ptr": "*bf16", "w13_ptr": w, "b13_ptr": "*bf16", "inter_ptr": "*bf16",
               "sorted_pairs_ptr": "*i32", "cum_padded_ptr": "*i32", "s13_ptr": s,
               "alpha": "fp32", "limit": "fp32",
               **ints("num_pairs", "num_experts", "stride_xt", "stride_xh", "stride_we",
                      "stride_wn", "stride_wk", "stride_se", "stride_sn", "stride_sk",
                      "stride_it", "stride_ii")},
              {"H": 128, "INTER": 128, "TOP_K": 2, **blocks, "HAS_BIAS": glu,
               "CLAMPED_GLU": glu, "CLAMP": glu, "INTERLEAVED": glu, "MXFP4": mx})
        build(_moe_down_kernel,
              {"inter_ptr": "*bf16", "w2_ptr": w, "b2_ptr": "*bf16", "pairs_ptr": "*bf16",
               "sorted_pairs_ptr": "*i32", "cum_padded_ptr": "*i32",
               "topk_weights_ptr": "*fp32", "s2_ptr": s,
               **ints("num_pairs", "num_experts", "stride_it", "stride_ii", "stride_we",
                      "stride_wn", "stride_wk", "stride_se", "stride_sn", "stride_sk",
                      "stride_pt", "stride_ph")},
              {"H": 128, "INTER": 128, **blocks, "HAS_BIAS": glu, "MXFP4": mx})
    for ids in ("*i32", "*i64"):  # the sum over the slots skips those of no expert's id
        build(_moe_sum_kernel,
              {"pairs_ptr": "*bf16", "ids_ptr": ids, "out_ptr": "*bf16",
               **ints("H", "num_experts", "stride_pt", "stride_ph", "stride_it",
                      "stride_ik", "stride_ot", "stride_oh")},
              {"TOP_K": 4, "BLOCK_H": 1024})
    for logits in ("*bf16", "*fp32"):  # the routing ranks the logits, a NaN first
        build(_topk_softmax_kernel,
              {"logits_ptr": logits, "weights_ptr": "*fp32", "ids_ptr": "*i32",
               **ints("num_experts", "stride_lt", "stride_le")},
              {"TOP_K": 4, "BLOCK_E": 128, "BLOCK_K": 4, "RENORMALIZE": True})
    print("compiled")
''')


def test_the_moe_kernels_compile_for_sm90_with_and_without_gpt_oss_experts_and_mxfp4(errors):
    compiles(errors, "COMPILE_MOE")


# A GPU whose program may have 99 KB of shared memory (sm_86, sm_89): the tiles chosen
# for it, compiled for sm_89, fit. Before, the few-row linear's 160 KB budget and head dim
# 256's attention tiles made such GPUs refuse the launch.
COMPILE_SMALL_GPU = textwrap.dedent('''
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphcap.opsdb.triton import linear
    from graphcap.opsdb.triton.attention import _attn_varlen_fwd, _config

    SHARED = 99 * 1024  # what an sm_89 program may have (opt-in)

    def shared_of(kernel, types, consts, warps, stages):
        sig = {**types, **{n: "constexpr" for n in consts}}
        sig = {name: sig[name] for name in kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                 if sig[n][0] in "*i" and n not in ("M", "T", "NUM_REQ", "window")}
        out = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                             target=GPUTarget("cuda", 89, 32),
                             options={"num_warps": warps, "num_stages": stages})
        return out.metadata.shared

    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_rm")
    # qwen3-0.6b's gate/up (normed, SwiGLU) and down (residual), llama3-8b's gate/up
    for m, (n, k), norm, swiglu in ((16, (3072, 1024), True, True),
                                    (64, (1024, 3072), False, False),
                                    (64, (14336, 4096), True, True)):
        cfg = linear.config(m, n, k, norm=norm, swiglu=swiglu, sms=128, shared=SHARED)
        types = {**{x: "*bf16" for x in ("X", "W", "Y", "NORM_W", "RES", "BIAS")},
                 "PARTIAL": "*fp32", "COUNTS": "*i32", "eps": "fp32",
                 **{x: "i32" for x in ints}, "UP": "i32"}
        consts = {x: cfg[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
        consts.update(NORM=norm, SWIGLU=swiglu, RESIDUAL=not swiglu, HAS_BIAS=False,
                      IEEE=False, INTERPRET=False, PDL=False, PREFETCH=False, LINE=64,
                      NORM_LATE=False)
        got = shared_of(linear._skinny_linear_kernel, types, consts, cfg["num_warps"],
                        cfg["num_stages"])
        assert got <= SHARED, (m, n, k, cfg, got)
    strides = {f"stride_{t}{d}": "i32" for t in "qkvo" for d in "th"}
    for d, length in ((256, 512), (128, 2048), (128, 512), (80, 2048)):
        block_d = max(16, 1 << (d - 1).bit_length())  # 80 runs in 128's registers
        bm, bn, warps, stages = _config(block_d, torch.bfloat16, 10_000, 128, False, length,
                                        SHARED)
        types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "CU": "*i32",
                 "SINKS": "*bf16", "T": "i32", "qk_scale": "fp32", "sm_scale": "fp32",
                 "window": "i32", "softcap": "fp32", "NUM_REQ": "i32", **strides}
        consts = {"GROUP": 2, "HEAD_DIM": d, "BLOCK_D": block_d, "EVEN_D": block_d == d,
                  "BLOCK_M": bm, "BLOCK_N": bn, "CAUSAL": True,
                  "DOT_PRECISION": "tf32", "INTERPRET": False, "PDL": False,
                  "WINDOW": False, "SOFTCAP": False, "HAS_SINKS": False, "WIDE": False}
        got = shared_of(_attn_varlen_fwd, types, consts, warps, stages)
        assert got <= SHARED, (d, length, (bm, bn, warps, stages), got)
    # Decode attention: qwen3-0.6b's heads and Gemma's head dim 256, float32 caches, groups
    # of 64 query heads; on sm_89 (99 KB), sm_80 (163 KB) and the H200 (227 KB).
    from graphcap.opsdb.triton.decode import _decode_kernel
    from graphcap.opsdb.triton.decode_grid import head_block, programs_of, tiles_for

    for dt, d, group, rows, shared, cc in (
            ("bf16", 128, 2, 1, SHARED, 89), ("bf16", 256, 2, 1, SHARED, 89),
            ("fp32", 128, 2, 1, SHARED, 89), ("bf16", 256, 2, 64, SHARED, 89),
            ("fp32", 128, 64, 1, SHARED, 89), ("bf16", 256, 64, 1, 163 * 1024, 80),
            ("fp32", 64, 64, 1, 163 * 1024, 80), ("fp32", 256, 2, 1, 227 * 1024, 90),
            ("bf16", 256, 64, 1, 227 * 1024, 90)):
        block_h = head_block(group)
        cfg, _ = tiles_for(programs_of(rows, 8 * group, 8), 1025, 128, shared,
                           d * (4 if dt == "fp32" else 2), block_h, d)
        types = {**{x: f"*{dt}" for x in ("q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "k_ptr",
                                          "v_ptr", "qw_ptr", "kw_ptr")},
                 "sinks_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i32",
                 "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "counts_ptr": "*i32",
                 "loc_ptr": "*i64", "pos_ptr": "*i64", "cs_ptr": "*fp32", "scale": "fp32",
                 "softcap": "fp32", "eps": "fp32",
                 **{x: "i32" for x in ("q_stride_b", "q_stride_h", "out_stride_b",
                                       "out_stride_h", "k_stride_b", "k_stride_h",
                                       "v_stride_b", "v_stride_h", "table_stride",
                                       "pos_stride", "cs_stride", "width", "kv_heads",
                                       "head_dim", "split_len", "window", "half", "pages",
                                       "cs_rows")}}
        consts = {"PAGE": 16, "GROUP": group, "BLOCK_H": block_h, "SPLITS": 4,
                  "BLOCK_N": cfg["BLOCK_N"], "BLOCK_D": d, "WINDOW": False,
                  "SOFTCAP": False, "SINKS": False, "WRITE": True, "ROPE": False,
                  "HAS_NORM": False, "IEEE": dt == "fp32", "INTERPRET": False, "PDL": False,
                  "EARLY_V": False, "KEY_LATE": False, "SPLIT_OF_LENGTH": True,
                  "SPLIT_QUANTUM": 0, "CUDA_CORES": False, "AHEAD": False}
        sig = {**types, **{n: "constexpr" for n in consts}}
        sig = {n: sig[n] for n in _decode_kernel.arg_names}
        out = triton.compile(ASTSource(_decode_kernel, sig, constexprs=consts),
                             target=GPUTarget("cuda", cc, 32),
                             options={"num_warps": cfg["num_warps"],
                                      "num_stages": cfg["num_stages"]})
        assert out.metadata.shared <= shared, (dt, d, group, rows, cfg, out.metadata.shared)
    print("compiled")
''')


def test_the_few_row_linear_and_the_attention_kernels_fit_a_gpu_of_99_kb(errors):
    compiles(errors, "COMPILE_SMALL_GPU")
