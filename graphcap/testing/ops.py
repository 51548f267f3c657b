"""``check_op``: every available kernel of an op against its reference, over hypothesis
examples of the op's own input strategy, plus ``torch.library.opcheck``."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from graphcap.core.trees import tensor_leaves
from graphcap.opsdb import get_op
from graphcap.opsdb.spec import OpSpec

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def default_tolerance(dtype: torch.dtype) -> float:
    """atol = rtol for comparing a kernel with its float32-accumulating reference."""
    return _TOLERANCE.get(dtype, 0.0)


def _clone(args):
    return tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)


def _results(spec: OpSpec, fn, args):
    """What a call produces: its return value, plus every argument it may write."""
    args = _clone(args)
    out = fn(*args)
    written = [i for i, a in enumerate(spec.op.default._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    return tensor_leaves(out) + [args[i] for i in written]


def describe(args) -> str:
    """A short, readable account of an op's arguments (shapes, dtypes, host values)."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"Tensor({str(a.dtype).removeprefix('torch.')}, {tuple(a.shape)})")
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


def compare(spec: OpSpec, backend: str, args, atol: float, rtol: float) -> float:
    """Run ``backend`` and the reference on copies of ``args``; assert close; max error."""
    want = _results(spec, spec.reference, args)
    got = _results(spec, spec.kernels[backend].resolve(), args)
    assert len(got) == len(want), f"{spec.qualname}[{backend}]: {len(got)} results"
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{spec.qualname}[{backend}]: got {g.dtype}{tuple(g.shape)}, "
            f"want {w.dtype}{tuple(w.shape)}")
        err = (g.double() - w.double()).abs().max().item() if g.numel() else 0.0
        worst = max(worst, err)
        torch.testing.assert_close(
            g, w, atol=atol, rtol=rtol,
            msg=lambda m, e=err: f"{spec.qualname}[{backend}] on inputs {describe(args)}: "
                                 f"max error {e:.3g}. {m}")
    return worst


def check_op(op: str | OpSpec, backend: str | None = None, *, device="cpu",
             dtypes=(torch.float32, torch.float16, torch.bfloat16), examples: int = 20,
             atol: float | None = None, rtol: float | None = None,
             opcheck: bool = True) -> dict[str, float]:
    """Check ``backend`` (default: every backend available on ``device``) of ``op``
    against its reference over ``examples`` hypothesis examples per dtype. Returns the
    max error per backend; raises with hypothesis's shrunk failing input on a mismatch.
    ``opcheck=True`` also runs ``torch.library.opcheck`` on the first example."""
    spec = op if isinstance(op, OpSpec) else get_op(op)
    if spec.inputs is None:
        raise ValueError(f"{spec.qualname} has no input strategy: pass inputs= when "
                         "registering it")
    device = torch.device(device)
    worst: dict[str, float] = {}
    for dtype in dtypes:
        names = [backend] if backend else [
            b for b, why in spec.backends(device, dtype).items() if why is None and b != "torch"]
        tol_a = atol if atol is not None else default_tolerance(dtype)
        tol_r = rtol if rtol is not None else default_tolerance(dtype)
        _check_dtype(spec, names, device, dtype, examples, tol_a, tol_r, opcheck, worst)
    return worst


def _check_dtype(spec, names, device, dtype, examples, atol, rtol, opcheck, worst):
    from hypothesis import HealthCheck, given, settings

    checked = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(spec.inputs(device, dtype))
    def run(args):
        if opcheck and not checked:
            torch.library.opcheck(spec.op.default, _clone(args))
            checked.append(True)
        for name in names:
            if spec.kernels[name].declines(args):
                continue  # a shape this kernel has no variant for: dispatch passes it over
            err = compare(spec, name, args, atol, rtol)
            worst[name] = max(worst.get(name, 0.0), err)

    run()
