"""``check_op``: every available kernel of an op against its reference, over hypothesis
examples of the op's own input strategy; on every example the op's fake against the
reference and the kernels' writes against the schema, and ``torch.library.opcheck`` on
several non-degenerate examples. An op registered with torch outside opsdb is checked the
same way, given its reference and input strategy."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from graphcap.compat.library import device_types_of, overload_of
from graphcap.core.trees import tensor_leaves
from graphcap.opsdb.spec import REGISTRY, Kernel, OpSpec

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def default_tolerance(dtype: torch.dtype) -> float:
    """atol = rtol for comparing a kernel with its float32-accumulating reference."""
    return _TOLERANCE.get(dtype, 0.0)


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


def _clone(args):
    return tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)


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


def _results(spec: OpSpec, name: str, fn, args):
    """What a call produces: its return value, plus every argument it may write (an
    optional one where given). A tensor argument the schema does not declare written
    (``Tensor(a!)``) must come back unchanged, bit for bit."""
    args = _clone(args)
    before = _clone(args)
    out = fn(*args)
    written = _written(spec)
    for i, (now, then) in enumerate(zip(args, before, strict=True)):
        if i in written or not isinstance(now, torch.Tensor):
            continue
        same = now.shape == then.shape and torch.equal(
            now.isnan(), then.isnan()) and torch.equal(now.nan_to_num(), then.nan_to_num())
        assert same, (f"{spec.qualname}[{name}] wrote its argument {i} "
                      f"({_overload(spec)._schema.arguments[i].name}), which the schema "
                      f"{spec.schema} does not declare written: mark it Tensor(a!), or "
                      f"write into a copy on inputs {describe(args)}")
    return tensor_leaves(out) + [args[i] for i in written if args[i] is not None]


def describe(args) -> str:
    """A short, readable account of an op's arguments (shapes, dtypes, host values)."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"Tensor({str(a.dtype).removeprefix('torch.')}, {tuple(a.shape)})")
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


def _check_fake(spec: OpSpec, args, want: list[torch.Tensor]) -> None:
    """The op's fake (given or derived) must give the reference's output metadata."""
    mode = FakeTensorMode()
    fakes = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args)
    with mode:
        out = tensor_leaves(_overload(spec)(*fakes))
    real = _outputs(spec, args, want)
    got, expected = [_layout(t) for t in out], [_layout(t) for t in real]
    assert got == expected, (
        f"{spec.qualname}: its fake returns {got} but the reference returns {expected} "
        f"(shape, dtype, device, strides) on inputs {describe(args)}: make them agree "
        f"(torch.compile and the graphs trust the fake, Inductor asserts its strides, and "
        f"the reference runs as kernel 'torch')")


def _outputs(spec: OpSpec, args, results: list[torch.Tensor]) -> list[torch.Tensor]:
    """The returned tensors of ``_results``' list (the written arguments left out)."""
    return results[:len(results) - sum(args[i] is not None for i in _written(spec))]


def _layout(t: torch.Tensor) -> tuple:
    """What Inductor checks of an op's output (``assert_size_stride``): its shape, dtype,
    device, and the stride of each dim of more than one element (none of an empty one)."""
    strides = () if t.numel() == 0 else tuple(
        st if n > 1 else None for n, st in zip(t.shape, t.stride(), strict=True))
    return tuple(t.shape), t.dtype, t.device.type, strides


def compare(spec: OpSpec, kernel: str, args, atol: float, rtol: float) -> float:
    """Run ``kernel`` and the reference on copies of ``args``; assert close; max error."""
    want = _results(spec, "torch", spec.reference, args)
    got = _results(spec, kernel, spec.kernels[kernel].resolve(), args)
    assert len(got) == len(want), f"{spec.qualname}[{kernel}]: {len(got)} results"
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert _layout(g) == _layout(w), (
            f"{spec.qualname}[{kernel}]: got {g.dtype}{tuple(g.shape)} strides {g.stride()}, "
            f"want {w.dtype}{tuple(w.shape)} strides {w.stride()} (the reference's, which "
            f"the fake must give) on inputs {describe(args)}")
        diff = (g.double() - w.double()).abs()[~(g.isnan() & w.isnan())]
        err = diff.max().item() if diff.numel() else 0.0
        worst = max(worst, err)
        torch.testing.assert_close(  # NaN where the reference has NaN (an unread slot)
            g, w, atol=atol, rtol=rtol, equal_nan=True,
            msg=lambda m, e=err: f"{spec.qualname}[{kernel}] on inputs {describe(args)}: "
                                 f"max error {e:.3g}. {m}")
    return worst


def _richness(args, outputs=()) -> tuple[bool, bool, int]:
    """How well an example exercises opcheck: outputs without NaN first (opcheck compares
    the traced op's outputs with eager's by ``assert_close``, for which NaN differs from NaN),
    then every tensor with two or more elements along each dim and values that are not
    all equal (a mutation of a constant or empty tensor can leave it as it was), then its
    size."""
    no_nan = not any(bool(t.isnan().any()) for t in outputs if t.is_floating_point())
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
    tuples; for an opsdb op it replaces the registered strategy). On every
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
        tol_a = atol if atol is not None else default_tolerance(dtype)
        tol_r = rtol if rtol is not None else default_tolerance(dtype)
        _check_dtype(spec, inputs(device, dtype), names, examples, tol_a, tol_r,
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


def _check_dtype(spec, strategy, names, examples, atol, rtol, opchecks, report):
    from hypothesis import HealthCheck, given, settings

    candidates: list[tuple[tuple[bool, bool, int], tuple]] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(args):
        report.examples += 1
        want = _results(spec, "torch", spec.reference, args)
        _check_fake(spec, args, want)
        if opchecks:
            candidates.append((_richness(args, _outputs(spec, args, want)), _clone(args)))
            candidates.sort(key=lambda c: c[0], reverse=True)
            del candidates[opchecks:]
        for name in names:
            if spec.kernels[name].declines(args):
                report.declined[name] = report.declined.get(name, 0) + 1
                continue  # a shape this kernel has no variant for: dispatch passes it over
            err = compare(spec, name, args, atol, rtol)
            report[name] = max(report.get(name, 0.0), err)

    run()
    for _, args in candidates:
        torch.library.opcheck(_overload(spec), _clone(args))
        report.opchecked += 1
