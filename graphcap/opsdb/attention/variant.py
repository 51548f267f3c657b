"""What one attention layer computes beyond plain causal softmax attention, the same for
prefill (``graphcap::attention``), attention over a paged cache
(``graphcap::decode_attention``) and the cached op that routes between them: a
:class:`Variant` of three per-layer options, each off by default.

- ``window`` (int, 0: none): a causal sliding window; the token at position ``i`` sees the
  keys at positions ``i - window + 1 .. i`` (``window`` tokens, itself included: Mistral's,
  Gemma's and gpt-oss's ``sliding_window``).
- ``softcap`` (float, 0: none): each score (after the scale) becomes
  ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2's
  ``attn_logit_softcapping``).
- ``sinks`` (tensor ``[query heads]`` or None): a learned logit per query head that joins
  every row's softmax and carries no value, so a row's weights may sum to less than one
  (gpt-oss's attention sinks).

Backends say which options they serve (``options``); one that does not is refused by
name, with the backends that would serve it: at capture, from the options a model
declares (``graphcap_attention_options``), else at the op's call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphcap.errors import CaptureError
from graphcap.opsdb import checks

OPTIONS = ("window", "softcap", "sinks")
MEANING = {"window": "a sliding window", "softcap": "soft-capped scores",
           "sinks": "attention sinks"}


@dataclass(frozen=True)
class Variant:
    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def used(self) -> tuple[str, ...]:
        """The options this variant sets, in ``OPTIONS`` order."""
        return tuple(name for name, on in (("window", self.window > 0),
                                           ("softcap", self.softcap > 0),
                                           ("sinks", self.sinks is not None)) if on)

    def binding(self, span: int) -> Variant:
        """The same variant for requests of at most ``span`` tokens (keys at most
        ``span - 1`` positions apart): a window of ``span`` or more cannot bind and is
        dropped (it costs nothing)."""
        if 0 < span <= self.window:
            return Variant(0, self.softcap, self.sinks)
        return self


PLAIN = Variant()


def check_variant(op: str, q: torch.Tensor, window, softcap, sinks) -> Variant:
    """The variant of an op's call, checked: ``window`` an int >= 0, ``softcap`` a finite
    float >= 0, ``sinks`` None or one value per query head of ``q`` (``[T, Hq, D]`` or
    ``[B, Hq, D]``) on its device."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise checks.OpInputError(f"{op}: window must be an int >= 0 (0: no window), got "
                                  f"{window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or \
            not math.isfinite(softcap) or softcap < 0:
        raise checks.OpInputError(f"{op}: softcap must be a finite float >= 0 (0: none), "
                                  f"got {softcap!r}")
    if sinks is not None:
        checks.tensor(op, "sinks", sinks, ndim=1, dtypes=checks.FLOATS, device=q.device)
        checks.same(op, "the head count", sinks.shape[0], q.shape[1], "sinks", "q")
    return Variant(window, float(softcap), sinks)


def refuse(what: str, name: str, serves: frozenset[str], used, others: list[str],
           whose: str | None = None, error: type[Exception] = checks.OpInputError) -> None:
    """``error`` when backend ``name`` of ``what`` (serving the options in ``serves``)
    cannot run the options ``used`` (a :class:`Variant`'s ``used``, or those ``whose``
    layers declare, said before anything runs); the message names ``others``, the
    backends that would."""
    missing = [o for o in used if o not in serves]
    if missing:
        wanted = " and ".join(MEANING[o] for o in missing)
        head = (f"{whose} use {wanted} ({', '.join(map(repr, missing))}), which {what} "
                f"backend {name!r} does not compute") if whose else \
            f"{what} backend {name!r} does not compute {wanted}"
        pick = ", ".join(others) or "none is installed here"
        raise error(f"{head}; pick one that does: {pick}")


def add_sinks(out: torch.Tensor, lse2: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold learned sink logits into an attention output computed without them, in
    place: ``out`` [T, Hq, D], each row normalised over its keys; ``lse2`` [T, Hq] the
    base-2 log-sum-exp of each row's scaled scores (what FlashInfer's kernels return);
    ``sinks`` [Hq]. A sink joins a row's softmax denominator and adds no value, so with
    Z = 2^lse2 the row becomes out * Z / (Z + e^sink) = out * sigmoid(lse - sink), lse
    in nats; a row without keys (lse2 = -inf) becomes zero. Computed in float32."""
    factor = torch.sigmoid(lse2.float() * math.log(2.0) - sinks.float()[None, :])
    torch.mul(out, factor[..., None], out=out)


def refuse_first_in_capture(what: str, variant: Variant, fix: str) -> None:
    """``CaptureError`` when ``what``, a backend that fixes the window and soft cap when it
    plans (outside graphs), meets ``variant``'s pair for the first time inside a capture;
    ``fix`` says what to do instead."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(
            f"{what} met a layer with window {variant.window} and softcap "
            f"{variant.softcap:g} first inside a capture: its kernels are planned per "
            f"(window, softcap) outside graphs. {fix}")


__all__ = ["MEANING", "OPTIONS", "PLAIN", "Variant", "add_sinks", "check_variant", "refuse",
           "refuse_first_in_capture"]
