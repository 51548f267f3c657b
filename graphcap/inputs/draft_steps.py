"""``k`` greedy decode steps in one replay: :class:`DraftStepsInputs`, what a draft model
runs to propose ``k`` tokens per request (:class:`~graphcap.engine.draft.DraftModel`).

``runner(tokens, positions=[...], slots=[...])`` as a decode step (one token per request
at its position), returns ``[requests, k]``: the argmax after the token, then the argmax
after that one, ``k`` times, each step fed the one before's on the device. Each step has
its own view of the cache (its positions the call's plus ``i``, its pages and places
derived inside the graph), so the ``k`` model forwards and their K/V writes are one graph
per batch bucket: one replay and one host read a draft step instead of ``k`` replays. The
cache then counts each request's ``k`` tokens as written (the call's token and the first
``k - 1`` it chose; the last one's K/V are the next call's to write).

The steps switch the forward context between them, which only a graph without eager
segments keeps at replay: ``full`` (and ``eager``). Under ``breakable`` and
``tc_piecewise`` run ``k`` decode steps (``DecodeInputs``) instead.
"""

from __future__ import annotations

import torch

from graphcap.core.checks import positive_int
from graphcap.core.inputs import Batch
from graphcap.errors import BadBatch
from graphcap.inputs.paged import PagedInputs, PagedState, recompute
from graphcap.kv.paged import PagedKVCache


class DraftStepsInputs(PagedInputs):
    """``steps`` greedy decode steps of each request over ``cache`` per call (the module
    docstring); ``decode_attention`` as :class:`PagedInputs` takes it."""

    strategies = ("eager", "full")
    why_not = ("its steps switch the cache view between forwards, which the eager "
               "segments of a breakable or tc_piecewise replay would read unswitched: "
               "call a decode runner (DecodeInputs) once per step there")

    def __init__(self, cache: PagedKVCache, steps: int, *, decode_attention=None,
                 name: str = "the model"):
        super().__init__(cache, 1, decode_attention=decode_attention, name=name)
        self.steps = positive_int(steps, "steps")
        self.moved: list[torch.Tensor] = []  # positions of steps 1 .. k - 1

    def bind(self, model) -> None:
        super().bind(model)
        self.row_unit = f"a request's {self.steps} greedy tokens"

    def check(self, args: tuple, kwargs: dict) -> Batch:
        batch = super().check(args, kwargs)
        k = self.steps
        ends = [(slot, end - 1 + k) for slot, end in batch.host]
        over = [(s, e) for s, e in ends if e > self.cache.capacity(s)]
        if over:
            raise BadBatch(f"{k} steps end past what their slots were admitted for: (slot, "
                           f"end) {over}; admit requests for the draft's steps too")
        if self.max_position is not None and max(e for _, e in ends) > self.max_position:
            raise BadBatch(f"{k} steps reach past the model's max_position "
                           f"{self.max_position}")
        batch.host = ends
        return batch

    @property
    def tokens_each(self) -> int:
        return self.steps  # k tokens; the first may be all kept

    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        super().allocate(max_tokens, batch)
        self.moved = [torch.zeros_like(self.buffers[1]) for _ in range(self.steps - 1)]

    def _positions(self, count: int) -> list[torch.Tensor]:
        return [b[:count] for b in [self.buffers[1], *self.moved]]

    def prepare(self, bucket: int) -> list[PagedState]:
        token_slots = self.buffers[2][:bucket]
        states = [PagedState(self._cache_batch(token_slots, p, bucket))
                  for p in self._positions(bucket)]
        for state in states:
            if state.kv.plan is not None and state.kv.plan.on_host:
                state.kv.plan.update([], [])
        return states

    def derive(self, states: list[PagedState]) -> None:
        count = states[0].tokens
        first, *later = self._positions(count)
        for i, moved in enumerate(later, start=1):
            torch.add(first, i, out=moved)
        token_slots = self.buffers[2][:count]
        for state, positions in zip(states, self._positions(count), strict=True):
            recompute(state.kv, token_slots, positions)

    def forward(self, model, bucket: int, states: list[PagedState]):
        last = self.last_rows[:bucket] if self.per_request else None
        return self._steps(model, states, self.buffers[0][:bucket],
                           self._positions(bucket), last)

    def _steps(self, model, states, ids, positions, last) -> torch.Tensor:
        chosen = []
        for state, at in zip(states, positions, strict=True):
            ids = self._run(model, state, ids, at, [], last).argmax(dim=-1)
            chosen.append(ids)
        return torch.stack(chosen, dim=1)

    def stage(self, batch: Batch, bucket: int, states: list[PagedState]) -> None:
        self._stage_tokens(batch, bucket)
        self._plan_steps(states, batch)

    def _plan_steps(self, states: list[PagedState], batch: Batch) -> None:
        """Each step's decode attention plan, where its backend plans on the host."""
        positions, slots = batch.args[1].tolist(), batch.args[2].tolist()
        for i, state in enumerate(states):
            if state.kv.plan is not None and state.kv.plan.on_host:
                state.kv.plan.update([p + i for p in positions], slots)

    def context(self, states: list[PagedState]):
        return states[0].context()

    def eager(self, model, batch: Batch):
        ids, (positions, token_slots) = self.eager_ids(batch), batch.args[1:3]
        positions, token_slots = (t.to(self.device, non_blocking=True)
                                  for t in (positions, token_slots))
        moved = [positions + i for i in range(self.steps)]
        states = [PagedState(self._cache_batch(token_slots, p, batch.tokens))
                  for p in moved]
        self._plan_steps(states, batch)
        last = self._last_rows(batch.tokens) if self.per_request else None
        return lambda: self._steps(model, states, ids, moved, last)


__all__ = ["DraftStepsInputs"]
