"""OpSpec and the op registry: one entry per custom op, with its kernels by name.

An op is defined once through torch.library (so torch.compile sees it) and dispatches to
a kernel: the explicit ``kernel=`` of ``spec(..., kernel=...)``, else the environment
variable ``GRAPHCAP_<OP>_KERNEL``, else the first available kernel of the spec's
preference order. Optional libraries import lazily: a kernel names its module as a
string, so ``import graphcap`` never needs Triton, FlashInfer or FlashAttention, and an
unavailable kernel says why.

Example, a user's op with a derived fake::

    import graphcap, torch

    def ref(x: torch.Tensor, alpha: float) -> torch.Tensor:
        return x * alpha

    scale = graphcap.register_op("myproj::scale", "(Tensor x, float alpha) -> Tensor",
                                 reference=ref)
    torch.ops.myproj.scale(torch.ones(3), 2.0)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphcap import compat, env
from graphcap.compat.library import (
    complete,
    define_op,
    parse_schema,
    refuses_arguments,
    split_qualname,
)
from graphcap.core.breaks import breakable_capture, run_maybe_as_break
from graphcap.core.hostsync import uncapturable
from graphcap.errors import GraphcapError, KernelUnavailable, OpInputError

HALF = (torch.float16, torch.bfloat16)  # what most vendor kernels (FlashInfer) accept


@functools.cache
def _importable(module: str) -> bool:
    """Whether ``module`` can be imported (asked on every op call: cached, since a
    package's presence does not change while the process runs)."""
    return importlib.util.find_spec(module) is not None


def unavailable(device: torch.device, devices: tuple[str, ...], requires: tuple[str, ...],
                interpreted: bool = True) -> str | None:
    """Why code for ``devices`` needing the modules ``requires`` cannot run on ``device``,
    or None. Triton code runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``)
    unless ``interpreted=False``: automatic selection never picks the interpreter."""
    device_ok = device.type in devices or (
        interpreted and device.type == "cpu" and "triton" in requires
        and env.settings().triton_interpret)
    if not device_ok:
        return f"runs on {'/'.join(devices)} tensors, not {device.type}"
    for module in requires:
        if not _importable(module):
            return f"needs the Python package {module!r}, which is not installed"
    return None


@dataclass
class Kernel:
    """One implementation of an op. ``fn`` is a callable or ``"module:function"``
    (imported on first use); ``requires`` names modules that must be importable;
    ``devices`` the device types it runs on; ``dtypes`` (None: any) the floating dtypes
    it accepts; ``accepts(*args)`` (optional) returns why it cannot take these arguments
    (a shape it has no variant for, say), or None: automatic selection then passes over
    it for that call; ``interpretable``: a kernel requiring Triton that Triton's
    interpreter runs on CPU tensors (False: one that also launches compiled CUDA code)."""

    fn: Callable | str
    devices: tuple[str, ...] = ("cuda",)
    requires: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] | None = None
    accepts: Callable[..., str | None] | None = None
    interpretable: bool = True
    _resolved: Callable | None = field(default=None, repr=False)

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None,
                    interpreted: bool = True) -> str | None:
        """Why this kernel cannot run on ``device`` (for ``dtype``), or None when it can
        (see :func:`unavailable`)."""
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"takes {names}, not {str(dtype).removeprefix('torch.')}"
        return unavailable(device, self.devices, self.requires,
                           interpreted and self.interpretable)

    def declines(self, args) -> str | None:
        """Why this kernel cannot take ``args`` (host-side shape checks), or None."""
        return None if self.accepts is None else self.accepts(*args)

    def resolve(self) -> Callable:
        if self._resolved is None:
            if callable(self.fn):
                self._resolved = self.fn
            else:
                module, _, attr = self.fn.partition(":")
                self._resolved = getattr(importlib.import_module(module), attr)
        return self._resolved


