"""Decode attention over a paged K/V cache: one query token per row attends to the first
``seq_lens[b]`` tokens of its pages.

``q`` ``[B, Hq, D]``; one layer's ``k_cache``, ``v_cache`` ``[P, S, Hk, D]`` (pages of
``S`` slots, ``Hq % Hk == 0``); ``block_table`` ``[B, W]`` int32, row ``b``'s pages in
order (token ``t`` of the row lives in page ``block_table[b, t // S]``, slot
``t % S``); ``seq_lens`` ``[B]`` int32, the row's cached tokens, its own included (the
K/V write comes first). A row attends to tokens ``0 .. min(seq_lens[b], W * S) - 1``
(with a ``window``, only the last ``window`` of them: the read is bounded by the window,
not the context); a row with ``seq_lens[b] == 0`` (a padded row) comes out zero.
``window``, ``softcap`` and ``sinks``: :mod:`graphcap.opsdb.attention.variant`. What
the cache holds outside a row's tokens never reaches its output, NaN included.

A decode step may hand the op its rows' new keys and values, ``k`` and ``v`` ``[B, Hk,
D]``, with their places ``cache_loc`` ``[B]``: the op then writes them there first, as
``graphcap::kv_write`` does, and the Triton kernel does it in the same launch (each row's
own token read from ``k`` and ``v``, the slot written by one program). Only for rows of
distinct requests (a decode step): no row may read another row's new slot.

With ``positions`` ``[B]`` and the neox cos/sin cache ``cos_sin_cache`` as well, ``q`` and
``k`` are the projection's heads before ``graphcap::qkv_norm_rope``: the op RMS-normalises
them per head (``q_weight``, ``k_weight``, ``eps``; where given) and rotates them at
``positions`` first, as that op would, and the cache keeps the rotated ``k``; ``q``,
``k`` and ``v`` may be views of the projection's rows. The Triton kernel does it in the
same launch: a decode step's layer takes one kernel from the projection to attention's
output.

All metadata lives on the device: no host synchronisation, so the op captures, and
replays with new block tables and lengths of the same shapes.
"""

from __future__ import annotations

import torch

from graphcap.opsdb import checks
from graphcap.opsdb.attention.variant import check_variant
from graphcap.opsdb.kv import check_kv_write, kv_write_reference
from graphcap.opsdb.qkv import check_rope, norm_rope_reference
from graphcap.opsdb.spec import Kernel, register_op

OP = "decode_attention"


