"""Host synchronisations: what a graph cannot capture, and how to say so.

A CUDA graph records device work only. Anything that makes the host wait for the device
(``Tensor.item``, ``.cpu()``, ``nonzero`` and other ops whose output size depends on the
data) or that feeds host data into device memory from a Python object fails CUDA stream
capture. The emulator applies the same rules by name (``check_op``, ``check_method``);
the CUDA graph translates the driver's failure (``translate_cuda_failure``). Both raise
:class:`graphcap.errors.CaptureError` naming the operation and the user's source line.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from graphcap import compat
from graphcap.core.breaks import breakable_capture
from graphcap.core.trees import tensor_leaves
from graphcap.errors import CaptureError

aten = torch.ops.aten


def _overloads(names: dict[str, str]) -> dict:
    """The aten overloads named (``"packet.overload"``) that this torch has."""
    found = {}
    for name, what in names.items():
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            found[op] = what
    return found


# Ops that return a host value computed from device data; and ops that read a device value
# on the host inside their kernel on CUDA (a check of the data, or a tensor argument taken
# as a number), which the CPU's kernels of them do without an op the emulator sees.
_SCALAR_READS = {
    aten._local_scalar_dense.default:
        "Tensor.item() (also int(t), float(t), bool(t), if t:, operator.index(t), x[:t], "
        "range(t), math functions of t)",
    aten.equal.default: "torch.equal",
    aten.is_nonzero.default: "Tensor.is_nonzero / bool(t)",
    aten.allclose.default: "torch.allclose",
    aten._linalg_check_errors.default:
        "the error check of a torch.linalg function (inv, cholesky, solve, lu_factor, "
        "matrix_power of a negative power, torch.inverse; their *_ex forms, such as "
        "torch.linalg.inv_ex, return the error codes on the device instead)",
    **_overloads({
        **{f"normal.{o}": "torch.normal with a tensor std (CUDA checks std >= 0 on the host)"
           for o in ("Tensor_Tensor", "float_Tensor", "Tensor_Tensor_out", "float_Tensor_out")},
        **{f"{f}.{o}": f"torch.{f} with a tensor start or end (read as numbers on the host)"
           for f in ("linspace", "logspace")
           for o in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor", "Tensor_Tensor_out",
                     "Tensor_Scalar_out", "Scalar_Tensor_out")},
    }),
}
# Ops whose output shape depends on the data: the host must read the device to size it.
_DATA_DEPENDENT = {
    aten.nonzero.default: "torch.nonzero (also torch.where(cond), argwhere)",
    aten.masked_select.default: "torch.masked_select",
    aten._unique.default: "torch.unique",
    aten._unique2.default: "torch.unique",
    aten.unique_dim.default: "torch.unique(dim=...)",
    aten.unique_consecutive.default: "torch.unique_consecutive",
    aten.bincount.default: "torch.bincount",
}
# Ops that turn a host Python object into a tensor on the capture device.
_HOST_DATA = {
    aten.lift_fresh.default: "torch.tensor(python_data)",
    aten.lift_fresh_copy.default: "torch.tensor(python_data)",
}
# Set while ``x[i] = 0.0`` runs on the CPU: indexing lifts the Python number into a 0-d
# tensor there (on CUDA it fills the device memory, which a graph captures).
SCALAR_ASSIGNMENT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graphcap_scalar_assignment", default=False)
# Tensor methods that read device memory from the host without any aten op.
HOST_METHODS = {
    torch.Tensor.cpu: ("Tensor.cpu", "Tensor.cpu()"),
    torch.Tensor.numpy: ("Tensor.numpy", "Tensor.numpy()"),
    torch.Tensor.__array__: ("Tensor.__array__", "numpy.asarray(t) / numpy.array(t)"),
    torch.Tensor.tolist: ("Tensor.tolist", "Tensor.tolist()"),
    torch.Tensor.item: ("Tensor.item", "Tensor.item()"),
    torch.Tensor.__repr__: ("Tensor.__repr__", "printing a tensor"),
    torch.Tensor.__str__: ("Tensor.__str__", "printing a tensor"),
    torch.Tensor.__format__: ("Tensor.__format__", "formatting a tensor"),
}


class HostWait(NamedTuple):
    """A host call that waits for the device without an aten op or a Tensor method, so
    the emulator's modes never see it: it swaps the call for a checked one while it
    records (:func:`host_waits_checked`)."""

    owner: object  # the module or class that has it
    name: str
    op: str
    what: str
    waits: Callable[[torch.device, tuple], bool]  # does a call (its args) wait for the
    # work a capture on the device records: CUDA refuses it then, and drops the capture


HOST_WAITS = (
    HostWait(torch.cuda, "synchronize", "torch.cuda.synchronize", "torch.cuda.synchronize()",
             lambda device, args: True),
    HostWait(torch.accelerator, "synchronize", "torch.accelerator.synchronize",
             "torch.accelerator.synchronize()", lambda device, args: True),
    # the CPU's own, as torch.get_device_module(x.device).synchronize() calls it for a CPU x
    HostWait(torch.cpu, "synchronize", "torch.cpu.synchronize", "torch.cpu.synchronize()",
             lambda device, args: device.type == "cpu"),
    # the current stream is the one a capture records (another one may be waited for)
    HostWait(torch.cuda.Stream, "synchronize", "Stream.synchronize",
             "torch.cuda.current_stream().synchronize()",
             lambda device, args: args[0] == torch.cuda.current_stream(args[0].device)),
)

_ADVICE = (
    "Move it out of the captured region (compute it before capture, or keep it on the "
    "device), or mark the function that does it with @graphcap.eager_on_graph and use "
    "strategy='breakable', which runs it eagerly between graph segments."
)

_HERE = os.path.dirname(os.path.abspath(__file__))  # graphcap/core: the capture machinery
# and what runs traced pieces and feeds the model its static buffers
_MACHINERY = tuple(os.path.join(os.path.dirname(_HERE), d) for d in ("piecewise", "inputs"))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def user_site(frames: Iterable[traceback.FrameSummary]) -> str | None:
    """The innermost frame outside torch and graphcap's own capture machinery."""
    site = None
    for frame in frames:
        path = os.path.abspath(frame.filename)
        if path.startswith((_TORCH, _HERE, *_MACHINERY)) or "/contextlib.py" in path \
                or frame.filename.startswith("<eval_with_key>"):  # FX's generated code
            continue
        code = (frame.line or "").strip()
        site = f"{os.path.basename(path)}:{frame.lineno}" + (f" `{code}`" if code else "")
    return site


