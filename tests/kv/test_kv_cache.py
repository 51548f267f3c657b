"""The paged K/V cache: pages handed out at admission and back at release, the null page
never owned, clear errors when the cache is full; and, with ``kv_write`` and
``decode_attention``, a request attends to exactly its own tokens, whatever the pages
nobody owns hold, and writes touch no page but its own."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphcap.errors import BadBatch, CacheFull, CacheTooLarge, OpInputError
from graphcap.kv import NULL_PAGE, PagedKVCache
from graphcap.opsdb.decode import DECODE_ATTENTION
from graphcap.opsdb.kv import KV_WRITE

HEADS, KV_HEADS, DIM = 4, 2, 16


def cache(**kw) -> PagedKVCache:
    args = dict(layers=2, kv_heads=KV_HEADS, head_dim=DIM, max_requests=4, max_len=40,
                page_size=8)
    return PagedKVCache(**{**args, **kw})


def test_admission_hands_out_whole_pages_and_writes_the_block_table():
    c = cache()
    assert c.k.shape == (2, 4 * 5 + 1, 8, KV_HEADS, DIM) and c.max_pages == 5
    pages = c.admit(2, 17)  # 17 tokens: 3 pages of 8
    assert len(pages) == 3 and NULL_PAGE not in pages
    assert c.block_table[2].tolist() == [*pages, NULL_PAGE, NULL_PAGE]
    assert c.capacity(2) == 17 and c.free_pages == 20 - 3
    c.release(2)
    assert c.block_table[2].tolist() == [NULL_PAGE] * 5 and c.free_pages == 20
    assert c.capacity(2) == 0


def test_a_step_is_checked_against_what_each_slot_was_admitted_for_and_has_written():
    """A step of k tokens a request may start at a slot's written tokens or before, and
    must end within what the slot was admitted for; each refusal names the slot."""
    c = cache()
    c.admit(0, 10)
    c.admit(3, 6)
    c.wrote([(0, 4), (3, 4)])
    c.check_step([0, 3], [4, 4], 2)  # tokens 4 and 5 of each
    with pytest.raises(BadBatch, match=r"steps of 3 tokens end past .* \(slot, end\) "
                                       r"\[\(3, 7\)\]"):
        c.check_step([0, 3], [4, 4], 3)
    with pytest.raises(BadBatch, match="position 5 of slot 0 skips past the 4 tokens"):
        c.check_step([0], [5])
    with pytest.raises(BadBatch, match="position 6 of slot 3 is outside the 6 tokens"):
        c.check_step([3], [6])
    with pytest.raises(BadBatch, match=r"position 0 of slot 1 .*holds no request"):
        c.check_step([1], [0])
    with pytest.raises(BadBatch, match="request slot 9 is not one of"):
        c.check_step([9], [0])
    with pytest.raises(BadBatch, match=r"a request slot must be an integer, got True"):
        c.check_step([True], [0])  # a bool is no slot


def _verdict(call):
    try:
        return call()
    except (BadBatch, ValueError) as e:
        return type(e), str(e)


@given(st.data())
def test_a_runners_checked_step_takes_and_refuses_exactly_what_the_full_check_does(data):
    """A runner's call checks its slots once (``requests``) and its step against them
    (``check_step(checked=True)``, a few C-level passes): the same steps pass, and the
    same errors name the same slot, as the slot-by-slot check of any slots and positions,
    windowed or not, with slots free, repeated, out of range or not ints."""
    window = data.draw(st.sampled_from([0, 8]), label="window")
    c = cache(max_requests=6, page_size=4, window=window)
    admitted = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True),
                         label="admitted")
    for slot in admitted:
        c.admit(slot, data.draw(st.integers(1, 40), label="tokens"))
        c.wrote([(slot, data.draw(st.integers(0, c.capacity(slot)), label="written"))])
    tokens = data.draw(st.integers(1, 3), label="tokens a slot")
    slots = data.draw(st.permutations(admitted), label="order")
    slots = slots[:data.draw(st.integers(1, len(slots)), label="requests")]
    count = len(slots)
    if data.draw(st.booleans(), label="spoil a slot"):  # free, repeated, out of range...
        spoilt = st.integers(-1, 7) | st.sampled_from([True, 2.0, "1"])
        slots[data.draw(st.integers(0, count - 1))] = data.draw(spoilt, label="slot")
    held = [type(s) is int and s in admitted for s in slots]  # True == 1: no slot
    near = [c.written(s) if h else 0 for s, h in zip(slots, held, strict=True)]
    ends = [c.capacity(s) - tokens if h else 0 for s, h in zip(slots, held, strict=True)]
    positions = [data.draw(st.sampled_from([w, w - 1, w + 1, e, e + 1, -1]), label="pos")
                 for w, e in zip(near, ends, strict=True)]

    def full():
        checked = [c._slot(s, BadBatch) for s in slots]
        if len(set(checked)) != count or any(s not in c._capacity for s in checked):
            return c.requests(slots, count)  # its error
        c.check_step(slots, positions, tokens)
        return checked

    def runner():
        ints = c.requests(slots, count)
        c.check_step(ints, positions, tokens, checked=True)
        return ints

    assert _verdict(runner) == _verdict(full)


def test_a_windowed_cache_frees_the_pages_behind_the_window_as_tokens_are_written():
    """Every layer windowed to 8 tokens, pages of 4: a step at position p reads p - 7 .. p,
    and the next step may be at written or written - 1, so the pages before token
    written - 8 are freed, their block-table entries the null page again."""
    c = cache(window=8, page_size=4)
    pages = c.admit(1, 40)  # 10 pages
    free = c.free_pages
    c.wrote([(1, 7)])
    assert c.free_pages == free  # nothing wholly behind yet
    c.wrote([(1, 12)])  # a step at 11 reads 4..11: page 0 (tokens 0..3) is behind
    assert c.pages_of(1) == [NULL_PAGE, *pages[1:]] and c.free_pages == free + 1
    assert c.block_table[1].tolist() == [NULL_PAGE, *pages[1:]]
    c.check_step([1], [12])
    c.check_step([1], [11])
    with pytest.raises(BadBatch, match="freed behind every layer's window of 8 tokens"):
        c.check_step([1], [10])  # would read token 3
    with pytest.raises(BadBatch, match=r"position 0 of slot 1 is one of the tokens before "
                                       r"4, .*release\(1\) and admit it again to start over"):
        c.check_step([1], [0])  # a new prompt in the slot: its first page is gone
    c.wrote([(1, 30)])  # tokens 0..21 behind: pages 0..4
    assert c.free_pages == free + 5 and c.block_table[1].tolist()[:6] == \
        [NULL_PAGE] * 5 + [pages[5]]
    c.admit(0, 20)  # a freed page serves another request
    assert set(c.pages_of(0)) & set(pages[:5])
    c.release(1)
    c.release(0)
    assert c.free_pages == c.pages and c.block_table.eq(NULL_PAGE).all()


def test_a_step_of_several_tokens_frees_pages_only_behind_its_first_token():
    """A verify step of 1 + k tokens may be rewound to its first (every proposal refused):
    its pages are freed only behind that token's window, so the step after the rewind
    finds them all; a rewind to fewer tokens than a step after them could attend over is
    refused, nothing changed."""
    c = cache(window=4, page_size=2)
    pages = c.admit(0, 24)
    c.wrote([(0, 10)])
    c.check_step([0], [10], 4)
    c.wrote([(0, 14)], tokens=4)  # positions 10..13; it may keep only 10
    assert c.pages_of(0)[:4] == [NULL_PAGE] * 3 + [pages[3]]  # tokens 0..5 behind 7..10
    assert c.least_kept(0) == 9
    c.rewind(0, 11)  # one token of the step kept
    c.check_step([0], [11], 4)  # reads 8..14: all there
    c.wrote([(0, 15)], tokens=4)
    with pytest.raises(ValueError, match="keep between 11 .* and the 15 tokens written"):
        c.rewind(0, 10)
    assert c.written(0) == 15 and c.least_kept(0) == 11


def test_a_cache_with_a_layer_of_full_attention_keeps_every_page():
    c = cache()  # window=0: some layer attends to every key
    pages = c.admit(1, 40)
    c.wrote([(1, 40)])
    assert c.pages_of(1) == pages and c.free_pages == c.pages - len(pages)
    with pytest.raises(ValueError, match="window=-1"):
        cache(window=-1)


@pytest.mark.parametrize("integer", [int, np.uint8, np.int16, torch.tensor])
def test_sizes_given_as_numpy_or_tensor_integers_size_the_cache_as_ints_do(integer):
    # 200 tokens of pages of 16: 13 pages a request (uint8 arithmetic wrapped to 253),
    # 20 requests of 13 pages: 260 (uint8: 4)
    c = cache(max_requests=integer(20), max_len=integer(200), page_size=integer(16),
              layers=integer(1), kv_heads=integer(1), head_dim=integer(4))
    assert type(c.max_pages) is int and type(c.pages) is int
    assert (c.max_pages, c.pages) == (13, 260)
    assert c.k.shape == (1, 261, 16, 1, 4) and c.block_table.shape == (20, 13)
    assert len([c.admit(slot, 200) for slot in range(20)]) == 20


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.int8,
                                   torch.complex64])
def test_a_dtype_the_cache_ops_do_not_take_is_refused_at_construction(dtype):
    # float64 and float8 were taken, then refused by kv_write at the first forward
    with pytest.raises(ValueError, match=r"dtype must be torch.float32, torch.float16 or "
                                         rf"torch.bfloat16 .*, not {dtype}"):
        cache(dtype=dtype)


def test_a_cache_on_the_meta_device_is_refused_naming_it():
    with pytest.raises(ValueError, match="device='meta': a cache on the meta device holds "
                                         "no keys or values"):
        cache(device="meta")
    with pytest.raises(ValueError, match="device='meta'"):
        cache(device=torch.device("meta"))


def test_a_cache_larger_than_the_device_has_free_is_refused_before_anything_is_allocated(
        monkeypatch):
    # K and V of a page: 2 layers x 8 tokens x 2 heads x 16 x 4 bytes, twice: 4 KiB
    page = 2 * 2 * 8 * KV_HEADS * DIM * 4
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 10 * page + 100)
    monkeypatch.setattr(torch, "zeros", None)  # nothing allocated: no call of it
    with pytest.raises(CacheTooLarge, match=r"a K/V cache of 20 pages of 8 tokens \(and the "
                       r"null page\), 2 layers of 2 x 16 float32, needs 0.08 MiB .*; cpu has "
                       r"0.04 MiB free, room for 9 pages \(72 tokens\): build it with fewer "
                       r"pages \(pages=, or fewer max_requests or a smaller max_len") as info:
        cache()  # 4 requests of 40 tokens: 5 pages each, and the null page
    assert (info.value.need, info.value.free, info.value.pages) == (21 * page, 10 * page + 100,
                                                                    9)
    assert isinstance(info.value, torch.OutOfMemoryError)  # as torch's own would be
    monkeypatch.undo()
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 10 * page)
    assert cache(pages=9).pages == 9  # what it said fits


def test_a_cache_the_host_cannot_allocate_is_refused_naming_its_size():
    with pytest.raises(CacheTooLarge, match=r"needs 134217728.00 GiB .*; cpu could not "
                                            r"allocate it: build it with fewer pages"):
        cache(layers=1 << 20, kv_heads=1 << 10, head_dim=1 << 10, max_requests=1,
              max_len=1 << 13, page_size=1 << 13)


def test_a_block_table_larger_than_memory_is_refused_naming_the_slots_and_pages(
        monkeypatch):
    with pytest.raises(CacheTooLarge, match=r"block table of 10000000 request slots of 62500 "
                       r"pages each \(max_len / page_size\) needs 4656.61 GiB; cpu could not "
                       r"allocate it: build the cache with fewer max_requests"):
        cache(max_requests=10**7, max_len=10**6, page_size=16, pages=4)
    # Where the device says what is free, nothing is allocated: the table is sized first.
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(torch, "zeros", None)
    monkeypatch.setattr(torch, "full", None)
    with pytest.raises(CacheTooLarge, match=r"block table of 100000 request slots of 5 pages "
                       r"each \(max_len / page_size\) needs 3.81 MiB; cpu has 1.00 MiB free: "
                       r"build the cache with fewer max_requests") as info:
        cache(max_requests=100_000, pages=4)  # the table and its host copy, int32 each
    assert (info.value.need, info.value.free, info.value.pages) == (4_000_000, 1 << 20, None)


def test_a_cache_whose_pages_and_block_table_both_exceed_what_is_free_names_the_pages_that_fit(
        monkeypatch):
    # The table of 100000 slots of 5 pages takes 3.81 MiB; its pages' K and V 1.5 GiB. The
    # pages are what to cut: an LLM reads the pages that fit to name the max_len that fits.
    page = 2 * 2 * 8 * KV_HEADS * DIM * 4
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(torch, "zeros", None)
    monkeypatch.setattr(torch, "full", None)  # nothing allocated, the table neither
    with pytest.raises(CacheTooLarge, match=r"a K/V cache of 500000 pages of 8 tokens .*; "
                       r"cpu has 1.00 MiB free, room for 255 pages") as info:
        cache(max_requests=100_000)
    assert (info.value.need, info.value.pages) == (500_001 * page, 255)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cache_past_the_gpus_memory_is_refused_with_what_is_free_and_nothing_allocated():
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.memory_allocated()
    tokens = total // (2 * 2 * KV_HEADS * DIM * 2) + 1024  # 2 layers of bf16 K and V
    with pytest.raises(CacheTooLarge, match=r"cuda(:0)? has \d+\.\d\d GiB free, room for "
                                            r"\d+ pages") as info:
        cache(layers=2, max_requests=1, max_len=tokens, page_size=1024,
              dtype=torch.bfloat16, device="cuda")
    assert info.value.need > total > info.value.free
    assert torch.cuda.memory_allocated() == before
    fits = info.value.pages // 4  # a quarter of what it says fits
    assert cache(layers=2, pages=fits, page_size=1024, max_requests=1, max_len=1024,
                 dtype=torch.bfloat16, device="cuda").pages == fits


def test_a_value_cache_that_fails_to_allocate_leaves_no_key_cache_held(monkeypatch):
    # The traceback (a REPL keeps the last) holds no half of the cache: a smaller one
    # built next finds the memory of the keys free.
    made, zeros = [], torch.zeros

    def zeros_then_out_of_memory(*args, **kwargs):
        if made:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        made.append(weakref.ref(tensor := zeros(*args, **kwargs)))
        return tensor

    monkeypatch.setattr(torch, "zeros", zeros_then_out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as info:
        cache()
    assert len(made) == 1 and made[0]() is None, "the keys' tensor is still held"
    assert isinstance(info.value, CacheTooLarge) and "could not allocate it" in str(info.value)


def test_a_full_cache_refuses_admission_and_changes_nothing():
    c = cache(pages=4)
    c.admit(0, 24)  # 3 of the 4 pages
    before = c.block_table.clone()
    with pytest.raises(CacheFull, match="needs 2 pages of 8 and 1 of 4 are free"):
        c.admit(1, 9)
    assert torch.equal(c.block_table, before) and c.free_pages == 1
    c.admit(1, 8)  # one page still fits
    c.release(0)
    c.release(1)
    with pytest.raises(CacheFull, match="needs 5 pages of 8 and 4 of 4 are free .*: no "
                                        "release frees that many, the cache has 4 in all"):
        c.admit(0, 40)  # more than the whole cache: releasing others cannot help
    assert c.free_pages == 4 and c.block_table.eq(NULL_PAGE).all()


@pytest.mark.parametrize(("call", "match"), [
    (lambda c: c.admit(4, 8), "not one of 0..3"),
    (lambda c: c.admit(0, 41), "exceeds the cache's max_len 40"),
    (lambda c: c.admit(0, 0), "positive int"),
    (lambda c: c.admit(0, 2.5), "positive int"),
    (lambda c: c.release(1), "holds no request"),
    (lambda c: (c.admit(0, 8), c.admit(0, 8)), "holds a request already"),
])
def test_bad_admissions_say_what_was_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call(cache())


def dense_attention(q, k, v):
    """One query row [Hq, D] over its request's k, v [L, Hk, D] (float64)."""
    group = q.shape[0] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * DIM ** -0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


