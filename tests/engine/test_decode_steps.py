"""Prefill into a paged cache and decode one token per request from it (eager): greedy
generation through the cache gives the tokens and logits of recomputing every sequence
from scratch at each step, with every page nobody owns full of NaN; bad calls are
refused before anything runs."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.engine.eager import decode_step, prefill
from graphcap.errors import BadBatch, UnsupportedModel
from graphcap.kv import PagedKVCache
from graphcap.models import PRESETS, Decoder

PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 11, 6, 2, 9, 10, 13, 1, 2]]
STEPS = 12


def model(preset: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(PRESETS[preset]).eval()


def recomputed(m, prompts, steps):
    """Greedy tokens and each step's logits, the whole sequence recomputed each step."""
    seqs, logits = [list(p) for p in prompts], []
    for _ in range(steps):
        row = []
        for s in seqs:
            with torch.inference_mode(), graphcap.packed([len(s)], "cpu"):
                out = m(torch.tensor(s), torch.arange(len(s)))[-1]
            row.append(out)
            s.append(int(out.argmax()))
        logits.append(torch.stack(row))
    return seqs, logits


def cached(m, cache, prompts, steps, slots):
    for slot, p in zip(slots, prompts, strict=True):
        cache.admit(slot, len(p) + steps)
    lens = [len(p) for p in prompts]
    out = prefill(m, cache, torch.tensor(sum(prompts, [])), lens, slots)
    seqs, logits = [list(p) for p in prompts], [out]
    for step in range(steps):
        tokens = out.argmax(-1)
        for s, t in zip(seqs, tokens.tolist(), strict=True):
            s.append(t)
        if step == steps - 1:
            break
        positions = [n + step for n in lens]  # host ints, as a runner takes them
        out = decode_step(m, cache, tokens, positions, slots)
        logits.append(out)
    return seqs, logits


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_greedy_decode_through_the_cache_is_recomputing_every_step(preset, kernel, environ):
    for op in ("KV_WRITE", "DECODE_ATTENTION"):
        environ.set(f"GRAPHCAP_{op}_KERNEL", kernel)
    from graphcap.opsdb.decode import DECODE_ATTENTION

    if DECODE_ATTENTION.available("cpu")[kernel] is not None:
        pytest.skip(DECODE_ATTENTION.available("cpu")[kernel])
    m = model(preset)
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=4, max_len=32,
                         page_size=4)
    cache.k.fill_(float("nan"))  # nothing unwritten is ever read
    cache.v.fill_(float("nan"))
    # The Triton interpreter runs each kernel in Python: 5 steps (past a page boundary
    # in every request) keep it quick; the torch kernels take all 12.
    steps = STEPS if kernel == "torch" else 5
    want_seqs, want_logits = recomputed(m, PROMPTS, steps)
    got_seqs, got_logits = cached(m, cache, PROMPTS, steps, slots=[2, 0, 3])
    assert got_seqs == want_seqs
    for step, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_logits_last_models_decode_the_same():
    m = model("tiny")
    last = Decoder(PRESETS["tiny"], logits="last").eval()
    last.load_state_dict(m.state_dict())
    a = m.args
    runs = []
    for each in (m, last):
        cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=3, max_len=32)
        runs.append(cached(each, cache, PROMPTS, 4, slots=[0, 1, 2]))
    assert runs[0][0] == runs[1][0]


@pytest.mark.parametrize(("call", "match"), [
    (lambda m, c: prefill(m, c, torch.tensor([1, 2]), [2], [1]), r"slots \[1\] hold no"),
    (lambda m, c: prefill(m, c, torch.tensor([1] * 9), [9], [0]), "longer than their"),
    (lambda m, c: prefill(m, c, torch.tensor([1, 2]), [1, 1], [0, 0]), "distinct"),
    (lambda m, c: decode_step(m, c, torch.tensor([1]), torch.tensor([8]), [0]),
     "position 8 of slot 0 is outside the 8 tokens"),
    # the eager prefill checks its ids as the eager decode step does: a negative one
    # would wrap around the embedding table, one past it fault on the device
    (lambda m, c: prefill(m, c, torch.tensor([1, -3]), [2], [0]),
     r"range over \[-3, 1\], outside the vocabulary \[0, 256\)"),
    (lambda m, c: prefill(m, c, torch.tensor([1, 256]), [2], [0]),
     r"range over \[1, 256\], outside the vocabulary"),
    (lambda m, c: prefill(m, c, torch.tensor([[1, 2, 3]]), [3], [0]),
     r"input_ids must be a 1-d tensor \[T\].*got a tensor of shape \(1, 3\)"),
    (lambda m, c: prefill(m, c, [1, 2, 3], [3], [0]),
     r"input_ids must be a 1-d tensor \[T\].*got list \[1, 2, 3\]"),
    # the decode step names its ids as the prefill does, its positions a tensor or not
    (lambda m, c: decode_step(m, c, [1], torch.tensor([0]), [0]),
     r"input_ids must be a 1-d tensor \[B\].*got list \[1\]"),
    (lambda m, c: decode_step(m, c, torch.tensor(1), torch.tensor(0), [0]),
     r"input_ids must be a 1-d tensor \[B\].*got a tensor of shape \(\)"),
])
def test_bad_steps_are_refused_before_anything_runs(call, match):
    m = model("tiny")
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=2, max_len=16)
    cache.admit(0, 8)
    before = cache.k.clone()
    with pytest.raises(BadBatch, match=match):
        call(m, cache)
    assert torch.equal(cache.k, before)


def test_a_model_that_writes_no_cache_is_refused():
    m = model("tiny")
    a = m.args
    cache = PagedKVCache(a.layers + 1, a.kv_heads, a.head_dim, max_requests=1, max_len=16)
    cache.admit(0, 8)
    with pytest.raises(UnsupportedModel, match=r"layers \[2\] of 3"):
        prefill(m, cache, torch.tensor([1, 2, 3]), [3], [0])



def test_a_compiled_forward_fills_the_cache_as_the_eager_one():
    """The cache is read and written at run time inside one opaque op
    (``graphcap::cached_attention``), so Dynamo's trace keeps it."""
    m = model("tiny")
    a = m.args
    caches = []
    for forward in (m, torch.compile(m, backend="eager", fullgraph=True)):
        cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=1, max_len=16)
        cache.admit(0, 8)
        prefill(forward, cache, torch.tensor([1, 2, 3]), [3], [0])
        step = decode_step(forward, cache, torch.tensor([4]), torch.tensor([3]), [0])
        caches.append((cache, step))
    (eager, want), (compiled, got) = caches
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled.k, eager.k)
    torch.testing.assert_close(compiled.v, eager.v)