def traced_site(node) -> str | None:
    """The model's line an FX node was traced from (its ``stack_trace``), as
    :func:`user_site` names one, or None."""
    frames, lines = [], ((getattr(node, "meta", None) or {}).get("stack_trace") or "").splitlines()
    for i, line in enumerate(lines):
        if found := re.match(r'\s*File "(.+)", line (\d+), in (.+)$', line):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            code = "" if code.startswith("File ") or set(code) <= set("^~ ") else code
            frames.append(traceback.FrameSummary(found[1], int(found[2]), found[3],
                                                 line=code))
    return user_site(frames)


# The FX node an interpreted piece runs now (graphcap.piecewise.pieces): its traced line is
# the model's, where the stack holds only graphcap's frames.
RUNNING_NODE: contextvars.ContextVar = contextvars.ContextVar("graphcap_running_node",
                                                              default=None)


def _raise(op: str, what: str, why: str, kind: str = "host synchronisation") -> None:
    site = traced_site(RUNNING_NODE.get()) or user_site(traceback.extract_stack())
    where = f", at {site}" if site else ""
    raise CaptureError(
        f"{kind} in a captured region: {what} ({op}{where}) {why}, which "
        f"a graph cannot capture. {_ADVICE}",
        op=op,
        site=site,
    )


def _moves_to_host(func, args, kwargs, device: torch.device) -> bool:
    """A device-to-host copy, or a copy into the device that waits for the host: from
    pageable host memory, or blocking (CUDA syncs the stream after it), as ``.to(device)``
    of a host tensor is."""
    if device.type == "cpu":
        return False
    if func is aten._to_copy.default:
        target, src = kwargs.get("device"), args[0]
        if target is None:
            return False
        target = torch.device(target)
        if target.type == "cpu":
            return src.device == device
        return target.type == device.type and target.index in (None, device.index) and \
            src.device.type == "cpu" and not (kwargs.get("non_blocking") and src.is_pinned())
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if dst.device.type == "cpu" and src.device == device:
            return True
        return dst.device == device and src.device.type == "cpu" and \
            not (non_blocking and src.is_pinned())
    return False


