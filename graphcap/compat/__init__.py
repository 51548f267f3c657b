"""torch.library glue and torch-version shims (graphcap runs on torch 2.11 and 2.13+).

Features are probed, not inferred from version strings, so a backport or a nightly
works the same.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

HAS_CUDAGRAPH_UNSAFE_TAG = hasattr(torch.Tag, "cudagraph_unsafe")


def cudagraph_unsafe(op) -> bool:
    """Whether ``op`` (an ``OpOverload``, or a packet: any of its overloads) is tagged
    ``torch.Tag.cudagraph_unsafe`` (opsdb tags an op registered ``capturable=False``); False
    for anything else, and on a torch without the tag."""
    if not HAS_CUDAGRAPH_UNSAFE_TAG:
        return False
    tag = torch.Tag.cudagraph_unsafe
    if isinstance(op, torch._ops.OpOverloadPacket):
        return any(tag in getattr(op, name).tags for name in op.overloads())
    return isinstance(op, torch._ops.OpOverload) and tag in op.tags


def cuda_available() -> bool:
    """True when a CUDA device is usable (not merely compiled in)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def set_group_timeout(group, seconds: float) -> bool:
    """Bound ``group``'s later collectives by ``seconds`` (``ProcessGroup.set_timeout``);
    False where this torch cannot change a made group's timeout: no such method, or one
    its backend refuses (torch's ``Backend.setTimeout`` raises unless a backend has one)."""
    set_timeout = getattr(group, "set_timeout", None)
    if set_timeout is None:
        return False
    from datetime import timedelta

    try:
        set_timeout(timedelta(seconds=seconds))
    except (RuntimeError, NotImplementedError):
        return False
    return True


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


def forget_backend(backend) -> None:
    """Drop ``backend`` from Dynamo's ``eval_frame.cached_backends``, where every backend
    it compiled with stays until ``torch._dynamo.reset()`` (with all the backend holds)."""
    from torch._dynamo import eval_frame

    cached = getattr(eval_frame, "cached_backends", None)
    if cached is None or backend is None:
        return
    for key, held in list(cached.items()):
        if held is backend or getattr(held, "compiler_fn", None) is backend:
            cached.pop(key, None)


