"""The K/V write of a paged cache: ``kv_write`` stores each token's key and value at its
place in the cache (``cache_loc``), inside the graph.

A layer's cache is ``k_cache``, ``v_cache`` ``[pages, page_size, kv_heads, head_dim]``;
slot ``s`` is row ``s % page_size`` of page ``s // page_size``
(:class:`graphcap.kv.PagedKVCache` hands them out). Every slot must lie in the cache:
padded rows write the null page, which no request reads (see docs/decode.md). (The
reference refuses a slot outside it; the Triton kernel, which cannot tell the host
without a sync, writes nothing there, never the memory around the cache.) Two tokens
of one call never share a slot, except padded rows on the null page, where which write
lands is unspecified.
"""

from __future__ import annotations

import torch

from graphcap.opsdb import checks
from graphcap.opsdb.spec import Kernel, register_op

OP = "kv_write"


def kv_write_reference(k, v, k_cache, v_cache, cache_loc) -> None:
    """k, v [T, Hk, D] -> k_cache, v_cache [P, S, Hk, D] at ``cache_loc`` [T], each
    token's place (``page * page_size + offset``), in place."""
    P, S, Hk, D = k_cache.shape
    index = cache_loc.long()
    k_cache.view(P * S, Hk, D).index_copy_(0, index, k.to(k_cache.dtype))
    v_cache.view(P * S, Hk, D).index_copy_(0, index, v.to(v_cache.dtype))


def check_kv_write(k, v, k_cache, v_cache, cache_loc) -> None:
    checks.tensor(OP, "k", k, ndim=3)
    device = k.device
    checks.tensor(OP, "v", v, ndim=3, device=device)
    checks.tensor(OP, "k_cache", k_cache, ndim=4, device=device)
    checks.tensor(OP, "v_cache", v_cache, ndim=4, device=device)
    checks.tensor(OP, "cache_loc", cache_loc, ndim=1, dtypes=(torch.int32, torch.int64),
                  device=device)
    checks.same(OP, "the shape", tuple(v.shape), tuple(k.shape), "v", "k")
    checks.same(OP, "the shape", tuple(v_cache.shape), tuple(k_cache.shape), "v_cache",
                "k_cache")
    checks.same(OP, "the dtype", v_cache.dtype, k_cache.dtype, "v_cache", "k_cache")
    checks.same(OP, "the token count", cache_loc.shape[0], k.shape[0], "cache_loc", "k")
    checks.same(OP, "the [kv heads, head dim]", tuple(k_cache.shape[2:]),
                tuple(k.shape[1:]), "k_cache", "k")
    for name, t in (("k", k), ("v", v), ("cache_loc", cache_loc)):
        checks.last_dim_contiguous(OP, name, t)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise checks.OpInputError(f"{OP}: {name} must be contiguous (a cache layer "
                                      "[pages, page_size, kv heads, head dim])")


def kv_write_inputs(device, dtype, max_tokens: int = 24):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        page_size = d(st.sampled_from([1, 4, 16]))
        least = max(1, -(-t // page_size))
        pages = d(st.integers(least, least + 3))
        hk, head = d(st.sampled_from([1, 2])), d(st.sampled_from([16, 64, 128]))
        k, v, kc, vc = tensors(d, device, dtype, (t, hk, head), (t, hk, head),
                               (pages, page_size, hk, head), (pages, page_size, hk, head))
        order = d(st.permutations(range(pages * page_size)))  # distinct places
        cache_loc = torch.tensor(order[:t], dtype=d(st.sampled_from([torch.int32,
                                                                 torch.int64])))
        return k, v, kc, vc, cache_loc.to(device)

    return draw()


KV_WRITE = register_op(
    f"graphcap::{OP}",
    "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_loc) -> ()",
    reference=kv_write_reference,
    kernels={"triton": Kernel("graphcap.opsdb.triton.kv:kv_write", requires=("triton",),
                              dtypes=(torch.float16, torch.bfloat16, torch.float32))},
    check=check_kv_write, inputs=kv_write_inputs,
    doc="k, v [T, Hk, D] into a paged cache layer [P, S, Hk, D] at cache_loc [T]",
)
