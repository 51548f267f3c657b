"""Draft heads on the target's hidden states (EAGLE, MTP and their kin) as proposers:
:class:`HeadProposer`.

A head is a module ``head(hidden [n, H], tokens [n]) -> (logits [n, vocab], hidden [n,
H])``: from the hidden state at a token's position and the token after it, the logits of
the token after that and the hidden state the next call starts from. Each step the
proposer starts from every request's hidden state at its last accepted token (the verify
step returns them: :class:`~graphcap.inputs.PagedInputs` ``hidden=True``) and the token
the target chose after it, and calls the head ``k`` times, each time on the argmax of the
call before: the ``k`` draft steps of all requests are one graph, captured per batch
bucket when the ``LLM`` is built (one replay and one host read a step).

A request just prefilled starts from its prompt's last token's hidden state (the prefill
graphs return it beside the logits). A head whose draft layer
attends over its own earlier positions (EAGLE's) needs a cache of its own, which this
form does not keep: such a head plugs in as a ``propose_batch`` proposer with graphs of
its own (:mod:`graphcap.engine.speculative`).
"""

from __future__ import annotations

import torch
from torch import nn

from graphcap.core.buckets import decode_ladder
from graphcap.core.checks import positive_int
from graphcap.engine.arguments import check_strategy


class _Steps(nn.Module):
    """``k`` calls of ``head``, each fed the argmax of the one before: ``[n, k]`` tokens."""

    def __init__(self, head: nn.Module, k: int):
        super().__init__()
        self.head, self.k = head, k

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        chosen = []
        for _ in range(self.k):
            logits, hidden = self.head(hidden, tokens)
            tokens = logits.argmax(dim=-1)
            chosen.append(tokens)
        return torch.stack(chosen, dim=1)


class HeadProposer:
    """``head`` (the module above, on the target's device and dtype) proposing ``k``
    tokens a step; ``hidden_size``: the target's hidden width (the head's input);
    ``strategy`` captures its ``k`` steps (``"full"``: one graph per batch bucket)."""

    hidden = True  # reads the target's hidden states (the verify steps return them)

    def __init__(self, head: nn.Module, k: int, hidden_size: int, *, strategy: str = "full"):
        self.head, self.k = head, positive_int(k, "k")
        self.hidden_size = positive_int(hidden_size, "hidden_size")
        parameter = next(head.parameters(), None)
        if parameter is None:
            raise ValueError("the head has no parameters: give the module that computes "
                             "(logits, hidden) from (hidden, tokens)")
        self.device, self.dtype = parameter.device, parameter.dtype
        self.strategy = check_strategy(strategy, "the HeadProposer's strategy")
        self.runner = None
        self.steps = 0

    def bind(self, max_batch: int, max_len: int, vocab: int, *, progress=None) -> None:
        """Check the head's shapes on one row, then capture its ``k`` steps for up to
        ``max_batch`` requests, now: one call of the largest bucket captures every bucket
        of the ladder."""
        import graphcap

        if self.runner is not None:
            raise ValueError("this HeadProposer already serves an LLM: make one per LLM")
        hidden = torch.zeros(max_batch, self.hidden_size, device=self.device, dtype=self.dtype)
        tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        with torch.no_grad():
            logits, out = self.head(hidden[:1], tokens[:1])
        if tuple(logits.shape) != (1, vocab) or tuple(out.shape) != (1, self.hidden_size):
            raise ValueError(f"the head gave logits {tuple(logits.shape)} and hidden "
                             f"{tuple(out.shape)} for one row: its logits must be [n, "
                             f"{vocab}] (the target's token ids), its hidden [n, "
                             f"{self.hidden_size}]")
        steps = _Steps(self.head, self.k)
        try:
            self.runner = graphcap.capture(steps, self.strategy,
                                           buckets=decode_ladder(max_batch),
                                           progress=progress)
            self.runner(hidden, tokens)  # the largest bucket's call captures the ladder
        except BaseException:
            self.unbind()
            raise

    def unbind(self) -> None:
        """Drop the head's graphs (an LLM that failed to build after binding it): it may
        serve another LLM."""
        self.runner = None

    def propose_batch(self, slots: list[int], histories: list[list[int]],
                      hidden: torch.Tensor) -> list[list[int]]:
        if self.runner is None:
            raise ValueError("a HeadProposer proposes once an LLM has bound it: "
                             "LLM(model, speculative=HeadProposer(head, k, hidden_size))")
        last = torch.tensor([t[-1] for t in histories], device=self.device)
        self.steps += 1
        return self.runner(hidden.to(self.dtype), last).tolist()

    def report(self) -> dict:
        """Head steps (each one replay of its ``k`` calls) and its runner's report."""
        return {"head_steps": self.steps,
                "runner": self.runner.report() if self.runner is not None else None}


__all__ = ["HeadProposer"]
