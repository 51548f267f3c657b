"""opsdb's CUDA C++ kernels: each ``<name>.cu`` here is built on first use by torch's
extension builder (nvcc from the CUDA toolkit, ninja), for the GPU in use, and cached
(``~/.cache/torch_extensions``; ``TORCH_EXTENSIONS_DIR`` moves it). The first build takes a
minute or so."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from graphcap.errors import KernelUnavailable

_built: dict[str, object] = {}
_failed: dict[str, str] = {}
_lock = threading.Lock()


def unavailable() -> str | None:
    """Why these kernels cannot be built here, or None."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "needs a CUDA GPU and a CUDA build of torch"
    if torch.cuda.get_device_capability() < (8, 0):
        return "needs a GPU of compute capability 8.0 or newer (bf16 tensor cores)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "needs the CUDA toolkit's nvcc: install it, or set CUDA_HOME to it"
    if not cpp_extension.is_ninja_available():
        return "needs ninja (pip install ninja)"
    return None


_hopper: dict[int, bool] = {}


def hopper(device: torch.device | None = None) -> bool:
    """Whether ``device`` (default: the current CUDA device) is of compute capability 9.0,
    the one the arch-specific target sm_90a (warpgroup products, ``wgmma``) runs on; read
    once a device."""
    if not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None \
        else device.index
    if index not in _hopper:
        _hopper[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _hopper[index]


def flags() -> list[str]:
    """nvcc's flags for these kernels: on a :func:`hopper` GPU its arch-specific target
    sm_90a; elsewhere torch's choice for the GPU in use."""
    return ["-O3", *(["-gencode=arch=compute_90a,code=sm_90a"] if hopper() else [])]


def extension(name: str):
    """The built module of ``<name>.cu`` (built once a process; a failed build is
    :class:`KernelUnavailable` naming the compiler's complaint, every later call too)."""
    with _lock:
        if name in _built:
            return _built[name]
        why = _failed.get(name) or unavailable()
        if why is None:
            from torch.utils.cpp_extension import load

            try:
                _built[name] = load(f"graphcap_{name}",
                                    [str(Path(__file__).with_name(f"{name}.cu"))],
                                    extra_cuda_cflags=flags())
                return _built[name]
            except (RuntimeError, OSError) as exc:
                why = _failed[name] = f"did not build: {str(exc)[-2000:]}"
        raise KernelUnavailable(f"graphcap's CUDA kernels ({name}.cu) {why}")


def builds(name: str) -> bool:
    """Whether ``<name>.cu`` builds (and is built) here."""
    try:
        extension(name)
    except KernelUnavailable:
        return False
    return True
