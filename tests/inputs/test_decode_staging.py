"""A step's positions and request slots reach the static buffers in one copy from the
next of a round of host buffers (``graphcap.core.pinned``): every step's own values, pads
as position 0 and no request slot, also when the host runs rounds ahead of the device;
and a step refused after its buffer was taken leaves the next steps' values intact.
On the GPU the stream is held back while the host steps, so the copies are pending."""

from __future__ import annotations

import pytest
import torch

from graphcap.core.pinned import HOST_BUFFERS, HostRows
from graphcap.inputs import DecodeInputs
from graphcap.inputs.paged_calls import staged_places
from graphcap.kv import PagedKVCache
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
SLOTS, WIDTH = 6, 4


def staged_inputs():
    cache = PagedKVCache(1, 1, 8, max_requests=SLOTS, max_len=200, page_size=4,
                         device=DEVICE)
    for slot in range(SLOTS):
        cache.admit(slot, 200)
    inputs = DecodeInputs(cache)
    inputs.bind(torch.nn.Module())
    inputs.allocate(WIDTH, None)
    return cache, inputs


def steps(count: int):
    """Each step's request slots (one to WIDTH of them) and bucket."""
    for n in range(count):
        rows = sorted({(n + 2 * i) % SLOTS for i in range(1 + n % WIDTH)})
        yield rows, 2 if len(rows) <= 2 else WIDTH


def test_each_step_stages_its_own_positions_and_slots_in_one_copy_even_rounds_ahead():
    cache, inputs = staged_inputs()
    states = {b: inputs.prepare(b) for b in (2, WIDTH)}
    plan = list(steps(3 * HOST_BUFFERS + 2))
    tokens = [list(range(7 + n, 7 + n + len(rows))) for n, (rows, _) in enumerate(plan)]
    on_device = [torch.tensor(t, device=DEVICE) for t in tokens]  # before the stream waits
    seen, want = [], []
    if DEVICE == "cuda":
        torch.cuda._sleep(50_000_000)  # tens of ms: the steps below run rounds ahead
    for (rows, bucket), ids, host_ids in zip(plan, on_device, tokens, strict=True):
        positions = [cache.written(s) for s in rows]
        batch = inputs.check((ids,), {"positions": positions, "slots": rows})
        assert batch.staged.shape == (2, WIDTH)  # one of the round's buffers
        # The call's own columns of it, as an eager run reads them.
        assert [batch.args[1].tolist(), batch.args[2].tolist()] == [positions, rows]
        inputs.stage(batch, bucket, states[bucket])
        seen.append(torch.cat([inputs.buffers[0][None, :bucket],
                               inputs.places[:, :bucket]]).clone())
        pads = bucket - len(rows)
        want.append([[*host_ids, *[0] * pads], [*positions, *[0] * pads],
                     [*rows, *[-1] * pads]])
        inputs.commit(batch)  # each slot's next step is one position on
    for (rows, _), got, expected in zip(plan, seen, want, strict=True):
        assert got.tolist() == expected, rows


def test_a_step_that_took_its_buffer_and_never_copied_it_leaves_the_round_covered():
    # A call refused after its step took a host buffer (here the round's last, every
    # round) issues no copy of it: the next round must still wait for the copies of the
    # steps before it, with the stream held back so that they are pending.
    cache, inputs = staged_inputs()
    state = inputs.prepare(WIDTH)
    ids = torch.tensor([3], device=DEVICE)
    seen = []
    if DEVICE == "cuda":
        torch.cuda._sleep(50_000_000)
    for n in range(3 * HOST_BUFFERS + 2):
        slot = n % SLOTS
        positions = [cache.written(slot)]
        if n % HOST_BUFFERS == HOST_BUFFERS - 1:
            staged_places(inputs, [0], [slot])  # taken, never copied
            continue
        batch = inputs.check((ids,), {"positions": positions, "slots": [slot]})
        inputs.stage(batch, WIDTH, state)
        seen.append((slot, positions[0], inputs.places[:, :1].clone()))
        inputs.commit(batch)
    for slot, position, got in seen:
        assert got.tolist() == [[position], [slot]]


def test_host_rows_hand_out_their_buffers_in_turn():
    rows = HostRows(3, (2, 5), torch.long, DEVICE)
    order = []
    for _ in range(7):
        order.append(rows.take())
        rows.copied()
    assert order == ([0, 1, 2, 0, 1, 2, 0] if DEVICE == "cuda" else [0] * 7)
    assert rows.shape == (2, 5) and rows.tensors[0].is_pinned() == (DEVICE == "cuda")
