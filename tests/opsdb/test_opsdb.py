"""opsdb: registration, torch.library conformance, kernels against references, errors."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphcap.opsdb as opsdb
from graphcap.opsdb import OpInputError, get_op, register_op
from graphcap.testing import check_op

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Split ops (attention) read their metadata from the forward context: see
# tests/opsdb/test_attention_backends.py. Collectives need a TP group of several processes:
# tests/tp/test_tp.py runs opcheck on them there.
COLLECTIVES = ("graphcap::all_reduce", "graphcap::all_gather")
# graphcap's own ops: not those other test modules collected first registered.
BUILTIN = sorted(name for name, spec in opsdb.REGISTRY.items()
                 if name.startswith("graphcap::") and not spec.split
                 and name not in COLLECTIVES)


@pytest.mark.parametrize("name", BUILTIN)
def test_every_builtin_op_passes_opcheck_and_its_reference_matches_itself(name):
    # opcheck: schema (declared mutations), fake tensors, autograd registration, and
    # aot_dispatch with dynamic shapes, on generated float32 inputs.
    errors = check_op(name, kernel="torch", device="cpu", dtypes=(torch.float32,),
                      examples=4)
    assert errors == {"torch": 0.0}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.gpu] if DEVICE == "cuda" else []) for n in BUILTIN])
def test_every_available_kernel_matches_the_reference(name):
    spec = get_op(name)
    available = [b for b, why in spec.available(DEVICE).items() if why is None and b != "torch"]
    if not available:
        pytest.skip(f"no kernel besides the reference runs on {DEVICE}: "
                    f"{spec.available(DEVICE)}")
    # Without a GPU the kernels run in Triton's interpreter: fewer examples there, six on
    # the GPU.
    check_op(name, device=DEVICE, examples=6 if DEVICE == "cuda" else 3, opcheck=False)


def test_kernel_choice_is_explicit_then_environment_then_best(environ):
    spec = get_op("rms_norm")
    environ.unset("GRAPHCAP_RMS_NORM_KERNEL")
    assert spec.select("cpu") == "torch"  # never the Triton interpreter unless asked
    if spec.available("cpu")["triton"] is None:  # TRITON_INTERPRET=1: on explicit request
        assert spec.select("cpu", kernel="triton") == "triton"
    environ.set("GRAPHCAP_RMS_NORM_KERNEL", "torch")
    assert spec.select("cpu") == "torch"
    environ.set("GRAPHCAP_RMS_NORM_KERNEL", "cublas")
    with pytest.raises(opsdb.KernelUnavailable, match="GRAPHCAP_RMS_NORM_KERNEL"):
        spec.select("cpu")
    assert spec.select("cpu", kernel="torch") == "torch"


def test_a_kernel_variable_picks_graphcaps_op_only_and_a_misspelt_one_is_told(environ):
    # myproj::rms_norm is not picked by GRAPHCAP_RMS_NORM_KERNEL; GRAPHCAP_RMSNORM_KERNEL
    # names no op of graphcap's: a warning, once.
    from graphcap.opsdb import spec as spec_module

    mine = register_op("graphcap_envtest::rms_norm", "(Tensor x) -> Tensor",
                       reference=lambda x: x * 2, kernels={"other": lambda x: x * 2})
    try:
        environ.set("GRAPHCAP_RMS_NORM_KERNEL", "other")
        assert mine.select("cpu") == "torch"
    finally:  # out of the registry the listings read
        opsdb.REGISTRY.pop("graphcap_envtest::rms_norm")
    environ.unset("GRAPHCAP_RMS_NORM_KERNEL")
    environ.set("GRAPHCAP_RMSNORM_KERNEL", "torch")
    spec_module._SEEN.discard("rmsnorm")
    with pytest.warns(UserWarning, match="GRAPHCAP_RMSNORM_KERNEL: graphcap has no op "
                                         "'rmsnorm'; the variable is ignored"):
        get_op("rms_norm").select("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_op("rms_norm").select("cpu")  # once


def test_an_unavailable_kernel_says_why():
    spec = get_op("rms_norm")
    why = spec.available("cpu")["flashinfer"]
    assert why and ("cuda" in why or "flashinfer" in why)
    with pytest.raises(opsdb.KernelUnavailable, match="flashinfer"):
        spec.select("cpu", kernel="flashinfer")


BAD_CALLS = {
    "wrong dtype": (lambda: torch.ops.graphcap.rms_norm(
        torch.ones(2, 8, dtype=torch.int32), torch.ones(8), 1e-6), "dtype"),
    "wrong rank": (lambda: torch.ops.graphcap.silu_and_mul(torch.ones(8)), "2 dims"),
    "hidden size mismatch": (lambda: torch.ops.graphcap.rms_norm(
        torch.ones(2, 8), torch.ones(4), 1e-6), "hidden size"),
    "odd gate width": (lambda: torch.ops.graphcap.silu_and_mul(torch.ones(2, 7)), "even"),
    "heads do not divide": (lambda: torch.ops.graphcap.rotary_embedding(
        torch.zeros(2, dtype=torch.long), torch.ones(2, 60), torch.ones(2, 64),
        torch.ones(16, 32), 64), "not a multiple of head_size"),
    "token counts differ": (lambda: torch.ops.graphcap.fused_add_rms_norm(
        torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-6), "shape"),
    "top_k above experts": (lambda: torch.ops.graphcap.moe_topk_softmax(
        torch.ones(2, 4), 5, True), "top_k=5"),
    "qkv width not (H + 2 Hk) * D": (lambda: torch.ops.graphcap.qkv_norm_rope(
        torch.ones(2, 60), torch.zeros(2, dtype=torch.long), None, None, torch.ones(8, 16),
        2, 1, 16, 1e-6), r"\(heads \+ 2 kv heads\) \* head_size = 64"),
    "strided norm weight": (lambda: torch.ops.graphcap.rms_norm_linear(
        torch.ones(2, 8), torch.ones(16)[::2], 1e-6, torch.ones(4, 8), None),
        "norm_weight must be contiguous"),
    "swiglu weight with odd rows": (lambda: torch.ops.graphcap.rms_norm_swiglu(
        torch.ones(2, 8), torch.ones(8), 1e-6, torch.ones(5, 8)), "even count"),
    "residual of another shape": (lambda: torch.ops.graphcap.linear_residual(
        torch.ones(2, 8), torch.ones(4, 8), torch.ones(3, 4)), "shape of residual"),
    "only one qk-norm weight": (lambda: torch.ops.graphcap.qkv_norm_rope(
        torch.ones(2, 64), torch.zeros(2, dtype=torch.long), torch.ones(16), None,
        torch.ones(8, 16), 2, 1, 16, 1e-6), "both q_weight and k_weight"),
    # rms_norm refused eps 0; its per-head form normalised a head of zeros to NaN.
    "qk-norm of eps 0": (lambda: torch.ops.graphcap.qkv_norm_rope(
        torch.zeros(2, 64), torch.zeros(2, dtype=torch.long), torch.ones(16), torch.ones(16),
        torch.ones(8, 16), 2, 1, 16, 0.0), "eps must be > 0"),
    "decode attention's qk-norm of a negative eps": (
        lambda: torch.ops.graphcap.decode_attention(
            torch.ones(1, 2, 16), torch.ones(2, 4, 1, 16), torch.ones(2, 4, 1, 16),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.empty(1, 2, 16), 0.25, 0, 0.0, None, torch.ones(1, 1, 16),
            torch.ones(1, 1, 16), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long), torch.ones(16), torch.ones(16),
            torch.ones(8, 16), -1.0), "eps must be > 0"),
    "decode attention's K/V write without its places": (
        lambda: torch.ops.graphcap.decode_attention(
            torch.ones(1, 2, 16), torch.ones(2, 4, 1, 16), torch.ones(2, 4, 1, 16),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.empty(1, 2, 16), 0.25, 0, 0.0, None, torch.ones(1, 1, 16),
            torch.ones(1, 1, 16), None), "k, v given without the rest"),
    "cache places' rows without their lengths": (lambda: torch.ops.graphcap.cache_places(
        torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.long),
        torch.zeros(1, 3, dtype=torch.int32), 4, torch.empty(2, dtype=torch.long),
        torch.empty(2, 3, dtype=torch.int32), None), "table and seq_lens go together"),
    # The reference indexed row -1 of no rows (IndexError); the Triton kernel read
    # before the table.
    "cache places of a block table of no rows": (lambda: torch.ops.graphcap.cache_places(
        torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.long),
        torch.zeros(0, 3, dtype=torch.int32), 4, torch.empty(2, dtype=torch.long)),
        r"block_table \(0, 3\) has no rows or no pages"),
    "cache places of a block table of no pages": (lambda: torch.ops.graphcap.cache_places(
        torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.long),
        torch.zeros(2, 0, dtype=torch.int32), 4, torch.empty(2, dtype=torch.long)),
        r"block_table \(2, 0\) has no rows or no pages"),
    "moe experts clamping SwiGLU": (lambda: torch.ops.graphcap.moe_experts(
        torch.ones(2, 8), torch.ones(4, 8, 8), torch.ones(4, 8, 4), torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.int32), None, None, 0.0, 7.0, False),
        "limit=7.0 clamps gpt-oss's GLU"),
    "moe experts of no intermediate rows": (lambda: torch.ops.graphcap.moe_experts(
        torch.ones(2, 8), torch.ones(4, 0, 8), torch.ones(4, 8, 0), torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.int32), None, torch.ones(4, 8), 0.0, 0.0, False),
        "no intermediate rows"),
    # The reference summed nothing; the Triton kernel raised ZeroDivisionError.
    "moe experts of no expert": (lambda: torch.ops.graphcap.moe_experts(
        torch.ones(2, 8), torch.ones(0, 8, 8), torch.ones(0, 8, 4), torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.int32), None, None, 0.0, 0.0, False),
        r"w13 \(0, 8, 8\) holds no expert"),
    "moe experts with gate/up rows of another count": (lambda: torch.ops.graphcap.moe_experts(
        torch.ones(2, 8), torch.ones(4, 6, 8), torch.ones(4, 8, 4), torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.int32), None, None, 0.0, 0.0, True), "expert shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_is_rejected_with_a_clear_error_before_any_launch(case):
    call, needle = BAD_CALLS[case]
    with pytest.raises(OpInputError, match=needle):
        call()


def test_an_op_registered_without_a_fake_works_under_fullgraph_compile():
    def reference(x: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * alpha

    spec = opsdb.register_op("graphcap_test::gelu_scale",
                             "(Tensor x, float alpha) -> Tensor", reference=reference)
    assert spec.fake_derived

    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=True)
    def f(x):
        return torch.ops.graphcap_test.gelu_scale(x + 1, 2.0) * 3

    for n in (3, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(f(x), reference(x + 1, 2.0) * 3)


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(opsdb.spec.GraphcapError, match="registered already"):
        opsdb.register_op("graphcap::rms_norm", "(Tensor x) -> Tensor",
                          reference=lambda x: x)


def test_a_kernel_named_torch_is_refused_not_replaced_by_the_reference():
    # It was replaced silently, and the reference took its place first in the preference
    # order, ahead of every other kernel.
    fast = opsdb.Kernel(lambda x: x * 2, devices=("cpu",))
    with pytest.raises(opsdb.spec.GraphcapError, match="kernel 'torch'"):
        opsdb.register_op("graphcap_test::named_torch", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2,
                          kernels={"torch": opsdb.Kernel(lambda x: x * 2, devices=("cpu",)),
                                   "fast": fast})
    assert "graphcap_test::named_torch" not in opsdb.spec.REGISTRY


def test_op_names_must_be_qualified():
    with pytest.raises(ValueError, match="namespace::op_name"):
        opsdb.register_op("no_namespace", "(Tensor x) -> Tensor", reference=lambda x: x)


def test_a_kernel_that_declares_dtypes_is_skipped_for_others():
    spec = get_op("silu_and_mul")
    kernel = spec.kernels["flashinfer"]
    assert "takes float16, bfloat16, not float32" in kernel.unavailable(
        torch.device("cuda"), torch.float32)


def test_a_kernel_that_declines_a_shape_is_passed_over_and_never_called_with_it():
    calls = []

    def wide_only(x):  # a stand-in for a vendor kernel with variants for wide rows only
        calls.append(x.shape[1])
        return x * 2

    spec = opsdb.register_op(
        "graphcap_test::double_wide", "(Tensor x) -> Tensor", reference=lambda x: x * 2,
        kernels={"wide": opsdb.Kernel(wide_only, devices=("cpu", "cuda"), accepts=lambda x: (
            None if x.shape[1] % 64 == 0 else f"rows of {x.shape[1]}, not a multiple of 64"))})
    narrow, wide = torch.ones(3, 8, device=DEVICE), torch.ones(3, 64, device=DEVICE)
    assert spec.select(DEVICE, args=(narrow,)) == "torch"
    assert spec.select(DEVICE, args=(wide,)) == "wide"
    torch.testing.assert_close(spec(narrow), narrow * 2)
    torch.testing.assert_close(spec(wide), wide * 2)
    assert calls == [64]
    with pytest.raises(OpInputError, match="kernel 'wide' cannot take these inputs: rows "
                                           "of 8, not a multiple of 64"):
        spec(narrow, kernel="wide")
    assert calls == [64]


def test_flashinfer_rope_is_never_given_a_shape_it_would_misread():
    spec = get_op("rotary_embedding")
    pos = torch.zeros(4, dtype=torch.long)

    def args(head, rot):
        return pos, torch.zeros(4, head), torch.zeros(4, head), torch.zeros(8, rot), head

    declines = spec.kernels["flashinfer"].declines
    assert "not head size 16 with 8 rotary dims" in declines(args(16, 8))
    assert declines(args(64, 32)) is None and declines(args(128, 128)) is None


def _ref_short(x):
    return x


def _ref_long(x, alpha, beta):
    return x * alpha * beta


def _ref_keyword_only(x, *, alpha):
    return x * alpha


@pytest.mark.parametrize(("name", "fn", "params"), [
    ("short", _ref_short, "(x)"), ("long", _ref_long, "(x, alpha, beta)"),
    ("keyword_only", _ref_keyword_only, "(x, *, alpha)")])
def test_a_reference_that_cannot_take_the_schemas_arguments_is_refused_at_registration(
        name, fn, params):
    qualname = f"graphcap_test::arity_{name}"
    with pytest.raises(opsdb.spec.GraphcapError) as info:
        opsdb.register_op(qualname, "(Tensor x, float alpha) -> Tensor", reference=fn)
    text = str(info.value)
    assert "(Tensor x, float alpha)" in text and f"{fn.__name__}{params}" in text, text
    assert "reference" in text and qualname not in opsdb.REGISTRY
    assert not hasattr(torch.ops.graphcap_test, f"arity_{name}")  # nothing half defined


@pytest.mark.parametrize("role", ["fake", "check", "kernels", "dispatch"])
def test_a_fake_check_kernel_or_dispatch_of_the_wrong_arity_is_refused_too(role):
    given = {"kernels": {"short": _ref_short}}.get(role, _ref_short)
    with pytest.raises(opsdb.spec.GraphcapError, match=rf"{role}.*_ref_short\(x\)"):
        opsdb.register_op(f"graphcap_test::arity_{role}", "(Tensor x, float alpha) -> Tensor",
                          reference=lambda x, alpha: x * alpha, **{role: given})


def test_functions_with_defaults_or_star_args_that_take_the_arguments_are_accepted():
    spec = opsdb.register_op(
        "graphcap_test::arity_flexible", "(Tensor x, float alpha) -> Tensor",
        reference=lambda x, alpha, beta=1.0: x * alpha * beta,
        kernels={"star": opsdb.Kernel(lambda *args: args[0] * args[1], devices=("cpu",))})
    x = torch.ones(3)
    torch.testing.assert_close(spec(x, 2.0, kernel="star"), spec(x, 2.0, kernel="torch"))


def test_defaults_and_keyword_only_arguments_reach_the_kernels_in_schema_order():
    seen = []

    def reference(x, alpha, beta):
        seen.append((alpha, beta))
        return x * alpha + beta

    spec = opsdb.register_op(
        "graphcap_test::keywords", "(Tensor x, float alpha=2.0, *, float beta=1.0) -> Tensor",
        reference=reference)
    op, x = torch.ops.graphcap_test.keywords, torch.ones(2)
    torch.testing.assert_close(op(x), x * 2 + 1)
    torch.testing.assert_close(op(x, 3.0, beta=5.0), x * 3 + 5)
    torch.testing.assert_close(op(x, beta=5.0), x * 2 + 5)
    torch.testing.assert_close(spec(x, kernel="torch"), x * 2 + 1)
    assert seen == [(2.0, 1.0), (3.0, 5.0), (2.0, 5.0), (2.0, 1.0)]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return op(x, beta=4.0) * 3  # the derived fake: the reference on fake tensors

    torch.testing.assert_close(f(x), (x * 2 + 4) * 3)


def test_a_split_ops_static_state_was_once_named_graphable_which_still_works_with_a_warning():
    def state():
        return None

    def ident(x, out):
        out.copy_(x)

    with pytest.warns(DeprecationWarning, match="pass static_state="):
        spec = opsdb.register_op("graphcap_test::old_graphable", "(Tensor x, Tensor(a!) out) -> ()",
                                 reference=ident, split=True, graphable=state)
    assert spec.static_state is state
    with pytest.raises(TypeError, match="give static_state= only"):
        opsdb.register_op("graphcap_test::both_names", "(Tensor x, Tensor(a!) out) -> ()",
                          reference=ident, split=True, graphable=state, static_state=state)
    assert "graphcap_test::both_names" not in opsdb.REGISTRY


def _arguments(name: str) -> list[str]:
    namespace, op = name.split("::")
    return [a.name for a in getattr(getattr(torch.ops, namespace), op).default._schema.arguments]


# The ops that write keys and values into a cache at cache_loc.
WRITERS = sorted(n for n in BUILTIN if {"k", "v", "cache_loc"} <= set(_arguments(n)))


@pytest.mark.parametrize("name", WRITERS)
def test_rows_an_example_writes_to_one_slot_carry_one_key_and_value(name):
    # Which of two writes to one slot lands is unspecified (on a GPU, in no fixed order):
    # an example that wrote different K/V there would make the kernel-vs-reference check
    # a coin toss.
    from hypothesis import given

    names = _arguments(name)

    @given(get_op(name).inputs("cpu", torch.float32))
    def check(args):
        bound = dict(zip(names, args, strict=False))
        loc = bound.get("cache_loc")
        if loc is None:
            return
        for slot in loc.unique():
            rows = (loc == slot).nonzero()[:, 0]
            for key in ("k", "v"):
                same = bound[key][rows]
                assert torch.equal(same, same[:1].expand_as(same)), (
                    f"{name}: rows {rows.tolist()} write slot {int(slot)} with different "
                    f"{key}")

    check()


def test_a_kernel_launching_compiled_cuda_code_is_not_offered_on_cpu_tensors(monkeypatch):
    # Even with its packages installed and Triton's interpreter on: the interpreter runs
    # Triton code, not the CUDA extension beside it.
    from graphcap.opsdb import REGISTRY, spec

    monkeypatch.setattr(spec, "_importable", lambda module: True)
    kernels = REGISTRY["graphcap::moe_experts"].kernels
    assert "runs on cuda tensors, not cpu" in kernels["cuda"].unavailable(torch.device("cpu"))
    if spec.env.settings().triton_interpret:
        assert kernels["triton"].unavailable(torch.device("cpu")) is None


def test_the_interpreters_bfloat16_rounding_keeps_every_nan_a_nan():
    # NaN payloads the rounding's carry would turn into inf or -0 (the GPU's cast keeps
    # them NaN): a property test poisoning memory with NaN must see NaN.
    import graphcap.env
    from graphcap.opsdb.triton.kv import kv_write

    if not graphcap.env.settings().triton_interpret:
        pytest.skip("Triton's interpreter only (TRITON_INTERPRET=1)")
    bits = torch.tensor([0x7F800001, 0x7FFFFFFF, -8388607], dtype=torch.int32)
    k = bits.view(torch.float32).view(3, 1, 1).expand(3, 1, 2).contiguous()
    caches = [torch.zeros(3, 1, 1, 2, dtype=torch.bfloat16) for _ in range(2)]
    kv_write(k, k, *caches, torch.arange(3))
    assert caches[0].isnan().all() and caches[1].isnan().all()


def test_op_checks_refuse_what_the_kernels_cannot_read_by_name():
    # Strided weights the kernels would read as contiguous, a transposed rotary table,
    # and in-place outputs repeating their memory: OpInputError, naming the argument.
    from graphcap.errors import OpInputError
    from graphcap.opsdb import reference as ref
    from graphcap.opsdb.decode import DECODE_ATTENTION
    from graphcap.opsdb.norm import FUSED_ADD_RMS_NORM, RMS_NORM
    from graphcap.opsdb.qkv import QKV_NORM_ROPE
    from graphcap.opsdb.rotary import ROTARY_EMBEDDING

    cache = ref.rope_cache(16, 8, 1e4)
    qkv, pos = torch.randn(2, 64), torch.tensor([0, 3])
    q, k_cache = torch.randn(3, 2, 8), torch.randn(4, 2, 1, 8)
    table, lens = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    cases = [
        ("q_weight must be contiguous", lambda: QKV_NORM_ROPE(
            qkv, pos, torch.randn(32)[::2], torch.randn(32)[::2], cache, 2, 1, 16, 1e-6)),
        ("weight must be contiguous", lambda: RMS_NORM(torch.randn(2, 8),
                                                       torch.randn(16)[::2], 1e-6)),
        ("cos_sin_cache must be contiguous", lambda: ROTARY_EMBEDDING(
            pos, torch.randn(2, 16), torch.randn(2, 16), cache.t().contiguous().t(), 16)),
        ("x is written in place but repeats its memory", lambda: FUSED_ADD_RMS_NORM(
            torch.randn(1, 8).expand(3, 8), torch.randn(3, 8), torch.ones(8), 1e-6)),
        ("query is written in place but repeats its memory", lambda: ROTARY_EMBEDDING(
            pos, torch.randn(1, 16).expand(2, 16), torch.randn(2, 16), cache, 16)),
        ("x is written in place but repeats its memory", lambda: FUSED_ADD_RMS_NORM(
            torch.randn(10).unfold(0, 8, 1), torch.randn(3, 8), torch.ones(8), 1e-6)),
        ("out is written in place but repeats its memory", lambda: DECODE_ATTENTION(
            q, k_cache, k_cache, table, lens, torch.zeros(1, 2, 8).expand(3, 2, 8), 1.0)),
        ("0 query heads are not a multiple", lambda: DECODE_ATTENTION(
            q[:, :0], k_cache, k_cache, table, lens, torch.zeros(3, 0, 8), 1.0)),
    ]
    for needle, call in cases:
        with pytest.raises(OpInputError, match=needle):
            call()


def test_the_few_row_linear_takes_an_empty_input_of_any_strides():
    import graphcap.env
    from graphcap.opsdb.linear import RMS_NORM_SWIGLU

    if not graphcap.env.settings().triton_interpret:
        pytest.skip("the Triton kernel on CPU tensors: Triton's interpreter only")
    x = torch.randn(0, 1) * 1.0  # strides (1, 0): torch's own, for no rows
    out = RMS_NORM_SWIGLU(x, torch.ones(1), 1e-6, torch.randn(4, 1), kernel="triton")
    assert out.shape == (0, 2)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_routing_passes_opcheck_with_and_without_renormalizing(renormalize, environ):
    # Without it the top-k weights are a slice of the sorted [T, E]: the fake must give
    # the Triton kernel's contiguous [T, k] (Inductor checks the strides it was told).
    if get_op("moe_topk_softmax").available(DEVICE)["triton"] is not None:
        pytest.skip("the Triton kernel: on a GPU or under Triton's interpreter")
    environ.set("GRAPHCAP_MOE_TOPK_SOFTMAX_KERNEL", "triton")
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.library.opcheck(torch.ops.graphcap.moe_topk_softmax.default,
                          (logits, 2, renormalize))


@pytest.mark.parametrize("top_k", [2, 8])
def test_moe_routing_of_column_major_logits_gives_contiguous_ids(top_k, environ):
    # Router logits laid out [E, T] and transposed: the reference's ids (its fake) came
    # out column-major, the sort's layout, where every kernel gives [T, k] contiguous;
    # Inductor asserts the fake's strides on the kernel's output.
    logits = torch.randn(8, 5, generator=torch.Generator().manual_seed(0)).t()
    for renormalize in (True, False):
        weights, ids = get_op("moe_topk_softmax").reference(logits, top_k, renormalize)
        assert weights.is_contiguous() and ids.is_contiguous()
    if get_op("moe_topk_softmax").available(DEVICE)["triton"] is not None:
        return  # the Triton kernel: on a GPU or under Triton's interpreter
    environ.set("GRAPHCAP_MOE_TOPK_SOFTMAX_KERNEL", "triton")
    torch.library.opcheck(torch.ops.graphcap.moe_topk_softmax.default,
                          (logits.to(DEVICE), top_k, True))
