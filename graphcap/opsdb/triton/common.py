"""Pieces several of the project's Triton kernels share."""

from __future__ import annotations

import contextvars

import torch
import triton
import triton.language as tl

from graphcap import env


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b in float32. float32 inputs use IEEE products, not TF32. The interpreter
    mis-multiplies bfloat16 (it sees the raw bits), so there both sides go to float32."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def interpreting() -> bool:
    """True under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test runs)."""
    return env.settings().triton_interpret


_PROPS: dict[int, tuple[int, int]] = {}  # per CUDA device: (SMs, shared memory a program)


def _props(device: torch.device) -> tuple[int, int]:
    """(streaming multiprocessors, the shared memory one program may ask for: its opt-in
    limit, 0 where torch does not say) of CUDA ``device``, read once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROPS:
        props = torch.cuda.get_device_properties(index)
        _PROPS[index] = (props.multi_processor_count,
                         int(getattr(props, "shared_memory_per_block_optin", 0)))
    return _PROPS[index]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA), cached per device."""
    return _props(device)[0] if device.type == "cuda" else 1


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may ask for on ``device`` (its opt-in limit; 0
    off CUDA, or where torch does not say), cached per device."""
    return _props(device)[1] if device.type == "cuda" else 0


@triton.jit
def table_row(index, rows):
    """Row ``index`` of a table of ``rows`` (> 0) rows as torch's indexing reads it, a
    negative index counting from the end (the references index their tables so: a rotary
    position, a block table's page); an index torch would refuse (``rows`` or more, below
    ``-rows``) reads the nearest row, never memory outside the table."""
    index = tl.where(index < 0, index + rows, index)
    return tl.minimum(tl.maximum(index, 0), rows - 1)


@triton.jit
def in_table(index, rows):
    """Whether ``index`` is a row of a table of ``rows`` rows (a cache's slot: what a write
    outside it must not touch)."""
    return (index >= 0) & (index < rows)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` to ``dtype``, rounding to nearest even as the GPU does. Triton 3.6's
    interpreter truncates float32 to bfloat16 (half the values come out one unit low),
    so there the rounding is done on the bits first; the truncation is then exact."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # A NaN stays NaN (its payload could carry into inf, or truncate to it).
        x = tl.where(x != x, float("nan"), bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


# -- programmatic dependent launch (PDL) ------------------------------------------------
# On sm90+ a kernel launched with ``launch_pdl=True`` may start while the kernel before it
# in the stream still runs, once every program of that one has called
# ``gdc_launch_dependents`` (or exited). It must then call ``gdc_wait`` before it reads
# anything an earlier kernel wrote and before it stores anything (the allocator may have
# handed it memory an earlier kernel still reads); ``gdc_wait`` returns once the earlier
# kernel has completed and its memory is visible. Work that touches only memory nothing
# in the stream writes (a layer's weights) can go before the wait. Captured in a CUDA
# graph, the launch becomes a programmatic edge between the two kernel nodes. A kernel
# before it that never calls ``gdc_launch_dependents`` (cuBLAS, PyTorch's) simply
# completes first. Every kernel launched this way waits unconditionally in every program,
# so a chain stays ordered: a kernel completes only after the one before it did.

# The innermost programmatic_launch(...) setting of this thread (or task), or None.
_pdl_override: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "graphcap_pdl", default=None)
# The kernels the innermost programmatic_launch(..., without=...) launches without PDL.
_pdl_without: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "graphcap_pdl_without", default=frozenset())
# The kernels that take part, by the name their launch gives pdl_args.
PDL_KERNELS = ("attention", "cache_places", "decode_attention", "fused_add_rms_norm", "gemv",
               "kv_write", "qkv_norm_rope", "rms_norm", "skinny_linear")


def _pdl_probe() -> bool:
    extra = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(extra, "gdc_wait") and hasattr(extra, "gdc_launch_dependents")


_PDL_IN_TRITON = _pdl_probe()
_SM90: dict[int, bool] = {}


def pdl(device: torch.device) -> bool:
    """Whether this project's Triton kernels launch on ``device`` with programmatic
    dependent launch: CUDA sm90 or newer, a Triton that has ``gdc_wait``, not the
    interpreter, and not switched off (``GRAPHCAP_PDL=0``, or ``false``/``off``/``no``, or
    :func:`programmatic_launch`)."""
    override = _pdl_override.get()
    if override is not None:
        if not override:
            return False
    elif not env.settings().pdl:
        return False
    if device.type != "cuda" or interpreting() or not _PDL_IN_TRITON:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _SM90[index]


class programmatic_launch:
    """``with programmatic_launch(False):`` launches (or captures) the project's Triton
    kernels without PDL, e.g. to compare; ``True`` restores the default where PDL is
    available; ``without=("decode_attention", ...)`` (names of :data:`PDL_KERNELS`)
    launches those kernels without it and leaves the rest as ``enabled`` says. It applies
    to the launches made inside the block, in this thread: a CUDA graph captured there
    replays its kernels as captured, while whatever a replay runs eagerly (a breakable
    forward's breaks, tc_piecewise's split ops) launches by the setting at replay time."""

    def __init__(self, enabled: bool = True, without=()):
        unknown = sorted(set(without) - set(PDL_KERNELS))
        if unknown or isinstance(without, str):
            raise ValueError(f"programmatic_launch(without=...) takes kernel names of "
                             f"{PDL_KERNELS}; got {without!r}")
        self.enabled, self.without = bool(enabled), frozenset(without)
        self._tokens: list[tuple[contextvars.Token, contextvars.Token]] = []

    def __enter__(self):
        self._tokens.append((_pdl_override.set(self.enabled),
                             _pdl_without.set(self.without)))
        return self

    def __exit__(self, *exc):
        enabled, without = self._tokens.pop()
        _pdl_without.reset(without)
        _pdl_override.reset(enabled)
        return False


# Launches over more rows than this run without PDL: it won at 16 and 64 tokens and lost
# from 256, in qkv_norm_rope's grid of one-warp programs (performance-history item 22).
PDL_MAX_ROWS = 64


def pdl_args(device: torch.device, rows: int, kernel: str) -> dict:
    """Keyword arguments for a launch of ``kernel`` (one of :data:`PDL_KERNELS`) over
    ``rows`` rows (tokens), a kernel with a ``PDL`` constexpr: PDL where :func:`pdl`
    allows it, ``rows <= PDL_MAX_ROWS`` and no :class:`programmatic_launch` block names the
    kernel in ``without``."""
    if rows <= PDL_MAX_ROWS and kernel not in _pdl_without.get() and pdl(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First statement of a kernel launched with :func:`pdl_args`: lets the next kernel
    launch now and waits for the previous one. For kernels that have nothing to do before
    their inputs are ready."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line of each pointer; no value comes back, nothing waits.
    Pass one pointer per line."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share_l2(ptr, n_lines, LINE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's share (the grid's first axis splits them) of an L2 prefetch of
    ``n_lines`` lines of ``LINE`` elements (128 bytes) from ``ptr``, ``BLOCK`` a time."""
    per = tl.cdiv(n_lines, tl.num_programs(0))
    lo = tl.program_id(0) * per
    hi = tl.minimum(lo + per, n_lines)
    offs = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        lines = start + offs
        prefetch_l2(tl.where(lines < hi, ptr + lines.to(tl.int64) * LINE, ptr))


# Tensors up to this size are asked of L2 whole before a PDL launch's wait (a matmul's
# weight, by the matmul or by the norm before it); larger ones lost to eviction
# (performance-history item 23).
PREFETCH_BYTES = 16 << 20


def prefetches(t: torch.Tensor) -> bool:
    """Whether ``t`` is small enough to be asked of L2 whole (:data:`PREFETCH_BYTES`)."""
    return t.numel() * t.element_size() <= PREFETCH_BYTES


def line_elements(t: torch.Tensor) -> int:
    """Elements of ``t``'s dtype in one 128-byte cache line."""
    return max(128 // t.element_size(), 1)