def _bool_index(func, args) -> bool:
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _histc_from_data(args, kwargs) -> bool:
    """``torch.histc(t, bins, min, max)`` of a non-empty ``t`` with ``min == max`` (the
    default 0, 0): its range is the data's minimum and maximum, read on the host."""
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return low == high and args[0].numel() > 0


def uncapturable(op: str) -> CaptureError:
    """The refusal of an op registered ``capturable=False`` inside a capture: but
    breakable's, which runs it as an eager break where it is called through opsdb (a
    ``torch.ops`` call reaches no Python a break could be taken at)."""
    if breakable_capture():
        return CaptureError(
            f"{op} is registered capturable=False and was called as torch.ops inside a "
            "breakable capture, which would hold it in a graph segment: call it through "
            f"opsdb (graphcap.opsdb.get_op({op!r})(...)), which breakable runs as an eager "
            "break, or mark the function that calls it @graphcap.eager_on_graph", op=op)
    return CaptureError(
        f"{op} is registered capturable=False and was called inside a graph capture, "
        "which would replay the result of capture: capture the model with "
        "strategy='breakable' (the op runs eagerly between graph segments) or "
        "'tc_piecewise' (eagerly between pieces)", op=op)


def check_op(func, args, kwargs, device: torch.device) -> None:
    """Raise CaptureError if the aten op ``func`` would synchronise with the host, or if
    ``func`` is tagged ``cudagraph_unsafe`` (an op registered ``capturable=False`` called
    as ``torch.ops``: through opsdb, breakable takes a break before it is recorded)."""
    if compat.cudagraph_unsafe(func):
        raise uncapturable(func.name())
    if _moves_to_host(func, args, kwargs, device):
        _raise(str(func.overloadpacket), "a copy between host and device",
               "synchronises the host with the device")
    if not any(t.device == device for t in tensor_leaves((args, kwargs))):
        return  # host tensors only, in a graph of another device's: none of its work
    if func in _SCALAR_READS:
        _raise(str(func.overloadpacket), _SCALAR_READS[func], "reads a device value on the host")
    if func in _DATA_DEPENDENT or _bool_index(func, args):
        what = _DATA_DEPENDENT.get(func, "indexing with a boolean mask")
        _raise(str(func.overloadpacket), what, "has an output size that depends on the data")
    if func is aten.histc.default and _histc_from_data(args, kwargs):
        _raise("aten.histc", "torch.histc without min and max",
               "reads the data's minimum and maximum on the host")
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        _raise("aten.repeat_interleave", "torch.repeat_interleave without output_size",
               "has an output size that depends on the data")
    if func in _HOST_DATA \
            and not (SCALAR_ASSIGNMENT.get() and all(t.dim() == 0 for t in tensor_leaves(args))):
        _raise(str(func.overloadpacket), _HOST_DATA[func], "copies host data into the graph")


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


def check_generator(func, args, kwargs, device: torch.device) -> None:
    """Raise CaptureError for a random op on ``device`` given a generator other than the
    device's default: CUDA capture registers the default one alone (its draws move on at
    each replay), and any other raises at its first draw, before the op launches."""
    for gen in (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)):
        default = _default_generator(gen.device) if gen.device.type == device.type else None
        mine = getattr(gen, "_cdata", None)  # the generator's own, under any Python object
        if default is not None and mine is not None and mine != default._cdata:
            _raise(str(func.overloadpacket), "a random op given a torch.Generator other "
                   "than the device's default", "draws from a generator CUDA capture does "
                   "not register (it registers the default one, whose draws move on at each "
                   "replay: leave generator= out)", kind="a generator of its own")


def check_method(func, args, kwargs, device: torch.device) -> None:
    """Raise CaptureError for Tensor methods that read device memory from the host."""
    named = HOST_METHODS.get(func)
    if named is None and func is torch.Tensor.to:
        target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        # On the CPU emulator .to("cpu") is .to(x.device), a no-op that device-agnostic
        # code runs every forward (transformers' rotary); _moves_to_host agrees.
        if target is not None and target.type == "cpu" and device.type != "cpu":
            named = ("Tensor.to", "Tensor.to('cpu')")
    if named is not None and any(t.device == device for t in tensor_leaves(args[:1])):
        _raise(named[0], named[1], "reads device memory on the host")


