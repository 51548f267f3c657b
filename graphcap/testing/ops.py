"""``check_op``: every available kernel of an op against its reference, over hypothesis
examples of the op's own input strategy; on every example the op's fake against the
reference and the kernels' writes against the schema, and ``torch.library.opcheck`` on
several non-degenerate examples. An op registered with torch outside opsdb is checked the
same way, given its reference and input strategy."""

from __future__ import annotations

import math

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_flatten, tree_map

from graphcap.compat.library import device_types_of, overload_of
from graphcap.core.trees import reach, tensor_leaves
from graphcap.opsdb.spec import REGISTRY, Kernel, OpSpec

_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 1e-2,
              torch.bfloat16: 2e-2}
_GUARD = 16  # elements past a copy's span (a Triton kernel's missing mask writes there)


def default_tolerance(dtype: torch.dtype) -> float:
    """atol = rtol for comparing a kernel with its float32-accumulating reference (0:
    exactly, as integers and booleans)."""
    return _TOLERANCE.get(dtype, 0.0)


def _tolerances(t: torch.Tensor, dtype: torch.dtype, atol, rtol) -> tuple[float, float]:
    """(atol, rtol) for an output ``t`` of an example of ``dtype``: integers and booleans
    exactly (an index within a float tolerance is another index); floats within the
    caller's, else the looser of ``dtype``'s and ``t``'s own (a bfloat16 output of a
    float32 example rounds a 1e-6 difference to an ulp)."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0.0, 0.0
    base = max(default_tolerance(dtype), default_tolerance(t.dtype))
    return (atol if atol is not None else base, rtol if rtol is not None else base)


class CheckReport(dict):
    """What :func:`check_op` did: the max error of each kernel it compared (the mapping
    itself), ``skipped`` (a kernel it did not compare, and why), ``declined`` (examples a
    compared kernel passed over, by kernel) and ``opchecked`` (examples opcheck ran on).
    ``str(report)`` says it in a few lines."""

    def __init__(self, qualname: str):
        super().__init__()
        self.qualname = qualname
        self.skipped: dict[str, str] = {}
        self.declined: dict[str, int] = {}
        self.examples = 0
        self.opchecked = 0

    def __str__(self) -> str:
        lines = [f"check_op {self.qualname}: {self.examples} examples, opcheck on "
                 f"{self.opchecked}"]
        lines += [f"  compared {name}: max error {err:.3g}"
                  + (f" ({self.declined[name]} examples declined)"
                     if self.declined.get(name) else "") for name, err in self.items()]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides: a slice of a wider tensor (``qkv[:, :q]``), a
    transpose, an expanded tensor stay so (``clone`` makes a tensor that is not dense
    contiguous, and a kernel that ignores strides would pass)."""
    if t.layout != torch.strided or t.numel() == 0:
        return t.clone()
    with torch.no_grad():  # the span the view reads, then a guard a stray write hits
        elements = torch.cat([t.as_strided((reach(t) + 1,), (1,)),
                              t.new_full((_GUARD,), math.nan if t.is_floating_point() else 0)])
        copy = elements.as_strided(t.shape, t.stride())
    return copy.requires_grad_(t.requires_grad)