def compiled_with(module: torch.nn.Module):
    """The backend ``module`` was compiled with, where it is what ``torch.compile(m,
    backend=...)`` returns: the callable given (or the one a name stands for), None for
    any other module, and for a backend this torch keeps out of reach."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # no torch.compile yet: none
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    backend = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(16):  # Dynamo's wrappers around it, each naming the one it wraps
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "compiler_fn", None)
        if inner is None or inner is backend:
            return backend
        backend = inner
    return None


def forget_code(code) -> bool:
    """Drop what Dynamo keeps of the compiles of ``code`` once its caller is gone: the
    cache entries on the code object (the compiled code, its guards and backend), the
    finalizers that keep each entry's guards alive for the process's life (Dynamo registers
    one on every object a guard matches by identity: types, modules, builtins), and the
    automatic-dynamic record kept under the code's name. True when all three were found,
    so that the code object may be compiled again for another caller as if new."""
    from torch._C._dynamo import eval_frame as c_eval_frame
    from torch._dynamo import eval_frame

    entries = getattr(c_eval_frame, "_debug_get_cache_entry_list", None)
    reset_code = getattr(eval_frame, "reset_code", None) or getattr(
        c_eval_frame, "reset_code", None)
    guards = {id(g) for e in (entries(code) if entries else ())
              for g in (getattr(e, "guard_manager", None), getattr(e, "check_fn", None))
              if g is not None}
    detached = _detach_guard_finalizers(guards) if entries is not None else False
    if reset_code is not None:
        reset_code(code)
    forgot = _forget_automatic_dynamic(code)
    return detached and reset_code is not None and forgot


def _detach_guard_finalizers(guards: set[int]) -> bool:
    registry = getattr(weakref.finalize, "_registry", None)
    if registry is None:
        return False
    for finalizer, info in list(registry.items()):
        owner = getattr(getattr(info.func, "func", None), "__self__", None)
        if id(getattr(owner, "guard_manager", None)) in guards:
            finalizer.detach()
    return True


def _forget_automatic_dynamic(code) -> bool:
    try:
        from torch._dynamo import pgo
    except ImportError:  # a torch before the record moved there: nothing known to drop
        return False
    make = getattr(getattr(pgo, "CodeId", None), "make", None)
    if make is None or not hasattr(pgo, "_CODE_STATE"):
        return False
    state = pgo._CODE_STATE
    if state is not None:
        state.pop(make(code), None)
    return True


def shape_env_of(example_inputs):
    """The ShapeEnv of the fake tensors Dynamo hands a backend, or None."""
    import torch._guards

    detect = getattr(torch._guards, "detect_fake_mode", None)
    mode = detect(example_inputs) if detect is not None else None
    return getattr(mode, "shape_env", None)


def release_shape_env(shape_env) -> None:
    """Let the garbage collector free a finished compile's ShapeEnv (call it once nothing
    uses the compile). Its fake tensors hold their symbolic sizes in C++, and those hold the
    ShapeEnv: a cycle through the ShapeEnv's ``tracked_fakes`` and ``fake_tensor_cache`` that
    Python cannot see, so it is never collected; its class-level memo caches (``lru_cache``
    on methods, keyed by the ShapeEnv) keep it alive besides."""
    if shape_env is None:
        return
    if getattr(shape_env, "tracked_fakes", None) is not None:
        shape_env.tracked_fakes = None
    cache = getattr(shape_env, "fake_tensor_cache", None)
    if isinstance(cache, dict):
        cache.clear()
    for method in vars(type(shape_env)).values():
        clear = getattr(method, "cache_clear", None)
        if clear is not None:  # memos only: a later call recomputes
            clear()


def _fx_loader():
    """FX's loader of the code it generates (its ``eval_cache`` and ``next_id``), or None
    where FX has none."""
    return getattr(torch.fx.graph_module, "_loader", None)


def fx_source_mark() -> int | None:
    """FX's count of the code it generated so far (it keeps each GraphModule's code, for
    tracebacks, under a numbered name), for :func:`fx_sources_since`; None where FX keeps
    no such count."""
    return getattr(_fx_loader(), "next_id", None)


def fx_sources_since(mark: int | None, mentioning: str) -> list[str]:
    """The names of the code FX generated since ``mark`` whose source mentions
    ``mentioning`` (in any case): GraphModules made and dropped within a compile (Dynamo
    makes one per compile to insert its runtime asserts), and code a GraphModule replaced
    when it recompiled, that no object names."""
    cache = getattr(_fx_loader(), "eval_cache", None)
    if mark is None or not isinstance(cache, dict):
        return []
    mentioning = mentioning.lower()
    return [name for name, source in list(cache.items())
            if _fx_number(name) >= mark and mentioning in source.lower()]


def _fx_number(name: str) -> int:
    head = name.split(" ", 1)[0]  # "<eval_with_key>.12", maybe " from file:line in fn"
    number = head.removeprefix("<eval_with_key>.")
    return int(number) if number != head and number.isdigit() else -1


def fx_sources(module: torch.nn.Module) -> list[str]:
    """The names of the code of ``module``'s GraphModules (its own and its submodules'). A
    GraphModule that generates its code lazily, on its first call, generates it now."""
    names = []
    for m in module.modules():
        if isinstance(m, torch.fx.GraphModule):
            real_recompile = getattr(m, "real_recompile", None)  # torch.fx _LazyGraphModule
            if real_recompile is not None:
                real_recompile()
            forward = vars(type(m)).get("forward")  # each GraphModule has a class of its own
            names.append(getattr(getattr(forward, "__code__", None), "co_filename", ""))
    return [n for n in names if _fx_number(n) >= 0]


def forget_fx_sources(names) -> None:
    """Drop the source FX keeps of the code named ``names`` (``linecache`` and FX's loader
    keep one entry per GraphModule ever compiled, for tracebacks); for code no live
    GraphModule runs."""
    import linecache

    cache = getattr(_fx_loader(), "eval_cache", None)
    for name in names:
        linecache.cache.pop(name, None)
        if isinstance(cache, dict):
            cache.pop(name, None)


def forget_finished_compiles() -> None:
    """Drop the records Dynamo keeps of compiles that have ended and whose code is gone: the
    dead weak references its trackers of compiled code keep, one per compile, and this
    thread's list of every metric set by every compile (kept to explain a metric set twice
    within one compile, never emptied) when no compile runs in it."""
    from torch._dynamo import convert_frame, utils

    for tracker in (getattr(convert_frame, "input_codes", None),
                    getattr(convert_frame, "output_codes", None)):
        seen = getattr(tracker, "seen", None)
        if isinstance(seen, list):
            for ref in [r for r in seen if r() is None]:
                seen.remove(ref)  # one by one: a compile in another thread may append
    metrics = getattr(utils, "get_metrics_context", None)
    context = metrics() if metrics is not None else None
    edits = getattr(context, "_edits", None)
    if isinstance(edits, list) and not context.in_progress():
        edits.clear()


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


def allow_recompiles(count: int):
    """A context in which Dynamo keeps at least ``count`` compiles of one frame (a
    static-shape compile per prompt length), for the compiles made in it:
    ``recompile_limit``, called ``cache_size_limit`` in older torch. The process's own
    limit is left as it was (a later compile of other code keeps it)."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), count)})


def default_store():
    """The key-value store of the world's rendezvous (``init_process_group``), which every
    rank reaches without a collective."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks")


def runs_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs hooks beside its ``forward``: its own or the
    global ones (``torch.nn.modules.module``'s registries; without hooks ``module(...)``
    is ``module.forward(...)``)."""
    registries = torch.nn.modules.module
    return any(getattr(module, name, None) or getattr(registries, "_global" + name, None)
               for name in _HOOK_DICTS)
