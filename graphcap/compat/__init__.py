"""torch.library glue and torch-version shims (graphcap runs on torch 2.11 and 2.13+).

Features are probed, not inferred from version strings, so a backport or a nightly
works the same.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

HAS_CUDAGRAPH_UNSAFE_TAG = hasattr(torch.Tag, "cudagraph_unsafe")
HAS_TRITON_OP = hasattr(torch.library, "triton_op")


def cuda_available() -> bool:
    """True when a CUDA device is usable (not merely compiled in)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def new_mempool(device: torch.device):
    """A CUDA memory pool object that owns its pool (``torch.cuda.MemPool``), or a bare
    graph pool handle on a torch without it."""
    mempool = getattr(torch.cuda, "MemPool", None)
    if mempool is None:
        return torch.cuda.graph_pool_handle()
    with torch.cuda.device(device):
        return mempool()


def allocate_to(pool, device: torch.device):
    """A context routing this thread's allocations to ``pool`` (a ``torch.cuda.MemPool``),
    or nothing where torch lacks ``use_mem_pool`` or ``pool`` is a bare handle."""
    if not routes_to(pool):
        return contextlib.nullcontext()
    return torch.cuda.use_mem_pool(pool, device)


def routes_to(pool) -> bool:
    """Whether :func:`allocate_to` can route allocations to ``pool`` on this torch."""
    mempool = getattr(torch.cuda, "MemPool", None)
    return (getattr(torch.cuda, "use_mem_pool", None) is not None and mempool is not None
            and isinstance(pool, mempool))


def mempool_id(pool) -> tuple[int, int]:
    return tuple(pool.id) if hasattr(pool, "id") else tuple(pool)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces, so the next matmul on a stream
    allocates a new one (inside the graph pool, when that matmul is being captured)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


def end_allocate_to_pool(device: torch.device, pool_id) -> None:
    """Stop routing allocations to ``pool_id`` (after a capture CUDA refused); a no-op
    when the allocator had stopped already."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool_id)
    except RuntimeError:
        pass


def anchor_graph(device: torch.device, pool_id, stream) -> tuple:
    """A one-kernel graph captured on ``pool_id`` and kept alive by the caller.

    torch 2.11's host allocator forgets nothing about a graph pool whose last graph
    died yet asserts on the next capture into it ("use_count > 0"); a graph that lives
    as long as the pool keeps that count above zero.
    """
    buf = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool_id, capture_error_mode="thread_local")
        buf.add_(1)
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, buf


def release_compiled(fn, backend) -> None:
    """When the caller of ``torch.compile(fn, backend=backend)`` dies: drop what Dynamo
    keeps of that compile beyond it, so the backend (and the graphs it holds) can be
    freed. Dynamo keeps the code it compiled for ``fn`` in ``fn.__code__``'s cache entries
    (which also hold the backend, and a module global that reaches it), and every backend
    it compiled with in ``eval_frame.cached_backends`` until ``torch._dynamo.reset()``. A
    finalizer holding neither the caller nor the backend strongly does it: registered
    here, it runs when ``fn`` dies (``fn`` must belong to the caller alone)."""
    from torch._dynamo import eval_frame

    reset_code = getattr(eval_frame, "reset_code", None) or getattr(
        torch._C._dynamo.eval_frame, "reset_code", None)
    cached = getattr(eval_frame, "cached_backends", None)
    key = None
    if cached is not None:
        key = next((k for k, b in cached.items()
                    if b is backend or getattr(b, "compiler_fn", None) is backend), None)
    ref = weakref.ref(cached[key]) if key is not None else None
    weakref.finalize(fn, _release_compiled, fn.__code__, reset_code, key, ref).atexit = False


def _release_compiled(code, reset_code, key, ref) -> None:
    if reset_code is not None:
        reset_code(code)
    from torch._dynamo import eval_frame

    cached = getattr(eval_frame, "cached_backends", None)
    if cached is not None and ref is not None and ref() is not None \
            and cached.get(key) is ref():
        del cached[key]


def current_stream_key(index: int) -> tuple:
    """The current CUDA stream of device ``index`` as torch's (id, device, type) tuple,
    without making a ``torch.cuda.Stream`` object (microseconds on a slow host)."""
    get = getattr(torch._C, "_cuda_getCurrentStream", None)
    if get is None:
        stream = torch.cuda.current_stream(index)
        return (stream.stream_id, stream.device_index, stream.device_type)
    return tuple(get(index))


def stream_of(key: tuple) -> torch.cuda.Stream:
    """The ``torch.cuda.Stream`` of a :func:`current_stream_key`."""
    return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])


def on_module_registrations(hook) -> bool:
    """Call ``hook(module, name, value)`` on every registration of a submodule, parameter
    or buffer by any ``nn.Module`` (``setattr``, ``register_*``), through torch's global
    registration hooks; True when torch has all three."""
    from torch.nn.modules import module

    names = ("register_module_module_registration_hook",
             "register_module_parameter_registration_hook",
             "register_module_buffer_registration_hook")
    registers = [getattr(module, name, None) for name in names]
    if any(r is None for r in registers):
        return False
    for register in registers:
        register(hook)
    return True


def allow_recompiles(count: int) -> None:
    """Let Dynamo keep at least ``count`` compiles of one frame (a static-shape compile per
    prompt length): ``recompile_limit``, called ``cache_size_limit`` in older torch."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), count))


def default_store():
    """The key-value store of the world's rendezvous (``init_process_group``), which every
    rank reaches without a collective."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
