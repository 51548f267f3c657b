"""What a paged K/V cache is stored as: the dtypes and devices its keys and values may
have (:func:`check_storage`), and their allocation, both or neither, a cache the device
cannot hold refused naming the pages that fit (:func:`check_room` first, then
:func:`allocate`), as is a block table of more request slots and pages than memory holds
(:func:`block_tables`)."""

from __future__ import annotations

import numpy as np
import torch

from graphcap.errors import CacheTooLarge

# What graphcap's cache ops (kv_write, decode_attention, cached_attention) take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_storage(dtype, device) -> tuple[torch.dtype, torch.device]:
    """``dtype`` and ``device`` of a cache's keys and values, checked: a dtype graphcap's
    cache ops take, a device that holds values (the meta device holds none); a
    ``ValueError`` naming the argument and what to give otherwise."""
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16 (what "
                         f"graphcap's cache ops write and read), not {dtype!r}: build the "
                         "cache, or the model it serves, in one of them")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("device='meta': a cache on the meta device holds no keys or values "
                         "(nothing would be written or read); build it on the model's real "
                         "device, a model on meta once its weights are loaded")
    return dtype, device


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new tensor may take on ``device``: on CUDA, the driver's free memory and
    what torch's caching allocator holds unused; None elsewhere (a host that overcommits
    its memory does not say) and under an allocator that keeps no statistics."""
    if device.type != "cuda":
        return None
    try:
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except RuntimeError:  # an allocator that keeps no statistics (a pluggable one)
        return None


def size(count: int) -> str:
    """``count`` bytes in GiB, or MiB below one."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.2f} MiB"


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's K and V, zeros of ``shape`` ``[layers, pages + 1, page_size, kv_heads,
    head_dim]`` each: both, or :class:`CacheTooLarge` and neither held (checked before
    anything is allocated where the device says what is free)."""
    need, page = _bytes(shape, dtype)

    def both():  # one expression: a V that fails holds no K
        return (torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))

    # Where what was free said it fit and the allocation failed (memory a graph pool
    # holds, a process fraction), a figure of what fits now would name this size or more.
    return _within(both, need, device, lambda free: _too_large(shape, dtype, device, need,
                                                               free, page))


def check_room(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (:class:`CacheTooLarge`, naming the pages that fit) a cache whose K and V of
    ``shape`` need more than ``device`` says it has free, before any of it (its block
    table first) is allocated: a cache too large for both says what its pages need."""
    need, page = _bytes(shape, dtype)
    free = free_bytes(device)
    if free is not None and need > free:
        raise _too_large(shape, dtype, device, need, free, page)


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """The bytes of K and V of ``shape``, and of one page of them."""
    layers, stored, page_size, kv_heads, head_dim = shape  # stored: the null page too
    page = 2 * layers * page_size * kv_heads * head_dim * dtype.itemsize  # K and V
    return stored * page, page


def block_tables(requests: int, width: int, device: torch.device, null: int
                 ) -> tuple[torch.Tensor, np.ndarray]:
    """A cache's block table ``[requests, width]`` int32 on ``device`` and its host copy,
    every entry ``null``: both, or :class:`CacheTooLarge` naming the request slots and
    pages a row that make it too large."""
    need = 2 * requests * width * 4 if device.type == "cpu" else requests * width * 4

    def both():
        return (torch.full((requests, width), null, dtype=torch.int32, device=device),
                np.full((requests, width), null, dtype=np.int32))

    def too_large(free):
        has = f"{device} could not allocate it" if free is None else \
            f"{device} has {size(free)} free"
        return CacheTooLarge(
            f"a K/V cache's block table of {requests} request slots of {width} pages each "
            f"(max_len / page_size) needs {size(need)}; {has}: build the cache with fewer "
            "max_requests, a smaller max_len or larger pages", need=need, free=free,
            pages=None)

    return _within(both, need, device, too_large)


def _within(make, need: int, device: torch.device, too_large):
    """``make()``, where ``need`` bytes fit what ``device`` has free (where it says), or
    the error ``too_large(free)`` (``free`` None where unknown or where the allocation
    failed past a free figure that said it fit)."""
    free = free_bytes(device)
    try:
        if free is None or need <= free:
            return make()
    except (RuntimeError, MemoryError) as error:  # torch's OOM, the host's, numpy's
        if isinstance(error, RuntimeError) and not isinstance(
                error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
            raise
        raise too_large(None) from error
    raise too_large(free)


def _too_large(shape, dtype, device, need: int, free: int | None, page: int
               ) -> CacheTooLarge:
    """The error of a cache of ``shape`` needing ``need`` bytes, ``page`` a page, where
    ``free`` are free (None: unknown)."""
    layers, stored, page_size, kv_heads, head_dim = shape
    fit = None if free is None else max(free // page - 1, 0)  # less the null page
    has = f"{device} could not allocate it" if free is None else \
        f"{device} has {size(free)} free, room for {fit} pages ({fit * page_size} tokens)"
    return CacheTooLarge(
        f"a K/V cache of {stored - 1} pages of {page_size} tokens (and the null page), "
        f"{layers} layers of {kv_heads} x {head_dim} {str(dtype).removeprefix('torch.')}, "
        f"needs {size(need)} for its keys and values; {has}: build it with fewer pages "
        "(pages=, or fewer max_requests or a smaller max_len, which set the default)",
        need=need, free=free, pages=fit)