@given(st.data())
def test_requests_admitted_and_released_in_any_order_attend_to_their_own_tokens(data):
    c = cache(layers=1)
    kernel = data.draw(st.sampled_from(["torch", "triton"]), label="kernel")
    if DECODE_ATTENTION.available("cpu")[kernel] is not None:
        kernel = "torch"
    live: dict[int, int] = {}
    for _ in range(data.draw(st.integers(1, 8), label="admissions")):
        slot = data.draw(st.sampled_from(range(4)), label="slot")
        if slot in live:
            c.release(slot)
            del live[slot]
        else:
            length = data.draw(st.integers(1, 40), label="length")
            try:
                c.admit(slot, length)
                live[slot] = length
            except CacheFull:
                pass
    k_cache, v_cache = c.layer(0)
    k_cache.fill_(float("nan"))  # what nobody's tokens hold: never read
    v_cache.fill_(float("nan"))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    rows = torch.tensor([s for s, n in live.items() for _ in range(n)], dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in live.values()]) if live else rows
    k = torch.randn(len(rows), KV_HEADS, DIM, generator=gen)
    v = torch.randn(len(rows), KV_HEADS, DIM, generator=gen)
    owned = torch.zeros(c.pages + 1, dtype=torch.bool)
    for pages in c.owned().values():
        owned[pages] = True
    KV_WRITE(k, v, k_cache, v_cache, c.cache_loc(rows, positions), kernel=kernel)
    assert k_cache[~owned].isnan().all() and v_cache[~owned].isnan().all()  # untouched
    slots = sorted(live)
    q = torch.randn(len(slots), HEADS, DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor([live[s] for s in slots], dtype=torch.int32)
    DECODE_ATTENTION(q, k_cache, v_cache, c.block_table[slots], lens, out, DIM ** -0.5,
                     kernel=kernel)
    for i, s in enumerate(slots):
        mine = rows == s
        want = dense_attention(q[i], k[mine], v[mine])
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


def test_a_padded_row_on_the_null_page_comes_out_zero_and_writes_only_the_null_page():
    c = cache(layers=1)
    c.admit(0, 5)
    k_cache, v_cache = c.layer(0)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    real = torch.ones(1, KV_HEADS, DIM)
    # Row 0 is a request at position 0, row 1 a pad: its slot row is free (null page).
    slots = c.cache_loc(torch.tensor([0, 3]), torch.tensor([0, 0]))
    assert slots[1] // c.page_size == NULL_PAGE
    KV_WRITE(torch.cat([real, real * 7]), torch.cat([real, real * 7]), k_cache, v_cache,
             slots)
    assert k_cache[1:].isnan().sum() == k_cache[1:].numel() - KV_HEADS * DIM  # one slot
    q = torch.ones(2, HEADS, DIM)
    out = torch.full_like(q, float("nan"))
    DECODE_ATTENTION(q, k_cache, v_cache, c.block_table[[0, 3]],
                     torch.tensor([1, 0], dtype=torch.int32), out, 1.0)
    torch.testing.assert_close(out[0], torch.ones(HEADS, DIM))
    assert torch.equal(out[1], torch.zeros(HEADS, DIM))


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_nan_in_a_rows_own_tokens_is_that_rows_alone(kernel):
    if DECODE_ATTENTION.available("cpu")[kernel] is not None:
        pytest.skip(DECODE_ATTENTION.available("cpu")[kernel])
    c = cache(layers=1)
    c.admit(0, 40)
    c.admit(1, 40)
    k_cache, v_cache = (t.normal_() for t in c.layer(0))
    k_cache[c.owned()[0][0], 3, 1] = float("nan")  # row 0's token 3, kv head 1
    q = torch.randn(2, HEADS, DIM)
    out = torch.empty_like(q)
    lens = torch.tensor([40, 40], dtype=torch.int32)
    DECODE_ATTENTION(q, k_cache, v_cache, c.block_table[:2], lens, out, DIM ** -0.5,
                     kernel=kernel)
    assert out[0, 2:].isnan().all() and not out[0, :2].isnan().any()  # kv head 1's group
    assert not out[1].isnan().any()


def test_a_token_out_of_range_maps_to_the_null_page():
    c = cache()  # 5 pages of 8 per row
    c.admit(1, 16)
    rows = torch.tensor([1, 1, 1, -1, 9, 1])
    positions = torch.tensor([9, -1, 40, 0, 0, 17])  # 17: past the request's two pages
    pages = (c.cache_loc(rows, positions) // c.page_size).tolist()
    assert pages == [c.owned()[1][1], NULL_PAGE, NULL_PAGE, NULL_PAGE, NULL_PAGE,
                     NULL_PAGE]


def test_strided_metadata_is_refused():
    c = cache(layers=1)
    k_cache, v_cache = c.layer(0)
    q = torch.randn(2, HEADS, DIM)
    lens = torch.ones(2, 2, dtype=torch.int32)[:, 1]
    with pytest.raises(OpInputError, match="seq_lens must be contiguous"):
        DECODE_ATTENTION(q, k_cache, v_cache, c.block_table[:2], lens, torch.empty_like(q),
                         1.0)
    cache_loc = torch.zeros(4, dtype=torch.long)[::2]
    with pytest.raises(OpInputError, match="cache_loc must be contiguous"):
        KV_WRITE(torch.ones(2, KV_HEADS, DIM), torch.ones(2, KV_HEADS, DIM), k_cache,
                 v_cache, cache_loc)


def test_the_old_graphcap_cache_steps_import_still_works_and_says_where_it_went():
    import importlib
    import sys

    from graphcap.engine import decode_step, prefill

    sys.modules.pop("graphcap.cache.steps", None)
    sys.modules.pop("graphcap.cache", None)
    with pytest.warns(DeprecationWarning, match="graphcap.engine"):
        old = importlib.import_module("graphcap.cache.steps")
    assert old.decode_step is decode_step and old.prefill is prefill


def test_the_old_graphcap_cache_import_still_works_and_says_where_each_part_went():
    import importlib
    import sys

    from graphcap.inputs import DecodeInputs

    sys.modules.pop("graphcap.cache", None)
    with pytest.warns(DeprecationWarning, match="graphcap.kv.*graphcap.inputs"):
        old = importlib.import_module("graphcap.cache")
    assert old.PagedKVCache is PagedKVCache and old.DecodeInputs is DecodeInputs


def test_the_old_slots_method_still_gives_each_tokens_place_and_says_its_new_name():
    c = cache()
    c.admit(0, 8)
    rows, positions = torch.tensor([0, 0]), torch.tensor([0, 5])
    with pytest.warns(DeprecationWarning, match="cache_loc"):
        old = c.slots(rows, positions)
    assert torch.equal(old, c.cache_loc(rows, positions))


@pytest.mark.parametrize("layer_window", [0, 12])
def test_a_layer_attending_further_back_than_the_cache_keeps_pages_is_refused(layer_window):
    """A cache windowed to 4 frees the pages behind that window: a layer of full attention
    or of a longer window would read the null page as its request's first tokens."""
    from graphcap.core.context import forward_context
    from graphcap.errors import UnsupportedModel
    from graphcap.kv import CacheBatch
    from graphcap.opsdb.cached import CACHED_ATTENTION

    c = cache(layers=1, max_requests=1, max_len=16, page_size=4, window=4)
    c.admit(0, 16)
    kv = CacheBatch.paged(c, torch.tensor([0]), torch.tensor([0]))
    kv.decode = True
    q, k, out = torch.randn(1, HEADS, DIM), torch.randn(1, KV_HEADS, DIM), \
        torch.zeros(1, HEADS, DIM)
    reach = "full attention" if layer_window == 0 else "a window of 12"
    with forward_context(kv=kv), pytest.raises(
            UnsupportedModel, match=f"layer 0 attends with {reach}, but the K/V cache frees "
                                    "pages behind a window of 4"):
        CACHED_ATTENTION(q, k, k, out, DIM ** -0.5, 0, layer_window, 0.0, None)
    with forward_context(kv=kv):  # a layer within the cache's window
        CACHED_ATTENTION(q, k, k, out, DIM ** -0.5, 0, 3, 0.0, None)
    assert out.isfinite().all()


def test_request_slots_come_in_the_callers_order_a_set_is_refused():
    c = cache()
    c.admit(0, 4)
    c.admit(3, 4)
    assert c.requests((3, 0), 2) == [3, 0]
    assert c.requests(torch.tensor([3, 0]), 2) == [3, 0]
    assert c.requests({3: "a", 0: "b"}.keys(), 2) == [3, 0]  # ordered
    with pytest.raises(BadBatch, match="slots must be ints in the requests. order .* got {"):
        c.requests({3, 0}, 2)  # no order: tokens would pair with slots by a set's order
    for bad in (0, None, torch.tensor(0)):
        with pytest.raises(BadBatch, match="slots must be ints in the requests. order"):
            c.requests(bad, 1)


def test_bad_numbers_given_to_the_cache_are_named_not_misreported():
    """A rewind to a numpy or 0-d host integer keeps that many tokens (a float is refused
    as no integer, not as out of range); a step's positions that are no ints, or fewer
    than its slots, are refused naming them; a dtype that is no torch.dtype is named."""
    import numpy as np

    c = cache()
    c.admit(0, 10)
    c.wrote([(0, 5)])
    c.rewind(0, np.int64(4))
    c.rewind(0, torch.tensor(3))
    assert c.written(0) == 3
    with pytest.raises(ValueError, match=r"rewind of slot 0: the tokens to keep must be an "
                                         r"integer, got 2\.0"):
        c.rewind(0, 2.0)
    with pytest.raises(ValueError, match=r"rewind of slot 0 to 4: keep between 0 and the 3 "
                                         r"tokens written$"):
        c.rewind(0, 4)  # no window: nothing was freed behind one
    with pytest.raises(BadBatch, match=r"a position \(slot 0\) must be an integer, got 1\.5"):
        c.check_step([0], [1.5])
    with pytest.raises(BadBatch, match="1 request slots and 2 positions"):
        c.check_step([0], [1, 2])
    with pytest.raises(ValueError, match="dtype must be torch.float32, .* not 'float16'"):
        cache(dtype="float16")


def test_a_written_list_naming_a_slot_without_a_request_counts_none_of_it():
    c = cache()
    c.admit(0, 10)
    with pytest.raises(ValueError, match="request slot 3 holds no request"):
        c.wrote([(0, 5), (3, 2)])
    assert c.written(0) == 0  # slot 0's end was not counted either
    c.wrote(iter([(0, 5)]))  # any iterable of (slot, end)
    assert c.written(0) == 5


@pytest.mark.parametrize("tokens", [0, -1, 1.0, True])
def test_a_step_of_no_whole_positive_token_count_is_refused(tokens):
    c = cache()
    c.admit(0, 10)
    with pytest.raises(ValueError, match=f"tokens={tokens!r}, not a positive int"):
        c.check_step([0], [0], tokens)


def test_a_cache_that_fails_past_a_free_figure_that_said_it_fit_names_no_size_to_retry(
        monkeypatch):
    # Free memory a graph pool holds counted as free: a figure of what fits now would
    # name the size that just failed, or a larger one
    zeros = torch.zeros

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")

    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(CacheTooLarge, match="cpu could not allocate it") as info:
        cache()
    assert info.value.pages is None and info.value.free is None
    monkeypatch.setattr(torch, "zeros", zeros)


def test_an_allocator_that_keeps_no_statistics_leaves_the_free_figure_unknown(monkeypatch):
    from graphcap.kv.sizing import free_bytes

    def unsupported(device=None):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 34))
    monkeypatch.setattr(torch.cuda, "memory_reserved", unsupported)
    assert free_bytes(torch.device("cuda", 0)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cache_of_another_dtype_than_the_models_is_refused_at_the_first_prefill(dtype):
    """A float32 model's keys rounded into a half-precision cache would prefill, and every
    step over the pages after fail on the dtypes: the first layer's write is refused
    naming both, nothing counted written, and the slot prefills into a cache that fits."""
    from graphcap.engine import prefill
    from graphcap.errors import UnsupportedModel
    from graphcap.models import PRESETS, Decoder

    torch.manual_seed(0)
    m = Decoder(PRESETS["tiny"]).eval()
    a = m.args
    c = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=1, max_len=8,
                     page_size=4, dtype=dtype)
    c.admit(0, 8)
    with pytest.raises(UnsupportedModel, match=rf"layer 0's keys and values are "
                                               rf"torch.float32, but the K/V cache holds "
                                               rf"{dtype}: build the cache in the model's"):
        prefill(m, c, torch.tensor([1, 2, 3]), [3], [0])
    assert c.written(0) == 0 and not c.k.any()
    fits = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=1, max_len=8,
                        page_size=4)
    fits.admit(0, 8)
    prefill(m, fits, torch.tensor([1, 2, 3]), [3], [0])
    assert fits.written(0) == 3
