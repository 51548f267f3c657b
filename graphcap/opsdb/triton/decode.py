"""Split-KV decode attention over a paged cache (contract: :mod:`graphcap.opsdb.decode`).

One kernel, grid ``(rows, key/value heads x head blocks, splits)``. A program takes the
query heads that share one key/value head (up to ``BLOCK_H`` of them: a GQA group), so
each K/V token is read from memory once for the whole group, and scores and the weighted
values are tensor-core products (``BLOCK_H`` rows, at least 16; the rows past the group
are masked), or with ``CUDA_CORES`` products in registers of the group's heads. It
walks its split of the row's tokens in blocks of ``BLOCK_N`` (each token's page from the
block table) with an online softmax in float32; the probabilities are rounded to the
cache's dtype for the tensor-core product with the values, as FlashAttention does.
With one split the program writes the output; with several, each stores its partial
output and log-sum-exp, and the last program of a (row, head block) to arrive (an atomic
count, as the split linear's: :mod:`graphcap.opsdb.triton.counters`) merges them by
their LSEs with the head's sink logit, which joins the softmax with no value, and
writes the output. A row with no token comes out zero, not 0/0; NaN in a row's own
tokens stays NaN. With a window the splits cover only the row's last ``window`` tokens:
the K/V read is bounded by the window, not the context; soft-capping applies to each
score before the online softmax. Handed the q/k/v projection's rows with their positions
(``ROPE``), each program normalises and rotates its heads of q and the row's own key as
:mod:`graphcap.opsdb.triton.qkv`'s kernel would (its ``norm_rope``), so a decode step's
layer needs no kernel between the projection and this one. The split count follows from
host shapes only (rows, heads, the block table's width, the SMs), so the grid is fixed at
capture and a replay's lengths change only the work inside it (the tiles follow the
device's shared memory too: :func:`tiles_for`). No host synchronisation, so no index is
checked on the host: a block table's page reads as the reference's ``k_cache[pages]``
does (a negative one from the end; one past the cache, the nearest page), a rotary
position likewise, and a row's own slot outside the cache is not written (the reference
refuses both); nothing outside the cache or the table is read or written.

Under programmatic dependent launch (:mod:`graphcap.opsdb.triton.common`) the kernel
lets the next one start at once (the output projection, which asks L2 for its weight
meanwhile) and waits for the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from graphcap.errors import KernelUnavailable
from graphcap.opsdb.triton import counters
from graphcap.opsdb.triton.common import (
    cast,
    in_table,
    interpreting,
    num_sms,
    pdl_args,
    pdl_start,
    shared_memory,
    table_row,
)
from graphcap.opsdb.triton.decode_grid import head_block, programs_of, splits_of_tiles, tiles_for
from graphcap.opsdb.triton.decode_math import (
    add_weighted,
    attend_in_lanes,
    kv_block,
    scores_of,
    soft_cap,
)
from graphcap.opsdb.triton.qkv import norm_rope, rope_at


@triton.jit
def _write_out(o, lse, has, sink, out_ptr, rows_off, d, h_ok, d_mask, SINKS: tl.constexpr,
               INTERPRET: tl.constexpr):
    """``out`` of heads ``rows_off``: ``o`` [BLOCK_H, BLOCK_D] (normalised over the
    tokens) weighed against the sink logit; zero where no token was read (``has``)."""
    top = tl.where(has, lse, float("-inf"))
    if SINKS:
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(has, tl.exp(lse - top), 0.0)
    total = weight
    if SINKS:
        total += tl.exp(sink - top)
    o = o * tl.where(total == 0, 0.0, weight / tl.where(total == 0, 1.0, total))[:, None]
    tl.store(out_ptr + rows_off[:, None] + d[None, :],
             cast(o, out_ptr.dtype.element_ty, INTERPRET),
             mask=h_ok[:, None] & d_mask[None, :])


@triton.jit
def _norm_rotated(x, rows, ok, d, d_mask, pos, cs_ptr, cs_stride, w_ptr, half, head_dim,
                  eps, HAS_NORM: tl.constexpr):
    """Heads ``x`` [R, BLOCK_D], read from ``rows`` (``ok``: where they may be read), as
    ``graphcap::qkv_norm_rope`` leaves them: per-head RMSNorm by ``w_ptr``
    (``HAS_NORM``), then neox rotary at ``pos``."""
    cos, sin, first, rotated, partner = rope_at(cs_ptr + pos * cs_stride, d[None, :], half)
    x_p = tl.load(rows + partner, mask=ok & rotated, other=0.0)
    w = x
    w_p = x_p
    if HAS_NORM:
        w = tl.load(w_ptr + d[None, :], mask=d_mask[None, :], other=0.0)
        w_p = tl.load(w_ptr + partner, mask=rotated, other=0.0)
    return norm_rope(x, x_p, w, w_p, cos, sin, first, rotated, head_dim, eps, HAS_NORM)


@triton.jit
def _own_key(k_row, d, d_mask, pos, cs_ptr, cs_stride, kw_ptr, half, head_dim, eps,
             ROPE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The row's own key [BLOCK_D] at ``k_row``, normalised and rotated as
    ``graphcap::qkv_norm_rope`` leaves it where ``ROPE``."""
    if ROPE:
        k = tl.load(k_row + d[None, :], mask=d_mask[None, :], other=0.0)
        k = _norm_rotated(k, k_row, d_mask[None, :], d, d_mask, pos, cs_ptr, cs_stride,
                          kw_ptr, half, head_dim, eps, HAS_NORM)
        return tl.reshape(k, [BLOCK_D])
    else:
        return tl.load(k_row + d, mask=d_mask, other=0.0)