@dataclass
class OpSpec:
    """Everything graphcap knows about one custom op."""

    qualname: str
    schema: str
    reference: Callable
    kernels: dict[str, Kernel] = field(default_factory=dict)
    fake: Callable | None = None
    capturable: bool = True
    split: bool = False
    check: Callable[..., None] | None = None
    inputs: Callable[..., Any] | None = None
    doc: str = ""
    static_state: Callable[[], object] | None = None  # split op: its static state now, or None
    fake_derived: bool = field(default=False, init=False)
    arguments: tuple = field(default=(), init=False, repr=False)  # the schema's, parsed
    _runnable_cache: dict = field(default_factory=dict, init=False, repr=False)
    op: Any = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return split_qualname(self.qualname)[1]

    def _from_environment(self) -> str | None:
        """The kernel ``GRAPHCAP_<OP>_KERNEL`` names, for graphcap's own ops (another
        namespace's op of the same name is not picked by it)."""
        chosen = env.settings().kernels
        if not chosen:
            return None
        _unknown_variables(chosen)
        return chosen.get(self.name) if self.qualname.startswith("graphcap::") else None

    @property
    def env_var(self) -> str:
        """The variable that picks this op's kernel (``GRAPHCAP_RMS_NORM_KERNEL``)."""
        return env.kernel_variable(self.name)

    def available(self, device: torch.device | str, dtype: torch.dtype | None = None
                  ) -> dict[str, str | None]:
        """Every kernel with None when it runs on ``device`` (and ``dtype``), else why not."""
        device = torch.device(device)
        return {name: k.unavailable(device, dtype) for name, k in self.kernels.items()}

    def select(self, device: torch.device | str, kernel: str | None = None,
               dtype: torch.dtype | None = None, args: tuple | None = None) -> str:
        """The kernel a call on ``device`` runs: ``kernel``, else the one its environment
        variable names, else the best that runs here (and takes ``args``, when given)."""
        device = torch.device(device)
        wanted = kernel or self._from_environment()
        if wanted is not None:
            if wanted not in self.kernels:
                source = "kernel=" if kernel else f"{self.env_var}="
                raise KernelUnavailable(
                    f"{self.qualname}: {source}{wanted!r} is not a kernel of this op; "
                    f"choose one of {sorted(self.kernels)}")
            why = self.kernels[wanted].unavailable(device, dtype)
            if why:
                raise KernelUnavailable(f"{self.qualname}: kernel {wanted!r} {why}")
            why = self.kernels[wanted].declines(args) if args is not None else None
            if why:
                raise OpInputError(f"{self.qualname}: kernel {wanted!r} cannot take these "
                                   f"inputs: {why}. Choose another kernel for them.")
            return wanted
        for name in self._runnable(device.type, dtype):
            if args is None or self.kernels[name].declines(args) is None:
                return name
        raise KernelUnavailable(f"{self.qualname}: no kernel runs on {device}")

    def _runnable(self, device_type: str, dtype: torch.dtype | None) -> tuple[str, ...]:
        """Kernels that run on this device type and dtype, best first. Cached: models call
        ops thousands of times per second, and eager breaks pay this on the host."""
        key = (device_type, dtype, tuple(self.kernels))
        names = self._runnable_cache.get(key)
        if names is None:
            device = torch.device(device_type)
            names = tuple(n for n, k in self.kernels.items()
                          if k.unavailable(device, dtype, interpreted=False) is None)
            self._runnable_cache[key] = names
        return names

    def kernel_for(self, device: torch.device | str, kernel: str | None = None,
                   dtype: torch.dtype | None = None, args: tuple | None = None) -> Callable:
        """The callable of :meth:`select`'s kernel."""
        return self.kernels[self.select(device, kernel, dtype, args)].resolve()

    def __call__(self, *args, kernel: str | None = None):
        """Call the op (models built from opsdb call this). A split op becomes a break
        under breakable capture (replayed as its own graph when ``static_state()`` says its
        state is static, else eagerly), and so does an op registered ``capturable=False``
        (always eagerly), which any other capture refuses. ``kernel=`` calls one kernel
        directly (eager)."""
        if kernel is None:
            if torch.compiler.is_compiling():  # tc_piecewise: split by its tags
                return self.op(*args)
            if not self.capturable:
                return self._uncaptured(args)
            if self.split:
                return run_maybe_as_break(self.op, args, {}, self.static_state)
            return self.op(*args)
        if len(args) != len(self.arguments):  # the rest at their schema defaults
            args = complete(self.arguments, args, {})
        if self.check is not None:
            self.check(*args)
        return self.kernel_for(device_of(args), kernel, dtype_of(args), args)(*args)

    def _uncaptured(self, args):
        """An op no graph may hold: an eager break under breakable capture (and at its
        replays), a ``CaptureError`` inside any other capture, else a plain call."""
        from graphcap.core.graphs import capturing

        if breakable_capture():
            return run_maybe_as_break(self.op, args, {}, None)
        if capturing():
            raise uncapturable(self.qualname)
        return self.op(*args)