def refuse_wait(wait: HostWait) -> None:
    """Raise CaptureError for a call of ``wait`` (one of :data:`HOST_WAITS`)."""
    _raise(wait.op, wait.what, "waits on the host for the device's work")


_SWAP_LOCK = threading.Lock()
_swapped: dict[HostWait, Callable] = {}  # the originals, while any block is open
_open_blocks = [0]


@contextlib.contextmanager
def host_waits_checked(check: Callable[[HostWait, tuple], None]):
    """For the block, every call of a :data:`HOST_WAITS` function first runs ``check(wait,
    args)``, which raises to refuse it. Blocks may overlap, on any threads: the functions
    stay swapped until the last one ends, so ``check`` must be the same for all of them
    and tell the calling thread's capture."""
    with _SWAP_LOCK:
        if not _open_blocks[0]:
            for wait in HOST_WAITS:
                original = _swapped[wait] = getattr(wait.owner, wait.name)
                setattr(wait.owner, wait.name, _checked(original, check, wait))
        _open_blocks[0] += 1
    try:
        yield
    finally:
        with _SWAP_LOCK:
            _open_blocks[0] -= 1
            if not _open_blocks[0]:
                for wait, original in _swapped.items():
                    setattr(wait.owner, wait.name, original)
                _swapped.clear()


def _checked(original: Callable, check: Callable, wait: HostWait) -> Callable:
    @functools.wraps(original)
    def call(*args, **kwargs):
        check(wait, args)
        return original(*args, **kwargs)

    return call


def _value_reads() -> list[str]:
    """The tensors whose values the torch.compile trace in progress read on the host:
    Dynamo turns ``int(t)`` of a 0-d integer tensor of the model into a number taken
    from ``t.item()`` at trace time (a ``CallMethodItemSource``) and guards on it."""
    from torch._dynamo.source import CallMethodItemSource
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    if env is None:
        return []
    names = []
    for sources in env.var_to_sources.values():
        for source in sources:
            if isinstance(source, CallMethodItemSource):
                name = source.name  # a property in newer torch, a method in older
                names.append(name() if callable(name) else name)
    return names


def check_value_guards(guards_checked: bool) -> None:
    """Raise CaptureError, from a torch.compile backend, when the trace read a tensor's
    value on the host and specialised the graph on it, unless ``guards_checked``
    (Dynamo's guards run before every call, so a changed value compiles again). Under
    ``graphcap.capture`` replays run no guard: they would keep the value of capture."""
    reads = [] if guards_checked else _value_reads()
    if reads:
        raise CaptureError(
            f"host synchronisation in a captured region: torch.compile read the value of "
            f"{', '.join(reads)} on the host (int(t), float(t), if t: or operator.index(t) "
            f"of a tensor) and specialised the forward on it, which a graph cannot capture: "
            f"its replays would keep the value of capture. {_ADVICE}",
            op="Tensor.item")


def is_capture_failure(exc: BaseException) -> bool:
    """True when ``exc`` is CUDA refusing an operation during stream capture."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("captur" in text or "cudaerrorstream" in text)


def translate_cuda_failure(exc: BaseException) -> CaptureError:
    """Turn CUDA's capture failure into a CaptureError naming the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    # Inside an interpreted piece: a frame of the model's below the interpreter (a custom
    # op's), else the line the node was traced from.
    inner = [i for i, f in enumerate(frames) if f.filename.endswith("fx/interpreter.py")]
    site = (user_site(frames[inner[-1] + 1:]) if inner else None) or getattr(
        exc, "graphcap_site", None) or user_site(frames)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = site or "an operation in the captured region"
    return CaptureError(
        f"CUDA graph capture failed at {where}: {first}. This is usually a host "
        f"synchronisation (.item(), .cpu(), .tolist(), nonzero, printing a tensor, "
        f"torch.tensor(data, device=...), torch.cuda.synchronize()). {_ADVICE}",
        op=None,
        site=site,
    )