def decode_attention_reference(q, k_cache, v_cache, block_table, seq_lens, out,
                               scale: float, window: int = 0, softcap: float = 0.0,
                               sinks=None, k=None, v=None, cache_loc=None, positions=None,
                               q_weight=None, k_weight=None, cos_sin_cache=None,
                               eps: float = 1e-6) -> None:
    """Normalises and rotates ``q`` and ``k`` first, with ``positions`` (the reference of
    ``graphcap::qkv_norm_rope``); writes ``k`` and ``v`` at ``cache_loc``, where given
    (``graphcap::kv_write``); then gathers every row's pages, masks past its length (and
    before its window); float32 softmax, soft-capped scores and sink logits as
    :mod:`.attention.variant` says."""
    if positions is not None:
        q, k = norm_rope_reference(q, k, positions, q_weight, k_weight, cos_sin_cache, eps)
    if k is not None:
        kv_write_reference(k, v, k_cache, v_cache, cache_loc)
    B, Hq, D = q.shape
    _, S, Hk, _ = k_cache.shape
    L = block_table.shape[1] * S
    pages = block_table.long()
    keys = k_cache[pages].reshape(B, L, Hk, D)
    values = v_cache[pages].reshape(B, L, Hk, D)
    t = torch.arange(L, device=q.device)[None, :]
    lens = seq_lens.clamp(max=L)[:, None]  # a length past the table: its pages' tokens
    valid = t < lens  # [B, L]
    if window > 0:  # the row's token sits at lens - 1
        valid &= t > lens - 1 - window
    zero = torch.zeros((), dtype=keys.dtype, device=q.device)
    keys = torch.where(valid[:, :, None, None], keys, zero).float()  # 0 x NaN stays out
    values = torch.where(valid[:, :, None, None], values, zero).float()
    qf = q.float().view(B, Hk, Hq // Hk, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    live = valid.any(dim=1)[:, None, None, None]
    scores = torch.where(live, scores, 0.0)
    if sinks is not None:  # one more logit per query head, with no value
        sink = sinks.float().view(1, Hk, Hq // Hk, 1).expand(B, -1, -1, -1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :L]
    o = torch.einsum("bhgl,blhd->bhgd", probs, values) * live
    out.copy_(o.reshape(B, Hq, D).to(out.dtype))


def check_decode_attention(q, k_cache, v_cache, block_table, seq_lens, out, scale,
                           window=0, softcap=0.0, sinks=None, k=None, v=None,
                           cache_loc=None, positions=None, q_weight=None, k_weight=None,
                           cos_sin_cache=None, eps=1e-6) -> None:
    checks.tensor(OP, "q", q, ndim=3)
    given = [name for name, t in (("k", k), ("v", v), ("cache_loc", cache_loc))
             if t is not None]
    if given and len(given) < 3:
        raise checks.OpInputError(f"{OP}: {', '.join(given)} given without the rest: the "
                                  "K/V write takes k, v and cache_loc together")
    if given:
        check_kv_write(k, v, k_cache, v_cache, cache_loc)
        checks.same(OP, "the row count", k.shape[0], q.shape[0], "k", "q")
    if any(t is not None for t in (positions, cos_sin_cache, q_weight, k_weight)):
        if not given or positions is None or cos_sin_cache is None:
            raise checks.OpInputError(
                f"{OP}: the rotary takes positions and cos_sin_cache together, with a "
                "decode step's k, v and cache_loc (the rows' own tokens); give all five, or "
                "rotate q and k first (graphcap::qkv_norm_rope)")
        check_rope(OP, q, positions, q_weight, k_weight, cos_sin_cache, eps=eps)
    check_variant(OP, q, window, softcap, sinks)
    device = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        checks.tensor(OP, name, t, ndim=4 if name != "out" else 3, device=device)
        checks.same(OP, "the dtype", t.dtype, q.dtype, name, "q")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise checks.OpInputError(f"{OP}: {name} must be contiguous (a cache layer "
                                      "[pages, page_size, kv heads, head dim])")
    checks.tensor(OP, "block_table", block_table, ndim=2, dtypes=(torch.int32,),
                  device=device)
    checks.tensor(OP, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    checks.same(OP, "the shape", tuple(v_cache.shape), tuple(k_cache.shape), "v_cache",
                "k_cache")
    checks.same(OP, "the shape", tuple(out.shape), tuple(q.shape), "out", "q")
    checks.writable(OP, "out", out)
    checks.same(OP, "the head dim", k_cache.shape[3], q.shape[2], "k_cache", "q")
    checks.same(OP, "the row count", block_table.shape[0], q.shape[0], "block_table", "q")
    checks.same(OP, "the row count", seq_lens.shape[0], q.shape[0], "seq_lens", "q")
    for name, t in (("q", q), ("out", out), ("block_table", block_table),
                    ("seq_lens", seq_lens)):
        checks.last_dim_contiguous(OP, name, t)
    checks.rows_for(OP, k_cache, block_table, "k_cache has no pages for block_table's entries")
    hk = k_cache.shape[2]
    if hk == 0 or q.shape[1] == 0 or q.shape[1] % hk:
        raise checks.OpInputError(f"{OP}: {q.shape[1]} query heads are not a multiple of "
                                  f"{hk} key/value heads (GQA needs Hq % Hk == 0)")


def decode_attention_inputs(device, dtype, max_rows: int = 5):
    """Rows of random lengths over random pages (shared pages allowed where the op only
    reads the cache), every slot no row attends (past its length or before its window)
    filled with NaN; windows, soft-capping and sinks on or off; or a decode step that
    writes each row's own token first (rows on pages of their own, page 0 for pads, as
    the null page; the pads carry one K/V, as the null page's content is whichever pad's
    write lands last, in no fixed order on a GPU)."""
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import positions_and_rope_cache, tensors

    @st.composite
    def draw(d):
        b = d(st.integers(0, max_rows))
        page_size = d(st.sampled_from([1, 4, 16]))
        width = d(st.integers(1, 4))
        write = d(st.booleans())
        pages = b * width + d(st.integers(1, 3)) if write else d(st.integers(1, 8))
        hk, head = d(st.sampled_from([1, 2])), d(st.sampled_from([16, 64, 128]))
        hq = hk * d(st.sampled_from([1, 2, 4]))
        q, kc, vc = tensors(d, device, dtype, (b, hq, head), (pages, page_size, hk, head),
                            (pages, page_size, hk, head))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        if write:
            table = (torch.randperm(pages - 1, generator=gen)[:b * width] + 1).view(b, width)
            table = table.to(torch.int32)
        else:
            table = torch.randint(0, pages, (b, width), generator=gen, dtype=torch.int32)
        # Without a write, lengths past the table too (a row reads its pages' tokens).
        lens = torch.randint(0, width * page_size + (1 if write else 3), (b,), generator=gen,
                             dtype=torch.int32)
        window = d(st.sampled_from([0, 0, 1, 3, 8, 100]))
        attended = torch.zeros(pages * page_size, dtype=torch.bool)
        for row in range(b):
            n = min(int(lens[row]), width * page_size)
            for t in range(max(0, n - window) if window else 0, n):
                attended[int(table[row, t // page_size]) * page_size + t % page_size] = True
        unread = ~attended.view(pages, page_size).to(device)
        kc[unread], vc[unread] = float("nan"), float("nan")
        out = torch.empty_like(q)
        softcap = d(st.sampled_from([0.0, 0.0, 0.5, 30.0]))
        sinks = None if d(st.booleans()) else \
            (torch.randn(hq, generator=gen) * 3).to(device, torch.float32)
        own = ()
        if write:  # each row's last token: its K/V, and its place (pads: page 0)
            last = (lens.long() - 1).clamp(min=0)
            loc = table.long().gather(1, (last // page_size)[:, None])[:, 0] * page_size \
                + last % page_size
            loc = torch.where(lens > 0, loc, 0)
            k_new, v_new = tensors(d, device, dtype, (b, hk, head), (b, hk, head))
            pads = (lens == 0).to(device)
            if pads.any():  # which pad's write lands is unspecified: they write the same
                k_new[pads], v_new[pads] = k_new[pads][:1], v_new[pads][:1]
            own = (k_new, v_new, loc.to(device))
            if d(st.booleans()):  # the projection's rows, normalised and rotated here
                q, k_new, v_new = _rows_of(q, k_new, v_new, d(st.sampled_from([0, 8])))
                positions, cache = positions_and_rope_cache(
                    d, device, b, d(st.sampled_from([head, head // 2])))
                if pads.any():  # pads rotate alike too
                    positions[pads] = 0
                norms = tensors(d, device, dtype, (head,), (head,), scale=0.5) \
                    if d(st.booleans()) else (None, None)
                own = (k_new, v_new, loc.to(device), positions, *norms, cache, 1e-6)
        return (q, kc, vc, table.to(device), lens.to(device), out, head ** -0.5, window,
                softcap, sinks, *own)

    return draw()


def _rows_of(q, k, v, pad: int):
    """``q``, ``k`` and ``v`` copied into one projection's rows (``pad`` more columns
    wide), returned as views of them."""
    B, D = q.shape[0], q.shape[2]
    widths = [q.shape[1] * D, k.shape[1] * D, v.shape[1] * D]
    rows = q.new_zeros(B, sum(widths) + pad)
    views = rows[:, :sum(widths)].split(widths, dim=1)
    for t, view, n in zip((q, k, v), views, widths, strict=True):
        view.copy_(t.reshape(B, n))
    return tuple(view.view(B, n // D, D) for view, n in zip(views, widths, strict=True))


DECODE_ATTENTION = register_op(
    f"graphcap::{OP}",
    "(Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor block_table, "
    "Tensor seq_lens, Tensor(a!) out, float scale, int window=0, float softcap=0.0, "
    "Tensor? sinks=None, Tensor? k=None, Tensor? v=None, Tensor? cache_loc=None, "
    "Tensor? positions=None, Tensor? q_weight=None, Tensor? k_weight=None, "
    "Tensor? cos_sin_cache=None, float eps=1e-6) -> ()",
    reference=decode_attention_reference,
    kernels={"triton": Kernel("graphcap.opsdb.triton.decode:decode_attention",
                              requires=("triton",))},
    check=check_decode_attention, inputs=decode_attention_inputs,
    doc="one query token per row over its pages of a paged cache (split-KV), lengths and "
        "block table on the device",
)
