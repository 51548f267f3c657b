"""Triton MoE kernels (graphcap.opsdb.triton.moe) against the torch reference.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so the property tests keep shapes small; the ``gpu`` tests capture both launchers in a
CUDA graph and replay them with new routing, and run a model-sized shape.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.opsdb import reference
from graphcap.opsdb.triton import moe, moe_routing
from tests.conftest import requires_cuda

device = "cuda" if torch.cuda.is_available() else "cpu"
# On a CUDA machine every test here runs its kernels there, so the GPU suite runs them all.
pytestmark = [pytest.mark.gpu] if device == "cuda" else []

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
ROUTINGS = ["random", "one_expert", "two_experts", "all_same"]

SMALL = settings(max_examples=12, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _distinct_logits(num_tokens: int, num_experts: int, spacing: float, gen) -> torch.Tensor:
    """Router logits with no ties in any dtype: a permutation of a grid per token."""
    perms = torch.stack([torch.randperm(num_experts, generator=gen)
                         for _ in range(num_tokens)]) if num_tokens else \
        torch.empty((0, num_experts), dtype=torch.int64)
    return (perms.float() - num_experts / 2) * spacing


def _routing(kind: str, num_tokens: int, num_experts: int, top_k: int, gen):
    """(topk_weights float32, topk_ids int32) of a routing pattern, on ``device``."""
    if kind == "random":  # distinct experts per token, spread over all experts
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    elif kind == "one_expert":  # slot 0 of every token on one expert, the rest empty
        hot = int(torch.randint(num_experts, (1,), generator=gen))
        others = (hot + 1 + torch.randint(num_experts - 1, (num_tokens, top_k), generator=gen)
                  ) % num_experts
        ids = torch.cat([torch.full((num_tokens, 1), hot), others[:, 1:]], dim=1)
    elif kind == "two_experts":  # only experts 1 and 2 get tokens
        first = torch.randint(2, (num_tokens, 1), generator=gen) + 1
        ids = torch.cat([first, 3 - first], dim=1)[:, :top_k]
    elif kind == "all_same":  # every (token, slot) pair on one expert, duplicates too
        ids = torch.full((num_tokens, top_k), num_experts - 1)
    else:
        raise ValueError(kind)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.05
    return weights.to(device), ids.to(torch.int32).to(device)


def _problem(num_tokens, num_experts, hidden, inter, dtype, seed):
    gen = _gen(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return [t.to(dtype).to(device) for t in (x, w13, w2)]


def _assert_close_to_scale(actual, expected, tol):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel() == 0:
        return
    diff = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item() + 1e-6
    assert diff <= tol * scale, f"max abs diff {diff:.3g} > {tol} * scale {scale:.3g}"


# ------------------------------------------------------------------------- topk_softmax


@SMALL
@given(
    num_tokens=st.integers(0, 33),
    num_experts=st.sampled_from([4, 8]),
    top_k=st.sampled_from([1, 2]),
    renormalize=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    spacing=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_topk_softmax_matches_reference(num_tokens, num_experts, top_k, renormalize,
                                        dtype, spacing, seed):
    logits = _distinct_logits(num_tokens, num_experts, spacing, _gen(seed))
    logits = logits.to(dtype).to(device)
    weights, ids = moe.moe_topk_softmax(logits, top_k, renormalize)
    ref_w, ref_ids = reference.moe_topk_softmax(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_experts,top_k", [(256, 8), (60, 4), (3, 3)])
def test_topk_softmax_wide_and_odd_expert_counts(num_experts, top_k):
    gen = _gen(num_experts)
    logits = (torch.randn(7, num_experts, generator=gen) * 3).to(device)
    weights, ids = moe.moe_topk_softmax(logits, top_k, renormalize=True)
    ref_w, ref_ids = reference.moe_topk_softmax(logits, top_k, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(7, device=device))


@pytest.mark.parametrize("num_experts", [4, 6])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk_softmax_of_a_non_finite_logit_names_real_experts_for_that_token_alone(
        num_experts, bad):
    # torch.topk ranks NaN first, then +inf; a NaN or +inf logit makes its row's softmax
    # NaN.
    logits = torch.randn(3, num_experts, generator=_gen(5)).to(device)
    logits[1, 1] = bad
    weights, ids = moe.moe_topk_softmax(logits, 2, renormalize=True)
    ref_w, ref_ids = reference.moe_topk_softmax(logits, 2, renormalize=True)
    assert torch.equal(ids, ref_ids) and bool(((ids >= 0) & (ids < num_experts)).all())
    assert ids[1].tolist() == logits[1].topk(2).indices.tolist()
    assert ids[1, 0] == 1 and weights[1].isnan().all()
    torch.testing.assert_close(weights[::2], ref_w[::2], rtol=1e-5, atol=1e-6)


def test_topk_softmax_breaks_ties_by_the_lowest_expert_id_as_the_reference():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0], [0.5] * 5]).to(device)
    _, ids = moe.moe_topk_softmax(logits, 3, renormalize=False)
    _, ref_ids = reference.moe_topk_softmax(logits, 3, renormalize=False)
    assert ids.tolist() == ref_ids.tolist() == [[1, 2, 4], [0, 1, 2]]


def test_topk_softmax_reads_strided_logits():
    logits = torch.randn(9, 16, generator=_gen(3)).to(device)[:, ::2]
    weights, ids = moe.moe_topk_softmax(logits, 2, renormalize=False)
    ref_w, ref_ids = reference.moe_topk_softmax(logits, 2, renormalize=False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ experts


@SMALL
@given(
    num_tokens=st.integers(0, 33),
    num_experts=st.sampled_from([4, 8]),
    top_k=st.sampled_from([1, 2]),
    hidden=st.sampled_from([32, 64]),
    inter=st.sampled_from([32, 64]),
    dtype=st.sampled_from(DTYPES),
    routing=st.sampled_from(ROUTINGS),
    seed=st.integers(0, 2**16),
)
def test_experts_match_reference(num_tokens, num_experts, top_k, hidden, inter, dtype,
                                 routing, seed):
    x, w13, w2 = _problem(num_tokens, num_experts, hidden, inter, dtype, seed)
    weights, ids = _routing(routing, num_tokens, num_experts, top_k, _gen(seed + 1))
    out = moe.moe_experts(x, w13, w2, weights, ids)
    expected = reference.moe_experts(x, w13, w2, weights, ids)
    _assert_close_to_scale(out, expected, TOL[dtype])


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_experts_every_tile_size(monkeypatch, block_m, routing):
    """Each BLOCK_M the shape heuristic can pick, with odd H and I (masked edges)."""
    monkeypatch.setattr(moe_routing, "rows_per_tile", lambda n, e: block_m)
    x, w13, w2 = _problem(37, 8, 48, 80, torch.float32, seed=block_m)
    weights, ids = _routing(routing, 37, 8, 2, _gen(block_m))
    out = moe.moe_experts(x, w13, w2, weights, ids)
    _assert_close_to_scale(out, reference.moe_experts(x, w13, w2, weights, ids), 1e-4)


def test_experts_many_experts_mostly_empty():
    x, w13, w2 = _problem(20, 64, 32, 32, torch.bfloat16, seed=5)
    weights, ids = _routing("random", 20, 64, 2, _gen(6))
    out = moe.moe_experts(x, w13, w2, weights, ids)
    _assert_close_to_scale(out, reference.moe_experts(x, w13, w2, weights, ids), 3e-2)


def test_experts_write_into_out_and_accept_int64_ids():
    x, w13, w2 = _problem(11, 4, 32, 32, torch.float16, seed=9)
    weights, ids = _routing("random", 11, 4, 2, _gen(10))
    out = torch.full_like(x, float("nan"))
    got = moe.moe_experts(x, w13, w2, weights, ids.long(), out=out)
    assert got is out
    _assert_close_to_scale(out, reference.moe_experts(x, w13, w2, weights, ids), 2e-2)


def test_experts_zero_tokens():
    x, w13, w2 = _problem(0, 4, 32, 32, torch.float32, seed=0)
    weights, ids = _routing("random", 0, 4, 2, _gen(0))
    out = moe.moe_experts(x, w13, w2, weights, ids)
    assert out.shape == (0, 32) and out.dtype == torch.float32


@SMALL
@given(num_tokens=st.integers(0, 40), num_experts=st.sampled_from([1, 4, 8, 64]),
       top_k=st.sampled_from([1, 2, 4]), block_m=st.sampled_from([16, 32, 64]),
       seed=st.integers(0, 2**16))
def test_align_groups_every_pair_once_by_expert(num_tokens, num_experts, top_k, block_m,
                                                seed):
    gen = _gen(seed)
    # now and then an id of no expert (-1, E, far past E), in no group
    ids = torch.randint(-2, num_experts + 2, (num_tokens, top_k), generator=gen) \
        if seed % 2 else torch.randint(num_experts, (num_tokens, top_k), generator=gen)
    ids = torch.where(ids == num_experts + 1, 2**40, ids).to(
        torch.int64 if seed % 4 == 1 else torch.int32)
    sorted_pairs, cum_padded = moe_routing.align_pairs(ids.to(device), num_experts, block_m)
    sorted_pairs, cum_padded = sorted_pairs.cpu(), cum_padded.cpu().long()
    n = num_tokens * top_k
    assert sorted_pairs.shape == (n + num_experts * (block_m - 1),)
    flat = ids.flatten()
    routed = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
    counts = torch.bincount(flat[routed].long(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert torch.equal(cum_padded, padded.cumsum(0))
    total = int(cum_padded[-1])
    real = sorted_pairs[:total][sorted_pairs[:total] < n]
    assert torch.equal(real.sort().values, routed.to(torch.int32))
    assert (sorted_pairs <= n).all()
    if routed.numel() == n:  # every id an expert's: padding (n) past the rows in use
        assert (sorted_pairs[total:] == n).all()
    start = 0
    for e in range(num_experts):
        group = sorted_pairs[start:int(cum_padded[e])]
        members = group[group < n].long()
        assert (flat[members] == e).all()
        assert torch.equal(members, members.sort().values)  # stable: pair order kept
        start = int(cum_padded[e])


# ------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [96, 4100])  # T*k past 4096: torch.sort's radix path
def test_topk_and_experts_replay_in_a_cuda_graph_with_new_routing(num_tokens):
    from graphcap.core import new_pool

    num_experts, top_k, hidden, inter = 8, 2, 256, 128
    dtype = torch.bfloat16
    x, w13, w2 = _problem(num_tokens, num_experts, hidden, inter, dtype, seed=1)
    logits = torch.randn(num_tokens, num_experts, device="cuda")

    def fn():
        weights, ids = moe.moe_topk_softmax(logits, top_k, True)
        return moe.moe_experts(x, w13, w2, weights, ids), weights, ids

    pool = new_pool("cuda")
    graph = pool.graph()
    with pool.warmup():
        fn()
    out, weights, ids = graph.capture(fn)

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {
        "random": torch.randn(num_tokens, num_experts, device="cuda", generator=gen),
        "one_expert_gets_all": torch.randn(num_tokens, num_experts, device="cuda",
                                           generator=gen) + 30 * (torch.arange(
                                               num_experts, device="cuda") == 3),
        "two_experts_only": torch.randn(num_tokens, num_experts, device="cuda",
                                        generator=gen) + 30 * (torch.arange(
                                            num_experts, device="cuda") >= 6),
        "random_again": torch.randn(num_tokens, num_experts, device="cuda", generator=gen),
    }
    for name, new_logits in cases.items():
        logits.copy_(new_logits)
        x.copy_(torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref_w, ref_ids = reference.moe_topk_softmax(logits, top_k, True)
        assert torch.equal(ids, ref_ids), name
        torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
        expected = reference.moe_experts(x, w13, w2, ref_w, ref_ids)
        _assert_close_to_scale(out, expected, TOL[dtype])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_experts", [8, 64])
def test_experts_model_sized_bf16(num_experts):
    num_tokens, top_k, hidden, inter = 512, 2, 1024, 768
    x, w13, w2 = _problem(num_tokens, num_experts, hidden, inter, torch.bfloat16, seed=7)
    logits = torch.randn(num_tokens, num_experts, device="cuda")
    weights, ids = moe.moe_topk_softmax(logits, top_k, True)
    out = moe.moe_experts(x, w13, w2, weights, ids)
    expected = reference.moe_experts(x, w13, w2, weights, ids)
    _assert_close_to_scale(out, expected, TOL[torch.bfloat16])
    x32, w13_32, w2_32 = (t.float() for t in (x, w13, w2))
    out32 = moe.moe_experts(x32, w13_32, w2_32, weights, ids)
    _assert_close_to_scale(out32, reference.moe_experts(x32, w13_32, w2_32, weights, ids),
                           1e-4)


def test_experts_fake_has_the_layout_of_the_kernels_output_for_a_transposed_input():
    # The fake is what torch.compile plans with: the output's strides must be the
    # kernels' (contiguous), not the input's.
    tokens, hidden, inter, experts, k = 5, 32, 32, 4, 2
    x = torch.randn(hidden, tokens, generator=_gen(1)).to(device).t()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=_gen(2)) * 0.1).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=_gen(3)) * 0.1).to(device)
    ids = torch.randint(0, experts, (tokens, k), generator=_gen(4), dtype=torch.int32)
    weights = torch.rand(tokens, k, generator=_gen(5))
    torch.library.opcheck(torch.ops.graphcap.moe_experts.default,
                          (x, w13, w2, weights.to(device), ids.to(device)),
                          test_utils=("test_faketensor",))


def _experts_case(tokens=6, hidden=32, inter=32, experts=4, k=2):
    x = torch.randn(tokens, hidden, generator=_gen(11)).to(device)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=_gen(12)) * 0.1).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=_gen(13)) * 0.1).to(device)
    ids = torch.stack([torch.randperm(experts - 1, generator=_gen(14 + t))[:k]
                       for t in range(tokens)]).to(torch.int32).to(device)  # never the last
    weights = torch.rand(tokens, k, generator=_gen(15)).to(device)
    return x, w13, w2, weights, ids


def test_experts_take_a_broadcast_bias():
    x, w13, w2, weights, ids = _experts_case()
    b13 = torch.randn(w13.shape[1], generator=_gen(16)).to(device).expand(w13.shape[:2])
    b2 = torch.randn(w2.shape[1], generator=_gen(17)).to(device).expand(w2.shape[:2])
    got = moe.moe_experts(x, w13, w2, weights, ids, b13=b13, b2=b2)
    want = reference.moe_experts(x, w13, w2, weights, ids, b13=b13, b2=b2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_expert_no_token_is_routed_to_changes_nothing_even_if_its_weights_are_not_finite():
    x, w13, w2, weights, ids = _experts_case()
    want = reference.moe_experts(x, w13, w2, weights, ids)
    w13[-1], w2[-1] = float("inf"), float("nan")  # the expert no token is routed to
    torch.testing.assert_close(reference.moe_experts(x, w13, w2, weights, ids), want)
    torch.testing.assert_close(moe.moe_experts(x, w13, w2, weights, ids), want,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_a_slot_of_an_id_outside_the_experts_adds_nothing_as_in_the_reference(ids_dtype):
    """Expert parallelism's -1 (an expert held elsewhere), E, or far past it: the slot is
    routed to no expert, in the kernel as in the reference (no error: the ids are read on
    the device; before, a CUDA device-side assert, or an index error here)."""
    from graphcap.opsdb.moe import MOE_EXPERTS

    x, w13, w2, weights, ids = _experts_case()
    ids = ids.to(ids_dtype)
    strays = ids.clone()
    strays[0, 1], strays[2, 0], strays[3] = -1, 4, -7
    if ids_dtype == torch.int64:
        strays[5, 0] = 2**40
    kept = (strays >= 0) & (strays < 4)
    want = reference.moe_experts(x, w13, w2, weights * kept, ids)  # the slots dropped
    torch.testing.assert_close(reference.moe_experts(x, w13, w2, weights, strays), want)
    for kernel in ("triton", "torch"):
        got = MOE_EXPERTS(x, w13, w2, weights, strays, kernel=kernel)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got[3] == 0).all()


def test_experts_refuse_an_odd_gate_and_up_row_count():
    from graphcap.opsdb.checks import OpInputError
    from graphcap.opsdb.moe import MOE_EXPERTS

    x, w13, w2, weights, ids = _experts_case(inter=32)
    with pytest.raises(OpInputError, match="w13 has 65 rows an expert"):
        MOE_EXPERTS(x, torch.cat([w13, w13[:, :1]], dim=1), w2, weights, ids)