@triton.jit
def _write_own(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, b, kvh, s, g, hb, d, d_mask, pos,
               cs_ptr, cs_stride, kw_ptr, half, head_dim, eps, k_stride_b, k_stride_h,
               v_stride_b, v_stride_h, slot_stride, slots, ROPE: tl.constexpr,
               HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """The row's own key (normalised and rotated where ``ROPE``) and value in the cache's
    dtype, written to its slot by one program per (row, key/value head); a slot outside
    the cache's ``slots`` (which the reference refuses) is not written."""
    k_own = _own_key(k_ptr + b.to(tl.int64) * k_stride_b + kvh * k_stride_h, d, d_mask,
                     pos, cs_ptr, cs_stride, kw_ptr, half, head_dim, eps, ROPE, HAS_NORM,
                     BLOCK_D)
    v_own = tl.load(v_ptr + b.to(tl.int64) * v_stride_b + kvh * v_stride_h + d,
                    mask=d_mask, other=0.0)
    k_own = cast(k_own.to(tl.float32), kc_ptr.dtype.element_ty, INTERPRET)
    v_own = cast(v_own.to(tl.float32), vc_ptr.dtype.element_ty, INTERPRET)
    if (s == 0) & (g % hb == 0):
        loc = tl.load(loc_ptr + b).to(tl.int64)
        k_row = kvh * head_dim + d
        inside = d < tl.where(in_table(loc, slots), head_dim, 0)
        tl.store(kc_ptr + loc * slot_stride + k_row, k_own, mask=inside)
        tl.store(vc_ptr + loc * slot_stride + k_row, v_own, mask=inside)
    return k_own, v_own


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, lens_ptr, sinks_ptr, out_ptr,
                   mid_o_ptr, mid_lse_ptr, counts_ptr, k_ptr, v_ptr, loc_ptr,
                   pos_ptr, qw_ptr, kw_ptr, cs_ptr,
                   q_stride_b, q_stride_h, out_stride_b, out_stride_h, k_stride_b,
                   k_stride_h, v_stride_b, v_stride_h, table_stride, pos_stride, cs_stride,
                   width, kv_heads, head_dim, split_len, scale, window, softcap, half, eps,
                   pages, cs_rows,
                   PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                   WRITE: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
                   IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
                   EARLY_V: tl.constexpr = False, KEY_LATE: tl.constexpr = False,
                   SPLIT_OF_LENGTH: tl.constexpr = True, SPLIT_QUANTUM: tl.constexpr = 0,
                   CUDA_CORES: tl.constexpr = False, AHEAD: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)  # key/value head, then block of its query heads
    s = tl.program_id(2)
    hb = tl.cdiv(GROUP, BLOCK_H)
    kvh = g // hb
    in_group = (g % hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = in_group < GROUP
    heads = kvh * GROUP + in_group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    raw = tl.load(lens_ptr + b)
    length = tl.minimum(raw, width * PAGE)
    lo = 0
    if WINDOW:  # the splits cover the window only: the read is bounded by it
        lo = tl.maximum(length - window, 0)
    if SPLIT_OF_LENGTH:  # the row's own tokens shared among the splits
        quantum = BLOCK_N if SPLIT_QUANTUM == 0 else SPLIT_QUANTUM
        split_len = tl.cdiv(tl.cdiv(length - lo, SPLITS), quantum) * quantum
    start = lo + s * split_len
    end = tl.minimum(start + split_len, length)
    q_rows = q_ptr + b.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h
    q = tl.load(q_rows + d[None, :], mask=h_ok[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    slot_stride = kv_heads * head_dim
    read_end = end
    if WRITE:
        # The row's own token (its last, where it lies in the row's pages) comes from k
        # and v, not from the cache this launch writes it to: no program reads that slot.
        own = tl.where(raw <= width * PAGE, length - 1, length)
        read_end = tl.minimum(end, own)
        pos = 0
        if ROPE:  # q as graphcap::qkv_norm_rope would leave it
            pos = table_row(tl.load(pos_ptr + b.to(tl.int64) * pos_stride).to(tl.int64),
                            cs_rows)
            q = _norm_rotated(q, q_rows, h_ok[:, None], d, d_mask, pos, cs_ptr, cs_stride,
                              qw_ptr, half, head_dim, eps, HAS_NORM)
        if not KEY_LATE:
            k_own, v_own = _write_own(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, b, kvh, s, g,
                                      hb, d, d_mask, pos, cs_ptr, cs_stride, kw_ptr, half,
                                      head_dim, eps, k_stride_b, k_stride_h, v_stride_b,
                                      v_stride_h, slot_stride, pages * PAGE, ROPE,
                                      HAS_NORM, BLOCK_D, INTERPRET)
    table_row_ptr = table_ptr + b.to(tl.int64) * table_stride
    if CUDA_CORES:
        m_i, l_i, acc = attend_in_lanes(q, kc_ptr, vc_ptr, table_row_ptr, pages, start,
                                        read_end, kvh * head_dim, slot_stride, d, d_mask,
                                        scale, softcap, SOFTCAP, PAGE, BLOCK_N, AHEAD)
    else:
        for n0 in range(start, read_end, BLOCK_N):
            t_mask, offs, kv_mask, k = kv_block(kc_ptr, table_row_ptr, pages, n0, read_end,
                                                kvh * head_dim, slot_stride, d, d_mask,
                                                PAGE, BLOCK_N)
            if EARLY_V:  # the values asked for with the keys, before the scores need them
                v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
            scores = scores_of(q, k, IEEE, INTERPRET) * scale
            if SOFTCAP:
                scores = soft_cap(scores, softcap)
            scores = tl.where(t_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: a token is in it
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            if not EARLY_V:
                v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
            acc = add_weighted(acc * alpha[:, None], p, v, IEEE, INTERPRET)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    if WRITE:
        if KEY_LATE:  # the own key and value read (and written) only now
            k_own, v_own = _write_own(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, b, kvh, s, g,
                                      hb, d, d_mask, pos, cs_ptr, cs_stride, kw_ptr, half,
                                      head_dim, eps, k_stride_b, k_stride_h, v_stride_b,
                                      v_stride_h, slot_stride, pages * PAGE, ROPE,
                                      HAS_NORM, BLOCK_D, INTERPRET)
        if (own >= start) & (own < end):  # the own token joins this split's softmax
            score = tl.sum(q.to(tl.float32) * k_own.to(tl.float32)[None, :], axis=1) * scale
            if SOFTCAP:
                score = soft_cap(score, softcap)
            m_own = tl.maximum(m_i, score)
            a_own = tl.exp(m_i - m_own)
            p_own = tl.exp(score - m_own)
            acc = acc * a_own[:, None] + p_own[:, None] * v_own.to(tl.float32)[None, :]
            l_i = l_i * a_own + p_own
            m_i = m_own
    # Empty by its token count, not by l_i: NaN in the row's own tokens stays NaN.
    has = end > start
    safe = tl.where(has, l_i, 1.0)  # an empty split: no 0/0 even where it is not kept
    o = acc / safe[:, None]
    lse = m_i + tl.log(safe)
    sink = tl.zeros([BLOCK_H], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
    out_rows = b.to(tl.int64) * out_stride_b + heads * out_stride_h
    if SPLITS == 1:
        _write_out(o, lse, has, sink, out_ptr, out_rows, d, h_ok, d_mask, SINKS, INTERPRET)
    else:
        # Partials [rows, kv heads x head blocks, SPLITS, BLOCK_H (, BLOCK_D)] in float32,
        # of the block's query heads only (a GQA group of 2 fills 2 of its 16 rows).
        block = b * tl.num_programs(1) + g
        part = (block.to(tl.int64) * SPLITS + s) * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(mid_o_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=h_ok[:, None])
        tl.store(mid_lse_ptr + part, tl.where(has, lse, float("-inf")), mask=h_ok)
        tl.debug_barrier()  # every thread's partial is stored before the count says so
        arrived = tl.atomic_add(counts_ptr + block, 1)  # acq_rel, GPU scope
        if arrived == SPLITS - 1:  # the last program of this (row, head block) merges
            tl.atomic_xchg(counts_ptr + block, 0)  # back to zero for the next launch
            first = block.to(tl.int64) * SPLITS * BLOCK_H + tl.arange(0, BLOCK_H)
            top = tl.full([BLOCK_H], float("-inf"), tl.float32)
            seen = tl.zeros([BLOCK_H], tl.int1)  # a split read a token (NaN counts)
            for i in tl.static_range(SPLITS):  # .cg: from L2, never a stale L1 line
                lse_i = tl.load(mid_lse_ptr + first + i * BLOCK_H, mask=h_ok,
                                other=float("-inf"), cache_modifier=".cg")
                top = tl.maximum(top, lse_i)
                seen = seen | (lse_i != float("-inf"))
            top_safe = tl.where(top == float("-inf"), 0.0, top)
            total = tl.zeros([BLOCK_H], tl.float32)
            merged = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for i in tl.static_range(SPLITS):
                lse_i = tl.load(mid_lse_ptr + first + i * BLOCK_H, mask=h_ok,
                                other=float("-inf"), cache_modifier=".cg")
                w = tl.where(lse_i == float("-inf"), 0.0, tl.exp(lse_i - top_safe))
                o_i = tl.load(mid_o_ptr + (first + i * BLOCK_H)[:, None] * BLOCK_D
                              + d[None, :], mask=h_ok[:, None], other=0.0,
                              cache_modifier=".cg")
                merged += w[:, None] * o_i  # NaN passes
                total += w
            merged = merged / tl.where(total == 0, 1.0, total)[:, None]
            _write_out(merged, top_safe + tl.log(tl.where(total == 0, 1.0, total)),
                       seen, sink, out_ptr, out_rows, d, h_ok, d_mask, SINKS,
                       INTERPRET)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                     scale: float, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, k: torch.Tensor | None = None,
                     v: torch.Tensor | None = None, cache_loc: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None,
                     q_weight: torch.Tensor | None = None,
                     k_weight: torch.Tensor | None = None,
                     cos_sin_cache: torch.Tensor | None = None, eps: float = 1e-6,
                     num_splits: int | None = None, tiles: dict | None = None) -> None:
    """With ``k``, ``v`` [B, Hk, D] and ``cache_loc`` [B] (a decode step: each row its
    request's only new token), the rows' K/V are written to the cache at ``cache_loc`` in
    the same launch (no write kernel before it); with ``positions`` and ``cos_sin_cache``
    too, ``q`` and ``k`` are normalised (``q_weight``, ``k_weight``) and rotated there
    first. ``tiles`` overrides ``BLOCK_N``, ``num_warps``, ``num_stages``, ``EARLY_V``
    (each block's values loaded with its keys), ``KEY_LATE`` (the own key's and value's
    reads and write after the loop over the cache), ``SPLIT_OF_LENGTH`` (on by default:
    each split takes an equal share of its row's own tokens, in multiples of ``BLOCK_N``,
    or of ``SPLIT_QUANTUM`` tokens where given, so that a row shorter than the table (an
    engine's ``max_len``) reads in as many splits as its blocks fill, not the table
    width's first few; off: the table's width over the splits, the baseline of
    ``docs/notes/probes/decode_splits.py``), ``CUDA_CORES`` (the products in registers,
    of the group rounded up to a power of two, not tensor-core products of 16 rows: each
    of ``BLOCK_N`` lanes keeps its own online softmax, merged after the loop, its
    probabilities in float32; each block's values asked for with its keys; give
    ``BLOCK_N`` and ``num_warps`` with it: the default tiles' 64- and 128-token blocks
    spill, 16 tokens at 2 warps and 32 at 4 do not), ``AHEAD`` (with ``CUDA_CORES``: the
    next block's keys and values asked for before this block's products); benchmarks."""
    B, Hq, D = q.shape
    _, page, Hk, _ = k_cache.shape
    if B == 0 or Hq == 0:
        return
    width = block_table.shape[1]
    if window >= width * page:  # it cannot bind: every row's tokens lie inside it
        window = 0
    max_len = window or width * page  # the most tokens a row reads
    interpret = interpreting()
    group = Hq // Hk
    block_h, block_d = head_block(group), max(16, triton.next_power_of_2(D))
    programs = programs_of(B, Hq, Hk)
    sms = num_sms(q.device)
    if interpret:
        cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    else:
        cfg, auto = tiles_for(programs, max_len, sms, shared_memory(q.device),
                              block_d * k_cache.element_size(), block_h, block_d)
    cfg.update(tiles or {})
    if cfg.get("CUDA_CORES"):  # products in registers: the group's heads only
        block_h = min(block_h, triton.next_power_of_2(group))
    if interpret:  # several splits of the block size given, so that the merge is exercised
        auto = max(1, min(triton.cdiv(max_len, cfg["BLOCK_N"]), 4)) \
            if programs <= counters.CAPACITY else 1
    elif set(tiles or ()) & {"BLOCK_N", "num_stages"}:  # other tiles
        auto = splits_of_tiles(cfg, programs, max_len, sms)
    if num_splits is None:
        num_splits = auto
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if num_splits > 1 and programs > counters.CAPACITY:
        raise ValueError(f"num_splits {num_splits} over {programs} (row, head block)s: "
                         f"a split launch merges at most {counters.CAPACITY}")
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    launch = pdl_args(q.device, B, "decode_attention")
    if num_splits > 1:
        mid_o = torch.empty((programs * num_splits * block_h, block_d), dtype=torch.float32,
                            device=q.device)
        mid_lse = torch.empty(programs * num_splits * block_h, dtype=torch.float32,
                              device=q.device)
        counts = counters.zeroed(q.device, programs, launch)
    else:
        mid_o = mid_lse = counts = out
    sinks = out if sinks is None else sinks.contiguous()
    write = k is not None
    if not write:
        k = v = cache_loc = out
    rope = positions is not None
    if rope and not write:
        raise ValueError("decode_attention: positions (the rotary) come with a decode "
                         "step's k, v and cache_loc")
    if not rope:
        positions = cos_sin_cache = out
    has_norm = rope and q_weight is not None
    if not has_norm:
        q_weight = k_weight = out
    try:
        _decode_kernel[(B, programs // B, num_splits)](
            q, k_cache, v_cache, block_table, seq_lens, sinks, out, mid_o, mid_lse, counts,
            k, v, cache_loc, positions, q_weight, k_weight, cos_sin_cache, q.stride(0),
            q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), block_table.stride(0), positions.stride(0), cos_sin_cache.stride(0),
            width, Hk, D, split_len, float(scale), int(window), float(softcap),
            cos_sin_cache.shape[-1] // 2, float(eps), k_cache.shape[0],
            cos_sin_cache.shape[0], PAGE=page, GROUP=group,
            BLOCK_H=block_h, SPLITS=num_splits, BLOCK_D=block_d, WINDOW=window > 0,
            SOFTCAP=softcap > 0, SINKS=sinks is not out, WRITE=write, ROPE=rope,
            HAS_NORM=has_norm, IEEE=q.dtype == torch.float32, INTERPRET=interpret,
            **launch, **cfg)
    except OutOfResources as exc:  # raised before anything is launched
        raise KernelUnavailable(
            f"graphcap::decode_attention: the Triton kernel needs {exc.required} B of "
            f"{exc.name} a program for {group} query heads a key/value head at head dim "
            f"{D} over a {k_cache.dtype} cache in {cfg['BLOCK_N']}-token blocks, and this "
            f"GPU gives {exc.limit}: keep the cache in bfloat16 or float16, or decode with "
            "FlashInfer (DecodeInputs(attention='flashinfer'))") from exc


__all__ = ["decode_attention"]
