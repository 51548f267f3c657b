"""The arms of a prefill benchmark: one model, run eagerly, under each graphcap strategy,
and under torch.compile as peers. Every arm runs the same model with the same kernels and
returns the same thing (each request's last-token logits), so their times compare.

    arms = build_arms(model, ["eager", "full-triton"], lengths=[16, 64], max_requests=1)
    arms["full-triton"].call(64)          # one prefill of a 64-token prompt
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import graphcap
from graphcap.api import backend_for
from graphcap.core.context import forward_context
from graphcap.errors import GraphcapError
from graphcap.opsdb.attention import BACKENDS, get_backend

GRAPHCAP_ARMS = ("eager", "tc_piecewise-eager", "tc_piecewise-inductor", "breakable",
                 "full-triton", "full-flashinfer", "full-flash_attn")
PEER_ARMS = ("compile-default", "compile-reduce-overhead")
ARMS = GRAPHCAP_ARMS + PEER_ARMS


@dataclass
class Arm:
    name: str
    call: Callable[[int], torch.Tensor]  # prompt length -> logits of the last token
    build_s: float = 0.0  # wall seconds from nothing to every length ready
    detail: dict = field(default_factory=dict)  # compile/capture seconds, pool bytes, ...
    runner: object = None


def prompts(lengths, vocab: int, device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One request per length: random token ids and positions 0..n-1."""
    gen = torch.Generator().manual_seed(0)
    return {n: (torch.randint(1, vocab, (n,), generator=gen).to(device),
                torch.arange(n, device=device)) for n in lengths}


def default_attention(device, model: torch.nn.Module | None = None) -> str:
    """The attention backend shared by the arms that do not name one: the best one full
    capture can use here (for ``model``: in its dtype, computing its layers' variant
    options)."""
    if model is None:
        return get_backend(None, device, strategy="full").name
    return backend_for(model, None, device, strategy="full").name


def unavailable(name: str, device) -> str | None:
    """Why arm ``name`` cannot run here, or None."""
    if name not in ARMS:
        raise ValueError(f"no benchmark arm {name!r}; choose from {', '.join(ARMS)}")
    if name.startswith("full-"):
        return BACKENDS[name.removeprefix("full-")]().unavailable(device, interpreted=False)
    return None


def _graphcap_arm(name, model, lengths, max_requests, attention, inputs) -> Arm:
    strategy, _, variant = name.partition("-")
    # No eager fallback: a call that did not replay raises, never timed as the arm's.
    kwargs = {"buckets": sorted(lengths), "max_requests": max_requests, "fallback": False}
    if strategy == "full":
        kwargs["attention"] = variant
    else:
        kwargs["attention"] = attention
    if strategy == "tc_piecewise":
        kwargs["compiler"] = variant
    start = time.perf_counter()
    runner = graphcap.capture(model, strategy, **kwargs)
    build = time.perf_counter() - start
    report = runner.report()

    def call(n):
        ids, pos = inputs[n]
        return runner(ids, pos, seq_lens=[n])

    detail = {"attention": kwargs["attention"], "graph_pool_bytes": report["graph_pool_bytes"],
              "compile_and_warmup_s": report["build_s"]["warmup"],
              "capture_s": report["build_s"]["capture"]}
    return Arm(name, call, build, detail, runner)


def _peer_arm(name, model, lengths, attention, inputs) -> Arm:
    """torch.compile on the same model: metadata for each length is prepared once, ahead,
    as a static-shape engine would (the peers are not charged for it)."""
    mode = None if name == "compile-default" else "reduce-overhead"
    device = next(model.parameters()).device
    backend = get_backend(attention, device, strategy="full")
    metas = {n: backend.metadata(n, 1, device).update([n]) for n in lengths}
    rows = {n: metas[n].last_token_rows() for n in lengths}
    # The token dim dynamic, as tc_piecewise compiles it (dynamic=True would also turn
    # the model's float attributes into tensors read with .item() in the graph).
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    for ids, pos in inputs.values():
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)

    def call(n):
        ids, pos = inputs[n]
        with torch.inference_mode(), forward_context(attention=metas[n]):
            return compiled(ids, pos, rows[n])

    start = time.perf_counter()
    for n in sorted(lengths, reverse=True):
        for _ in range(3):  # reduce-overhead records its graph on a later call
            call(n)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Arm(name, call, time.perf_counter() - start,
               {"attention": backend.name, "mode": mode or "default",
                "dynamic": "token dim (mark_dynamic)"})


def build_arms(model: torch.nn.Module, names, lengths, max_requests: int = 1,
               attention: str | None = None, on_arm=None) -> tuple[dict[str, Arm], dict]:
    """Build each arm that can run here. Returns the arms and, for the others, why not.
    ``model`` must return last-token logits (``build_model(..., logits="last")``)."""
    device = next(model.parameters()).device
    vocab = model.args.vocab_size if hasattr(model, "args") else 32000
    inputs = prompts(lengths, vocab, device)
    attention = attention or default_attention(device, model)
    arms, skipped = {}, {}
    for name in names:
        why = unavailable(name, device)
        if why:
            skipped[name] = why
            continue
        try:
            if name in PEER_ARMS:
                arms[name] = _peer_arm(name, model, lengths, attention, inputs)
            else:
                arms[name] = _graphcap_arm(name, model, lengths, max_requests, attention,
                                           inputs)
        except (GraphcapError, RuntimeError) as exc:  # recorded, not hidden
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if on_arm is not None:
            on_arm(name)
    return arms, skipped
