"""What a decode attention launch at batch 1 and 8 spends its time on (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_chain.py [batches]

At qwen3-0.6b's heads (16 q, 8 key/value heads of 128) and a 1024-token context, graphcap's
Triton kernel takes about 9.7 us a layer at batch 1 in the step (8 us alone) for a 4 MB
read that one streaming launch would finish in about 3.4 us (history items 95, 108). The
launch-floor note puts the rest on its chain of dependent reads; item 95 removed one link
(the row's length) and nothing moved. This probe times, each alone over cache layers cycled
past L2 (``graphcap.bench.timing.cycled_ms``, as ``graphcap bench ops`` times the kernel),
launches of the kernel's own grid that do less and less of its work, so the difference
between two arms is what one link costs:

- ``kernel``: ``graphcap::decode_attention``'s Triton kernel as a step runs it (its split
  count and tiles from ``tiles_for``; PDL off, as every arm here);
- ``kernel splits=S``: the same at other split counts;
- ``kernel cuda cores``: the same with its products in registers, of the group's heads
  only (``CUDA_CORES``), at other blocks, warps and splits, the next block asked for
  before this block's products or not (``AHEAD``);
- ``read``: a kernel of the same grid that reads each program's keys and values through the
  block table after the row's length, sums them and stores one number a program: the
  kernel's reads without its products, its softmax or its merge;
- ``read, merge``: ``read`` with the kernel's merge (each program stores a partial of a
  head dim's floats, counts in with an atomic, and the last of a row and head reads them
  all back from L2 and writes the sum);
- ``read, no table``: ``read`` with each block's pages computed from the row (the pages one
  after another) instead of loaded from the block table;
- ``read, no table, no length``: that with the row's length a launch argument;
- ``read, one block``: ``read`` in blocks of ``BLOCK_N`` tokens, all a program's tokens
  asked for at once (``BLOCK_N`` = its split), the loop gone;
- ``read, head-major pages``: ``read`` of pages laid out ``[heads, tokens, head dim]``
  (FlashInfer's HND) where graphcap's are ``[tokens, heads, head dim]``: each program's
  head of a page one contiguous run of 4 KB where today it is 256 bytes every 2 KB;
- ``read tokens``: the same bytes read in whole tokens, a program reading every key/value
  head of its chunk of a row's tokens (each token's keys one contiguous run of 2 KB, where
  ``read`` takes one head's 256 bytes of each token), as many programs as ``read`` has
  and twice as many, at a few blocks, warps and stages: whether reading a row's cache in
  head slices is what holds the grid below the bandwidth;
- ``tokens attention``: decode attention in whole tokens (``_tokens_attention_kernel``): a
  program attends every query head of a row over its chunk of tokens, one product of all
  query heads against every key/value head's rows of a block (those of other heads masked:
  block-diagonal), partials merged by the row's last program to arrive; at 1 to 8 times
  the kernel's split count as chunks a row, a few blocks and warps, and without the merge.

The same bytes every arm (the split's tokens of keys and values), so every arm's time is
fixed cost plus bytes at the rate its grid reaches. Printed per batch: us a launch of each
arm (``PROBE_ARMS``, a regular expression: only the arms whose names it matches). JSON in
$OUT/decode-chain.json."""

import functools
import itertools
import json
import math
import os
import re
import sys

import torch
import triton
import triton.language as tl

from graphcap.bench.common import environment
from graphcap.bench.timing import cycled_ms
from graphcap.kv import PagedKVCache
from graphcap.opsdb.triton.common import (
    cast,
    dot,
    interpreting,
    num_sms,
    programmatic_launch,
    shared_memory,
)
from graphcap.opsdb.triton.decode import decode_attention
from graphcap.opsdb.triton.decode_grid import head_block, programs_of, tiles_for

HQ, HK, D, CONTEXT = 16, 8, 128, 1024
CYCLE_BYTES = 160 << 20  # past L2