def device_of(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def dtype_of(args) -> torch.dtype | None:
    """The dtype that picks a kernel: the first floating-point tensor argument's."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return None


REGISTRY: dict[str, OpSpec] = {}


def _unknown_variables(chosen: dict[str, str]) -> None:
    """Warn, once a variable, of ``GRAPHCAP_<OP>_KERNEL`` naming no op of graphcap's
    (each variable looked at once: ops call this at every kernel choice)."""
    new = set(chosen) - _SEEN
    if not new:
        return
    _SEEN.update(new)
    ours = {spec.name for q, spec in REGISTRY.items() if q.startswith("graphcap::")}
    for name in sorted(new - ours):
        warnings.warn(f"{env.kernel_variable(name)}: graphcap has no op {name!r}; the "
                      f"variable is ignored (its ops: {', '.join(sorted(ours))})",
                      stacklevel=4)


_SEEN: set[str] = set()  # the variables looked at


def register_op(qualname: str, schema: str, *, reference: Callable,
                kernels: dict[str, Kernel | Callable | str] | None = None,
                fake: Callable | None = None, capturable: bool = True, split: bool = False,
                check: Callable[..., None] | None = None, inputs: Callable | None = None,
                doc: str = "", dispatch: Callable | None = None,
                static_state: Callable[[], object] | None = None,
                graphable: Callable[[], object] | None = None) -> OpSpec:
    """Register a custom op: define it in torch.library and add it to the registry.

    ``schema`` is the signature without the name, e.g. ``"(Tensor x, float eps) -> Tensor"``;
    arguments an op writes are marked ``Tensor(a!)``. Every function given here but
    ``inputs`` and ``static_state`` is called with every argument of the schema
    positionally, in the schema's order (defaults filled in, keyword-only arguments
    too), and one that cannot take them so is refused here. ``reference`` is the plain torch
    implementation, always available as kernel ``"torch"``. ``kernels`` maps further
    kernel names, in preference order, to a :class:`Kernel` (or a callable / ``"module:fn"``
    string for a CUDA kernel). ``fake`` computes output metadata for torch.compile; when
    omitted the reference itself runs on fake tensors, which works for any reference
    without data-dependent Python (no ``.item()``, ``.tolist()``, ``nonzero``).
    ``capturable=False`` marks an op unsafe inside a CUDA graph; ``split=True`` makes it
    a split point (tc_piecewise) and an eager break (breakable). ``check(*args)`` raises
    :class:`OpInputError` on bad input before any launch. ``inputs(device, dtype)``
    returns a hypothesis strategy of valid argument tuples. ``dispatch`` replaces the
    per-call kernel choice for ops whose kernel follows from other state (attention: the
    backend that prepared the forward's metadata). ``static_state()`` (split ops) returns the
    object holding the op's per-batch state when that state lives in static buffers (or
    None): the op's break or piece is then captured as its own graph and replayed while
    that object stays current, rather than run eagerly (``graphable=``, its former name,
    is deprecated).
    """
    if graphable is not None:
        if static_state is not None:
            raise TypeError(f"register_op({qualname!r}): give static_state= only "
                            "(graphable= is its deprecated former name)")
        warnings.warn("register_op(graphable=...) is deprecated: pass static_state=",
                      DeprecationWarning, stacklevel=2)
        static_state = graphable
    if qualname in REGISTRY:
        raise GraphcapError(
            f"op {qualname!r} is registered already; pick another name or reuse "
            f"graphcap.opsdb.get_op({qualname!r})")
    if "torch" in (kernels or {}):  # the reference's name: it would replace the kernel
        raise GraphcapError(
            f"register_op({qualname!r}): kernels names a kernel 'torch', the name of the "
            "reference (always a kernel, and the last preferred); give your kernel "
            "another name")
    parsed = parse_schema(qualname, schema)
    table: dict[str, Kernel] = {}
    for name, kernel in (kernels or {}).items():
        table[name] = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    roles = [("reference", reference), ("fake", fake), ("check", check),
             ("dispatch", dispatch)] + [(f"kernels[{n!r}]", k.fn) for n, k in table.items()]
    for role, fn in roles:
        why = refuses_arguments(fn, parsed) if callable(fn) else None  # "module:fn": lazy
        if why:
            raise GraphcapError(
                f"register_op({qualname!r}): its {role} cannot take the schema's arguments "
                f"{schema.split('->')[0].strip()}, which opsdb passes positionally in that "
                f"order: {why}. Give it one positional parameter per schema argument, in "
                f"the schema's order (keyword-only arguments of the schema included).")
    table["torch"] = Kernel(reference, devices=("cpu", "cuda"))
    spec = OpSpec(qualname, schema, reference, table, fake, capturable, split, check,
                  inputs, doc, static_state)
    spec.fake_derived = fake is None
    spec.arguments = tuple(parsed.arguments)

    def impl(*args):
        if not capturable and torch.cuda.is_available() \
                and torch.cuda.is_current_stream_capturing():  # a torch.ops call
            raise uncapturable(qualname)
        if spec.check is not None:
            spec.check(*args)
        if dispatch is not None:
            return dispatch(*args)
        return spec.kernel_for(device_of(args), dtype=dtype_of(args), args=args)(*args)

    tags = (torch.Tag.cudagraph_unsafe,) if (
        not capturable and compat.HAS_CUDAGRAPH_UNSAFE_TAG) else ()
    spec.op = define_op(qualname, schema, impl, fake or reference, tags)
    REGISTRY[qualname] = spec
    return spec


def get_op(name: str) -> OpSpec:
    """The spec of ``name`` (``"rms_norm"`` or ``"graphcap::rms_norm"``)."""
    qualname = name if "::" in name else f"graphcap::{name}"
    if qualname not in REGISTRY:
        raise KeyError(f"no op {name!r} in opsdb; registered: {sorted(REGISTRY)}")
    return REGISTRY[qualname]