def _beside(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t``'s copy's memory outside its view (the rest of a qkv, the guard)."""
    whole = t.new_empty(0).set_(t.untyped_storage())
    keep = torch.ones(whole.shape, dtype=torch.bool, device=t.device)
    keep.as_strided(t.shape, t.stride(), t.storage_offset()).fill_(False)
    return _bits(whole)[keep]


def _clone(args):
    return tree_map(lambda a: _copy(a) if isinstance(a, torch.Tensor) else a, args)


def _overload(spec: OpSpec) -> torch._ops.OpOverload:
    """The overload checked: an opsdb op's default, or the one an op outside opsdb named."""
    return spec.op if isinstance(spec.op, torch._ops.OpOverload) else spec.op.default


def _written(spec: OpSpec) -> list[int]:
    return [i for i, a in enumerate(_overload(spec)._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def spec_of(op, reference=None, inputs=None) -> OpSpec:
    """What :func:`check_op` checks: an opsdb op's spec, or, for an op registered with
    torch outside opsdb, a spec whose one kernel ``"op"`` is the op itself, compared with
    ``reference`` over ``inputs``."""
    if isinstance(op, OpSpec):
        spec = op
    else:
        name = f"graphcap::{op}" if isinstance(op, str) and "::" not in op else op
        spec = REGISTRY.get(name) if isinstance(name, str) else None
        if spec is None:
            try:
                overload = overload_of(name)
            except ValueError as e:
                raise ValueError(f"{name!r} is not in opsdb; {e}") from None
            spec = REGISTRY.get(overload.name())  # an opsdb op named by its overload
            if spec is None:
                return _outside(overload, reference, inputs)
    if reference is not None:
        raise ValueError(f"{spec.qualname} is an opsdb op: check_op compares its kernels "
                         f"with the reference it was registered with; reference= is for ops "
                         f"registered outside opsdb")
    return spec


def _outside(overload, reference, inputs) -> OpSpec:
    """The spec of an op registered with torch (``torch.library.custom_op``, ``Library``)
    but not through opsdb."""
    qualname = overload.name()
    if reference is None or inputs is None:
        raise ValueError(
            f"{qualname} is not registered in opsdb, so check_op needs what opsdb would "
            f"know: reference= (a plain torch function of the op's arguments that computes "
            f"what it must) and inputs= ((device, dtype) -> a hypothesis strategy of "
            f"argument tuples); or register it with graphcap.register_op")
    schema = str(overload._schema).removeprefix(qualname)
    kernel = Kernel(overload, devices=device_types_of(overload))
    spec = OpSpec(qualname, schema, reference, {"op": kernel}, inputs=inputs)
    spec.op = overload
    return spec


def _results(spec: OpSpec, name: str, fn, args) -> tuple[list, list[torch.Tensor]]:
    """What a call produces: every leaf of its return value (tensors and host values),
    and every tensor of the arguments it may write (an optional one where given). A tensor
    argument the schema does not declare written (``Tensor(a!)``), in a list or not,
    must come back unchanged, bit for bit."""
    args = _clone(args)
    before = _clone(args)
    try:
        out = fn(*args)
    except Exception as e:
        e.add_note(f"raised by {spec.qualname}[{name}] on inputs {describe(args)}")
        raise
    written = _written(spec)
    for i, (now, then) in enumerate(zip(args, before, strict=True)):
        for t, t0 in zip(tensor_leaves(now), tensor_leaves(then), strict=True):
            assert t.layout != torch.strided or torch.equal(_beside(t), _beside(t0)), (
                f"{spec.qualname}[{name}] wrote outside its argument {i} "
                f"({_overload(spec)._schema.arguments[i].name}): memory beside the view "
                f"(the rest of the tensor it was sliced from, or past its end) changed on "
                f"inputs {describe(args)}: check the kernel's strides and masks")
            if i in written:
                continue
            same = t.shape == t0.shape and torch.equal(_bits(t), _bits(t0))
            assert same, (f"{spec.qualname}[{name}] wrote its argument {i} "
                          f"({_overload(spec)._schema.arguments[i].name}), which the "
                          f"schema {spec.schema} does not declare written: mark it "
                          f"Tensor(a!), or write into a copy on inputs {describe(args)}")
    return tree_flatten(out)[0], [t for i in written for t in tensor_leaves(args[i])]


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (a float's NaN, inf and -0.0 each as it is stored), or
    ``t`` itself where it holds integers or bools."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return t
    return t.contiguous().view(_INTS[t.element_size()])


def describe(args) -> str:
    """A short, readable account of an op's arguments (shapes, dtypes, host values)."""
    def one(a) -> str:
        if isinstance(a, torch.Tensor):
            return f"Tensor({str(a.dtype).removeprefix('torch.')}, {tuple(a.shape)})"
        if isinstance(a, (list, tuple)):
            return f"[{', '.join(map(one, a))}]"
        return repr(a)

    return "(" + ", ".join(map(one, args)) + ")"


def _check_fake(spec: OpSpec, args, want: list) -> None:
    """The op's fake (given or derived) must give the reference's output metadata; a size
    it leaves to the data (``get_ctx().new_dynamic_size()``) takes the reference's."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = tree_map(lambda a: mode.from_tensor(a, static_shapes=True)
                     if isinstance(a, torch.Tensor) else a, args)
    with mode:
        out = tensor_leaves(_overload(spec)(*fakes))
    real = [t for t in want if isinstance(t, torch.Tensor)]
    sizes = {}  # each unbacked size of the fake's, as the reference's output has it
    for f, r in zip(out, real, strict=False):
        for n, m in zip(f.shape, r.shape, strict=False):
            if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                sizes.setdefault(n.node.expr, sympy.Integer(m))
    got, expected = [_layout(t, sizes) for t in out], [_layout(t) for t in real]
    assert got == expected, (
        f"{spec.qualname}: its fake returns {got} but the reference returns {expected} "
        f"(shape, dtype, device, strides) on inputs {describe(args)}: make them agree "
        f"(torch.compile and the graphs trust the fake, Inductor asserts its strides, and "
        f"the reference runs as kernel 'torch')")


def _layout(t: torch.Tensor, sizes=None) -> tuple:
    """What Inductor checks of an op's output (``assert_size_stride``): its shape, dtype,
    device, and the stride of each dim of more than one element (none of an empty one).
    ``sizes``: values for a fake tensor's unbacked sizes (one left unknown stays so)."""
    def known(n):
        if isinstance(n, torch.SymInt):
            expr = n.node.expr.xreplace(sizes or {})
            return int(expr) if expr.is_number else str(expr)
        return n

    shape, stride = [known(n) for n in t.shape], [known(st) for st in t.stride()]
    strides = () if 0 in shape else tuple(
        st if n != 1 else None for n, st in zip(shape, stride, strict=True))
    return tuple(shape), t.dtype, t.device.type, strides


def compare(spec: OpSpec, kernel: str, args, atol: float | None, rtol: float | None,
            dtype: torch.dtype = torch.float32) -> float:
    """Run ``kernel`` and the reference on copies of ``args``; assert close (tolerances:
    ``atol``/``rtol``, else by ``dtype`` and each output's own); max error."""
    want_out, want_written = _results(spec, "torch", spec.reference, args)
    got_out, got_written = _results(spec, kernel, spec.kernels[kernel].resolve(), args)
    label = f"{spec.qualname}[{kernel}]"
    assert len(got_out) == len(want_out), (
        f"{label} returns {len(got_out)} values, the reference {len(want_out)} "
        f"({_kinds(got_out)} against {_kinds(want_out)}) on inputs {describe(args)}")
    pairs = [(f"output {i}", g, w) for i, (g, w) in enumerate(
        zip(got_out, want_out, strict=True))]
    names = [a.name for i, a in enumerate(_overload(spec)._schema.arguments)
             if i in _written(spec) for _ in tensor_leaves(args[i])]
    pairs += [(f"written argument {n}", g, w) for n, g, w in zip(
        names, got_written, want_written, strict=True)]
    worst = 0.0
    for what, g, w in pairs:
        if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)):
            same = not isinstance(g, torch.Tensor) and not isinstance(w, torch.Tensor) and (
                g == w or isinstance(g, float) and isinstance(w, float)
                and math.isnan(g) and math.isnan(w))
            assert same, (f"{label}: {what} is {g!r}, the reference's {w!r} on inputs "
                          f"{describe(args)}")
            continue
        assert _layout(g) == _layout(w), (
            f"{label}: {what} is {g.dtype}{tuple(g.shape)} strides {g.stride()}, want "
            f"{w.dtype}{tuple(w.shape)} strides {w.stride()} (the reference's, which "
            f"the fake must give) on inputs {describe(args)}")
        same = (g == w) | (g.isnan() & w.isnan())  # inf where the reference has inf too
        diff = (g.double() - w.double()).abs()[~same]
        err = diff.max().item() if diff.numel() else 0.0
        worst = max(worst, err)
        tol_a, tol_r = _tolerances(w, dtype, atol, rtol)
        torch.testing.assert_close(  # NaN where the reference has NaN (an unread slot)
            g, w, atol=tol_a, rtol=tol_r, equal_nan=True,
            msg=lambda m, e=err, what=what: f"{label} on inputs {describe(args)}: {what}, "
                                            f"max error {e:.3g}. {m}")
    return worst


def _kinds(values) -> str:
    return "(" + ", ".join("Tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                           for v in values) + ")"


def _richness(args, outputs=()) -> tuple[bool, bool, int]:
    """How well an example exercises opcheck: outputs without NaN first (opcheck compares
    the traced op's outputs with eager's by ``assert_close``, for which NaN differs from NaN),
    then every tensor with two or more elements along each dim and values that are not
    all equal (a mutation of a constant or empty tensor can leave it as it was), then its
    size."""
    no_nan = not any(bool(t.isnan().any()) for t in outputs
                     if isinstance(t, torch.Tensor) and t.is_floating_point())
    tensors = [a for a in args if isinstance(a, torch.Tensor)]

    def rich(t: torch.Tensor) -> bool:
        if t.dim() == 0:
            return True
        return min(t.shape) >= 2 and bool((t != t.flatten()[0]).any())

    return no_nan, bool(tensors) and all(map(rich, tensors)), sum(t.numel() for t in tensors)


def check_op(op, kernel: str | None = None, *, reference=None, inputs=None, device="cpu",
             dtypes=(torch.float32, torch.float16, torch.bfloat16), examples: int = 20,
             atol: float | None = None, rtol: float | None = None,
             opcheck: bool = True, opchecks: int = 3) -> CheckReport:
    """Check ``kernel`` (default: every kernel available on ``device``) of ``op``
    against its reference over ``examples`` hypothesis examples per dtype.

    ``op``: an opsdb op (its name, ``"rms_norm"`` or ``"graphcap::rms_norm"``, or spec),
    or an op registered with torch outside opsdb (a ``torch.library.custom_op``, an
    ``OpOverload`` or ``OpOverloadPacket``, or its qualified name): that op is then the
    one kernel ``"op"``, compared with ``reference`` (a plain torch function of the op's
    arguments), over ``inputs`` (``(device, dtype)`` -> a hypothesis strategy of argument
    tuples; for an opsdb op it replaces the registered strategy). Every call gets copies
    of the inputs with their strides; every output and written tensor is compared (floats
    within ``atol``/``rtol``, else the looser of the example dtype's and their own
    :func:`default_tolerance`; integers, booleans and host values exactly). On every
    example the op's fake must give the reference's output shapes, dtypes and strides,
    and every kernel its strides (Inductor asserts what the fake gave; the reference runs
    as kernel ``"torch"``), and no kernel may write an argument the schema does not
    declare written; with ``opcheck``, ``torch.library.opcheck`` (schema, fake tensors,
    autograd registration, aot dispatch) runs on the ``opchecks`` richest examples of
    each dtype (outputs without NaN first, then tensors of two or more elements along
    each dim, not constant), not only hypothesis's minimal one.

    Returns a :class:`CheckReport`: the max error per compared kernel, and the kernels it
    skipped with the reason (not runnable here, or declining every example). Raises with
    hypothesis's shrunk failing input on a mismatch."""
    spec = spec_of(op, reference, inputs)
    inputs = inputs or spec.inputs
    if inputs is None:
        raise ValueError(f"{spec.qualname} has no input strategy: pass inputs= when "
                         "registering it, or to check_op")
    if kernel is not None and kernel not in spec.kernels:
        raise ValueError(f"{spec.qualname} has no kernel {kernel!r}; it has "
                         f"{sorted(spec.kernels)}")
    device, dtypes = torch.device(device), list(dtypes)
    if not dtypes:
        raise ValueError("check_op: dtypes is empty, so nothing would be checked; give one "
                         "or more, e.g. dtypes=(torch.float32,)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"check_op: device={str(device)!r}, but torch sees no CUDA GPU "
                         "here; check on 'cpu' (Triton's interpreter), or on a GPU machine")
    report = CheckReport(spec.qualname)
    for dtype in dtypes:
        names = []
        for name, why in spec.available(device, dtype).items():
            if kernel is not None and name != kernel or kernel is None and name == "torch":
                continue
            if why is None:
                names.append(name)
            else:
                report.skipped.setdefault(name, why)
        _check_dtype(spec, inputs(device, dtype), names, examples, (atol, rtol, dtype),
                     opchecks if opcheck else 0, report)
    for name in list(report.skipped):
        if name in report:  # runnable for another dtype
            del report.skipped[name]
    for name, count in report.declined.items():
        if name not in report and count:
            report.skipped[name] = f"declined all {count} examples it was offered"
    if kernel is not None and kernel not in report:
        raise ValueError(f"check_op: kernel {kernel!r} of {spec.qualname} was not checked: "
                         f"it {report.skipped.get(kernel, 'ran on no example')}; check it "
                         "where it runs (its device, dtypes and inputs)")
    return report


def _check_dtype(spec, strategy, names, examples, tolerance, opchecks, report):
    from hypothesis import HealthCheck, given, settings

    candidates: list[tuple[tuple[bool, bool, int], tuple]] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(args):
        schema = _overload(spec)._schema.arguments  # an argument with a default may be left
        if not isinstance(args, (tuple, list)) or not sum(
                not a.has_default_value() for a in schema) <= len(args) <= len(schema):
            got = describe(args) if isinstance(args, (tuple, list)) else f"a {type(args).__name__}"
            raise TypeError(f"{spec.qualname}: its input strategy gave {got}, not a tuple of "
                            f"the op's arguments {spec.schema}: give (x,) for one (.map)")
        report.examples += 1
        want, _ = _results(spec, "torch", spec.reference, args)
        _check_fake(spec, args, want)
        if opchecks:
            candidates.append((_richness(args, want), _clone(args)))
            candidates.sort(key=lambda c: c[0], reverse=True)
            del candidates[opchecks:]
        for name in names:
            if spec.kernels[name].declines(args):
                report.declined[name] = report.declined.get(name, 0) + 1
                continue  # a shape this kernel has no variant for: dispatch passes it over
            err = compare(spec, name, args, *tolerance)
            report[name] = max(report.get(name, 0.0), err)

    run()
    for _, args in candidates:
        torch.library.opcheck(_overload(spec), _clone(args))
        report.opchecked += 1