@triton.jit
def _read_kernel(kc_ptr, vc_ptr, table_ptr, lens_ptr, out_ptr, mid_ptr, counts_ptr,
                 width, table_stride, split_len, host_len,
                 PAGE: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                 SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, TABLE: tl.constexpr,
                 LENGTH: tl.constexpr, MERGE: tl.constexpr, HEAD_MAJOR: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    d = tl.arange(0, D)
    length = host_len
    if LENGTH:
        length = tl.minimum(tl.load(lens_ptr + b), width * PAGE)
    start = s * split_len
    end = tl.minimum(start + split_len, length)
    total = tl.zeros([D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        if TABLE:
            page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // PAGE, mask=t_ok,
                           other=0).to(tl.int64)
        else:
            page = (b * width + t // PAGE).to(tl.int64) + 1  # the pages one after another
        if HEAD_MAJOR:  # pages laid out [heads, tokens, D]: a head's page one run
            offs = ((page * HK + kvh) * PAGE + t % PAGE)[:, None] * D + d[None, :]
        else:
            offs = (page * PAGE + t % PAGE)[:, None] * (HK * D) + kvh * D + d[None, :]
        k = tl.load(kc_ptr + offs, mask=t_ok[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=t_ok[:, None], other=0.0)
        total += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    block = b * HK + kvh
    if MERGE:
        tl.store(mid_ptr + (block * SPLITS + s) * D + d, total)
        tl.debug_barrier()
        arrived = tl.atomic_add(counts_ptr + block, 1)
        if arrived == SPLITS - 1:
            tl.atomic_xchg(counts_ptr + block, 0)
            merged = tl.zeros([D], tl.float32)
            for i in tl.static_range(SPLITS):
                merged += tl.load(mid_ptr + (block * SPLITS + i) * D + d, cache_modifier=".cg")
            tl.store(out_ptr + block * D + d, merged)
    else:
        tl.store(out_ptr + (block * SPLITS + s) * D + d, total)


@triton.jit
def _read_tokens_kernel(kc_ptr, vc_ptr, table_ptr, out_ptr, table_stride, chunk_len, length,
                        PAGE: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    """``read``'s bytes in whole tokens: a program reads every key/value head of its chunk
    of a row's tokens (each token's keys one contiguous run of HK x D elements), where
    ``read`` reads one head's D elements of every token of its split."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.arange(0, HK * D)
    start = c * chunk_len
    end = tl.minimum(start + chunk_len, length)
    total = tl.zeros([HK * D], tl.float32)
    for n0 in range(start, end, BLOCK_T):
        t = n0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // PAGE, mask=t_ok,
                       other=0).to(tl.int64)
        offs = (page * PAGE + t % PAGE)[:, None] * (HK * D) + e[None, :]
        k = tl.load(kc_ptr + offs, mask=t_ok[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=t_ok[:, None], other=0.0)
        total += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(out_ptr + (b * tl.num_programs(1) + c).to(tl.int64) * (HK * D) + e, total)


@triton.jit
def _tokens_attention_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, out_ptr, mid_o_ptr, mid_m_ptr,
                             mid_l_ptr, counts_ptr, table_stride, chunk_len, length, scale,
                             PAGE: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr,
                             D: tl.constexpr, BLOCK_T: tl.constexpr, MERGE: tl.constexpr,
                             INTERPRET: tl.constexpr):
    """Decode attention in whole tokens: a program attends every query head of row ``b``
    over its chunk of the row's tokens, each block's keys and values read as
    ``BLOCK_T x HK`` rows of ``D`` (token-major: each token's heads one contiguous run).
    Scores are one product of all ``HQ`` query heads against every row, the rows of
    other key/value heads masked out (block-diagonal), so the values' product sums each
    head's own rows only. Partials (unnormalised output, maximum, sum) per chunk; with
    ``MERGE`` the last program of a row to arrive merges its chunks and writes the row."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    R: tl.constexpr = BLOCK_T * HK
    r = tl.arange(0, R)
    h = tl.arange(0, HQ)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + h)[:, None] * D + d[None, :])
    same = (h // (HQ // HK))[:, None] == (r % HK)[None, :]
    m_i = tl.full([HQ], float("-inf"), tl.float32)
    l_i = tl.zeros([HQ], tl.float32)
    acc = tl.zeros([HQ, D], tl.float32)
    start = c * chunk_len
    end = tl.minimum(start + chunk_len, length)
    for n0 in range(start, end, BLOCK_T):
        t = n0 + r // HK
        t_ok = t < end
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // PAGE, mask=t_ok,
                       other=0).to(tl.int64)
        offs = ((page * PAGE + t % PAGE) * (HK * D) + (r % HK) * D)[:, None] + d[None, :]
        k = tl.load(kc_ptr + offs, mask=t_ok[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=t_ok[:, None], other=0.0)
        s = dot(q, tl.trans(k), tl.zeros([HQ, R], tl.float32), False, INTERPRET) * scale
        s = tl.where(same & t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a block holds a token of each head
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(cast(p, v.dtype, INTERPRET), v, acc * alpha[:, None], False, INTERPRET)
        m_i = m_new
    part = (b * chunks + c).to(tl.int64) * HQ + h
    tl.store(mid_o_ptr + part[:, None] * D + d[None, :], acc)
    tl.store(mid_m_ptr + part, m_i)
    tl.store(mid_l_ptr + part, l_i)
    if MERGE:
        tl.debug_barrier()
        arrived = tl.atomic_add(counts_ptr + b, 1)
        if arrived == chunks - 1:
            tl.atomic_xchg(counts_ptr + b, 0)
            top = tl.full([HQ], float("-inf"), tl.float32)
            for i in range(0, chunks):
                top = tl.maximum(top, tl.load(mid_m_ptr + (b * chunks + i) * HQ + h,
                                              cache_modifier=".cg"))
            total = tl.zeros([HQ], tl.float32)
            o = tl.zeros([HQ, D], tl.float32)
            for i in range(0, chunks):
                row = (b * chunks + i).to(tl.int64) * HQ + h
                w = tl.exp(tl.load(mid_m_ptr + row, cache_modifier=".cg") - top)
                total += w * tl.load(mid_l_ptr + row, cache_modifier=".cg")
                o += w[:, None] * tl.load(mid_o_ptr + row[:, None] * D + d[None, :],
                                          cache_modifier=".cg")
            o = o / total[:, None]
            tl.store(out_ptr + (b * HQ + h)[:, None] * D + d[None, :],
                     cast(o, out_ptr.dtype.element_ty, INTERPRET))


def _tokens_attention(cache, q, out, scale: float, chunks: int, block_t: int, warps: int,
                      stages: int, merge: bool = True, length: int = CONTEXT):
    """A launch of ``_tokens_attention_kernel`` a layer of ``cache``, for every row of
    ``q`` [rows, HQ, D] over ``length`` tokens of each row's pages (the launches share
    their partials and counts, as ``_read``'s do: the merging program zeroes its count)."""
    rows, hq, d = q.shape
    mid_o = torch.empty(rows * chunks * hq * d, dtype=torch.float32, device=q.device)
    mid_m = torch.empty(rows * chunks * hq, dtype=torch.float32, device=q.device)
    mid_l = torch.empty_like(mid_m)
    counts = torch.zeros(rows, dtype=torch.int32, device=q.device)
    chunk_len = triton.cdiv(triton.cdiv(length, chunks), block_t) * block_t

    def call(kc, vc):
        _tokens_attention_kernel[(rows, chunks)](
            q, kc, vc, cache.block_table, out, mid_o, mid_m, mid_l, counts,
            cache.block_table.stride(0), chunk_len, length, scale, PAGE=cache.page_size,
            HQ=hq, HK=cache.kv_heads, D=d, BLOCK_T=block_t, MERGE=merge,
            INTERPRET=interpreting(), num_warps=warps, num_stages=stages)
    return [functools.partial(call, *cache.layer(i)) for i in range(cache.layers)]


def _read_tokens(cache, lens, chunks: int, block_t: int, warps: int, stages: int):
    """``chunks`` programs a row, each reading every head of its share of the row's tokens
    in blocks of ``block_t`` tokens."""
    batch = lens.shape[0]
    chunk_len = triton.cdiv(CONTEXT, chunks)
    out = torch.empty(batch * chunks * HK * D, dtype=torch.float32, device="cuda")

    def call(kc, vc):
        _read_tokens_kernel[(batch, chunks)](
            kc, vc, cache.block_table, out, cache.block_table.stride(0), chunk_len, CONTEXT,
            PAGE=cache.page_size, HK=HK, D=D, BLOCK_T=block_t, num_warps=warps,
            num_stages=stages)
    return [functools.partial(call, *cache.layer(i)) for i in range(cache.layers)]


def _cache(batch: int):
    per_layer = batch * CONTEXT * HK * D * 2 * 2
    layers = max(2, -(-CYCLE_BYTES // per_layer))
    cache = PagedKVCache(layers, HK, D, max_requests=batch, max_len=CONTEXT,
                         dtype=torch.bfloat16, device="cuda")
    for slot in range(batch):
        cache.admit(slot, CONTEXT)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def _read(cache, lens, splits: int, block_n: int, *, table=True, length=True, merge=False,
          head_major=False):
    batch = lens.shape[0]
    split_len = triton.cdiv(triton.cdiv(CONTEXT, splits), block_n) * block_n
    out = torch.empty(batch * HK * splits * D, dtype=torch.float32, device="cuda")
    mid = torch.empty_like(out)
    counts = torch.zeros(batch * HK, dtype=torch.int32, device="cuda")
    width = cache.block_table.shape[1]
    if not table:  # the direct pages must lie inside the cache
        assert batch * width + 1 <= cache.k.shape[1], "too few pages for direct addressing"

    def call(kc, vc):
        _read_kernel[(batch, HK, splits)](
            kc, vc, cache.block_table, lens, out, mid, counts, width,
            cache.block_table.stride(0), split_len, CONTEXT, PAGE=cache.page_size, HK=HK, D=D,
            SPLITS=splits, BLOCK_N=block_n, TABLE=table, LENGTH=length, MERGE=merge,
            HEAD_MAJOR=head_major, num_warps=4, num_stages=3)
    return [functools.partial(call, *cache.layer(i)) for i in range(cache.layers)]


def batch_rows(batch: int) -> dict:
    cache = _cache(batch)
    dev = torch.device("cuda")
    scale = 1 / math.sqrt(D)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device=dev)
    block_h = head_block(HQ // HK)
    cfg, splits = tiles_for(programs_of(batch, HQ, HK), CONTEXT, num_sms(dev),
                            shared_memory(dev), D * 2, block_h, D)
    layers = [cache.layer(i) for i in range(cache.layers)]

    def kernel(**extra):
        return [functools.partial(decode_attention, q, kc, vc, cache.block_table, lens, out,
                                  scale, **extra) for kc, vc in layers]

    arms = {f"kernel (splits {splits}, {cfg})": kernel()}
    for s in sorted({1, 2, 4, 8, 16, 32} - {splits}):
        arms[f"kernel splits={s}"] = kernel(num_splits=s)
    for (bn, warps), s, ahead in itertools.product(  # products in registers
            ((16, 2), (32, 4), (64, 8)), (splits, 2 * splits, 4 * splits), (False, True)):
        if s <= 32:
            arms[f"kernel cuda cores BLOCK_N={bn} warps={warps} splits={s} ahead={ahead}"] = \
                kernel(num_splits=s, tiles={"CUDA_CORES": True, "BLOCK_N": bn,
                                            "num_warps": warps, "num_stages": 1,
                                            "AHEAD": ahead})
    bn = cfg["BLOCK_N"]
    arms["read"] = _read(cache, lens, splits, bn)
    arms["read, merge"] = _read(cache, lens, splits, bn, merge=True)
    arms["read, no table"] = _read(cache, lens, splits, bn, table=False)
    arms["read, no table, no length"] = _read(cache, lens, splits, bn, table=False,
                                              length=False)
    arms["read, one block"] = _read(cache, lens, splits, triton.cdiv(CONTEXT, splits))
    arms["read, head-major pages"] = _read(cache, lens, splits, bn, head_major=True)
    arms["read, head-major pages, merge"] = _read(cache, lens, splits, bn, merge=True,
                                                  head_major=True)
    for s in (2 * splits, 4 * splits):
        if s <= 64:
            arms[f"read splits={s}"] = _read(cache, lens, s, min(bn, CONTEXT // s))
            arms[f"read, head-major pages splits={s}"] = _read(
                cache, lens, s, min(bn, CONTEXT // s), head_major=True)
    for chunks, (bt, warps, stages) in itertools.product(  # the same bytes in whole tokens
            (HK * splits, 2 * HK * splits), ((8, 4, 3), (8, 8, 3), (16, 8, 2), (4, 4, 4))):
        arms[f"read tokens chunks={chunks} BLOCK_T={bt} warps={warps} stages={stages}"] = \
            _read_tokens(cache, lens, chunks, bt, warps, stages)
    for chunks, (bt, warps, stages) in itertools.product(  # attention in whole tokens
            (splits, 2 * splits, 4 * splits, 8 * splits), ((4, 4, 2), (8, 4, 2), (8, 8, 2),
                                                            (16, 8, 2))):
        if CONTEXT // chunks >= bt:
            arms[f"tokens attention chunks={chunks} BLOCK_T={bt} warps={warps} "
                 f"stages={stages}"] = _tokens_attention(cache, q, out, scale, chunks, bt,
                                                         warps, stages)
    for chunks in (splits, 4 * splits):
        arms[f"tokens attention, no merge chunks={chunks} BLOCK_T=8 warps=4 stages=2"] = \
            _tokens_attention(cache, q, out, scale, chunks, 8, 4, 2, merge=False)
    wanted = os.environ.get("PROBE_ARMS")  # a regex: the arms whose names it matches
    arms = {name: calls for name, calls in arms.items()
            if not wanted or re.match(wanted, name)}
    us, errors = {}, {}
    with programmatic_launch(False):
        for name, calls in arms.items():
            try:
                us[name] = round(cycled_ms(calls) * 1e3, 2)
            except Exception as exc:  # a tile past the shared memory: told, the rest run
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    nbytes = batch * CONTEXT * HK * D * 2 * 2
    return {"batch": batch, "context": CONTEXT, "bytes": nbytes, "splits": splits,
            "tiles": cfg, "us": us, "errors": errors}


def main() -> None:
    batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,8").split(",")]
    rows = []
    for batch in batches:
        row = batch_rows(batch)
        rows.append(row)
        for name, us in row["us"].items():
            print(f"b={batch:<3d} {name:60s} {us:7.2f} us")
        for name, err in row["errors"].items():
            print(f"b={batch:<3d} {name:60s} {err}")
    result = {**environment(), "what": "decode attention's links, each arm alone over cache "
              "layers cycled past L2, PDL off", "command": " ".join(sys.argv),
              "heads": [HQ, HK, D], "rows": rows}
    path = os.path.join(os.environ.get("OUT", "."), "decode-chain.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
