"""No request's values reach another request's rows: a NaN or an infinity in one request of
a batch, under every attention backend (the torch ones included) and every strategy,
leaves its neighbours' results exactly what they are without it, and stays visible in
its own rows. (Padding rows holding NaN are tested in test_replay_equivalence.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from graphcap.core.context import forward_context
from graphcap.opsdb.attention import BACKENDS, get_backend
from graphcap.opsdb.attention.base import guard_kv_reference
from graphcap.opsdb.reference import attention_varlen
from graphcap.testing import default_tolerance
from tests.support.runner_helpers import DEVICE, batch, combos, model, runner, tolerance

# A first request that ends inside a key tile, so kernels that load whole tiles read the
# next request's first rows with its last ones; then the poisoned request, ending on a
# tile's edge, and a last one. The GPU's tiles are 128 rows; Triton's interpreter (the
# CPU) takes 32-row query tiles and 16-row key blocks: the first request still ends
# inside both, after whole ones, at a fraction of the interpreter's programs.
LENS = [200, 56, 20] if DEVICE == "cuda" else [40, 24, 20]
START, END = LENS[0], LENS[0] + LENS[1]  # the poisoned request's rows
POISONED = slice(START, START + 10)  # its first rows


def backends_here():
    marks = [pytest.mark.gpu] if DEVICE == "cuda" else []
    return [pytest.param(n, marks=marks) for n, cls in BACKENDS.items()
            if cls().unavailable(DEVICE) is None]


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", backends_here())
def test_a_non_finite_value_in_one_request_never_reaches_another(name, which, value):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    if dtype not in BACKENDS[name].dtypes:
        dtype = BACKENDS[name].dtypes[0]
    tokens, d = sum(LENS) + 4, 128  # four padding rows
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, d, generator=gen).to(DEVICE, dtype) for h in (4, 2, 2))
    meta = get_backend(name, DEVICE).metadata(tokens, 4, DEVICE).update(LENS)
    scale = 1 / math.sqrt(d)

    def attend(q, k, v):
        out = torch.full_like(q, float("nan"))
        with forward_context(attention=meta):
            torch.ops.graphcap.attention(q, k, v, out, scale)
        return out

    clean = attend(q, k, v)
    poisoned = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    poisoned[which][POISONED] = value
    out = attend(poisoned["q"], poisoned["k"], poisoned["v"])
    first, last = slice(0, START), slice(END, sum(LENS))
    for rows in (first, last):  # the neighbours: bit for bit what they were
        assert torch.equal(out[rows], clean[rows]), f"{name}: {which}={value} leaked"
    assert not out[sum(LENS):].any()  # padding rows: zero
    assert not torch.isfinite(out[START:END]).all()  # the poisoned request still shows it
    tol = 2 * default_tolerance(dtype)
    want = attention_varlen(q, k, v, meta.cu_seqlens_host, scale)
    torch.testing.assert_close(clean[:sum(LENS)], want[:sum(LENS)], atol=tol, rtol=tol)


def test_guarded_keys_and_values_zero_padding_and_move_a_bad_value_to_its_key():
    k, v = torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    v[1, 0, 2] = float("inf")
    v[5] = float("nan")  # a padding row
    valid = torch.tensor([True] * 4 + [False] * 2)
    gk, gv = guard_kv_reference(k, v, valid)
    assert torch.isnan(gk[1, 0]).all() and not gv[1, 0].any()
    assert torch.equal(gk[1, 1], k[1, 1]) and torch.equal(gv[1, 1], v[1, 1])
    assert not gk[4:].any() and not gv[4:].any()
    assert torch.equal(gk[[0, 2, 3]], k[[0, 2, 3]])


@pytest.mark.parametrize("d", [pytest.param(d, marks=[pytest.mark.gpu] if DEVICE == "cuda"
                                           else []) for d in (64, 80, 128)])
def test_the_guard_kernel_matches_its_reference(d):
    pytest.importorskip("triton")
    from graphcap.opsdb.triton.guard import guard_kv  # the interpreter on CPU

    gen = torch.Generator().manual_seed(d)
    k, v = (torch.randn(300, 4, d, generator=gen).to(DEVICE, torch.bfloat16) for _ in "kv")
    v[7, 1, 3], v[100, 2], k[9, 0, 1] = float("nan"), float("-inf"), float("nan")
    valid = torch.arange(300, device=DEVICE) < 290
    got, want = guard_kv(k, v, valid), guard_kv_reference(k, v, valid)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num())


@pytest.mark.parametrize("strategy, attention", combos())
def test_a_request_gone_non_finite_leaves_its_neighbours_untouched(strategy, attention):
    m, r = model(), runner(strategy, attention)
    lens = [9, 5, 7]
    ids, pos = batch(lens, seed=3)
    want = r(ids, pos, seq_lens=lens)
    poison = 0
    table = m.embed.weight
    saved = table[poison].clone()
    ids[9:14] = poison  # the second request's tokens only
    try:
        with torch.no_grad():
            table[poison] = float("nan")
        got = r(ids, pos, seq_lens=lens)
    finally:
        with torch.no_grad():
            table[poison] = saved
    atol, rtol = tolerance()
    for rows in (slice(0, 9), slice(14, 21)):
        torch.testing.assert_close(got[rows], want[rows], atol=atol, rtol=rtol)
    assert torch.isnan(got[9:14]).all()
