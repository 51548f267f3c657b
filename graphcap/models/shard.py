"""A reference decoder split Megatron-style across the ranks of a
:class:`graphcap.tp.TPGroup` (the layer shapes of a share: :func:`shard_args`).

- q/k/v by whole heads (``heads / tp`` query and ``kv_heads / tp`` key/value heads a
  rank), so attention and the K/V cache stay local;
- gate/up by columns of the intermediate (gate and up alike), MoE experts likewise;
  the router is replicated;
- o and down by rows of their input: partial sums, one all-reduce each (the experts'
  down bias is rank 0's, zeros elsewhere; o's bias is added after the all-reduce);
- the LM head by rows of the vocabulary, its logits gathered; embedding and norms
  replicated.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from graphcap.errors import RankError, UnsupportedModel
from graphcap.models.decoder import Decoder, shard_args


def shard_tensor(t: torch.Tensor, dim: int, parts: list[int], rank: int,
                 size: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``t`` whose ``dim`` is the concatenation of ``parts``
    (q, k and v rows; gate and up columns): the rank's ``1/size`` of each part, in
    order, as a new contiguous tensor (the whole one can be freed). A part ``size`` does
    not divide is refused (``ValueError``), not cut."""
    if sum(parts) != t.shape[dim]:
        raise ValueError(f"parts {parts} do not add up to dim {dim} of shape "
                         f"{tuple(t.shape)}")
    for i, n in enumerate(parts):
        if n % size:
            raise ValueError(f"part {i} of {parts} ({n} along dim {dim}) does not divide "
                             f"into {size} equal shares")
    pieces = []
    for part in t.split(parts, dim=dim):
        step = part.shape[dim] // size
        pieces.append(part.narrow(dim, rank * step, step))
    return torch.cat(pieces, dim=dim).contiguous()


def _layouts(a) -> dict[str, tuple[int, list[int]]]:
    """Parameter name suffix -> (dim, parts) of the split ones; the rest is replicated."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    out = {"attn.qkv.weight": (0, [q, kv, kv]), "attn.qkv.bias": (0, [q, kv, kv]),
           "attn.o.weight": (1, [q]), "attn.sinks": (0, [a.heads])}
    if a.moe_mxfp4:  # one rank only (shard_args): its packed experts kept whole
        return out
    if a.experts:
        out.update({"mlp.w13": (1, [a.moe_intermediate] * 2), "mlp.w2": (2, [a.moe_intermediate]),
                    "mlp.b13": (1, [a.moe_intermediate] * 2)})
    else:
        out.update({"mlp.gate_up.weight": (0, [a.intermediate] * 2),
                    "mlp.down.weight": (1, [a.intermediate])})
    return out


def shard_model(model, tp):
    """This rank's share of the reference decoder ``model`` (a ``Decoder`` built whole,
    on any device) across ``tp``: a new ``Decoder`` whose split weights are copies of
    the rank's slices and whose replicated ones are ``model``'s own tensors; drop
    ``model`` to free the rest. The ranks agree first that they split the same whole
    model (a fingerprint of its weights), else ``RankError`` on every rank."""
    return shard_whole(model, tp, "shard_model")


def shard_whole(model, tp, origin: str, finish=None):
    """:func:`shard_model`; ``origin``, how every rank made the whole model
    (``build_model``: its preset, seed and dtype), is part of what the ranks agree on;
    ``finish(share)``, the share as the caller leaves it (moved to its device), is made
    before the agreement too."""
    with refused_together(tp):
        if not isinstance(model, Decoder) or model.tp is not None:
            raise UnsupportedModel(
                f"shard_model splits a whole graphcap reference decoder (build_model or "
                f"load_checkpoint without tp=), not a {type(model).__name__}"
                + (" split already" if isinstance(model, Decoder) else ""))
        a = model.args
        shard_args(a, tp.size)  # refuse a size that does not divide the model first
        logits = "all" if model.output_rows == "tokens" else "last"
        # The config too: the same weights with another rotary base, window or routing on
        # some rank would split without a word, each share computing another model.
        config = hashlib.sha256(repr(a).encode()).hexdigest()[:8]
        key = f"{origin}: logits {logits}, weights {fingerprint(model)[:16]}, config {config}"
        # The share too, before the agreement: a rank failing to make it (out of memory)
        # says so there, where the others would go on alone with theirs.
        split = _share(model, a, logits, tp)
        split = split if finish is None else finish(split)
    tp.meet(_MEETING, "the meeting before a split")  # one may load slower
    tp.agree(key, _WHOLE, _SAME_MODEL)
    return split


def _share(model, a, logits: str, tp):
    """This rank's share of the whole ``model`` (its ``ModelArgs`` ``a``)."""
    with torch.device("meta"):
        split = Decoder(a, logits=logits, tp=tp)
    layouts = _layouts(a)
    state = {}
    for name, tensor in model.state_dict().items():  # detached, the model's own memory
        suffix = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        if name == "lm_head.weight":
            tensor = shard_tensor(tensor, 0, [a.vocab_size], tp.rank, tp.size)
        elif suffix in layouts:
            dim, parts = layouts[suffix]
            tensor = shard_tensor(tensor, dim, parts, tp.rank, tp.size)
        elif suffix == "mlp.b2" and tp.rank:  # added once: after the all-reduce, rank 0's
            tensor = torch.zeros_like(tensor)
        state[name] = tensor
    split.load_state_dict(state, strict=True, assign=True)
    split.cos_sin = model.cos_sin
    return split.eval()


@contextlib.contextmanager
def refused_together(tp):
    """What a rank does before its split (its build or load of the whole model, the
    split's checks): where it raises, it meets the other ranks of ``tp`` (who may still
    be loading) and says so at their agreement on the whole model, so every rank raises
    (``RankError`` where the others did not refuse alike), instead of the others waiting
    at the split's meeting until ``collective_timeout_s`` closes the group. Without
    ``tp``: the block alone."""
    if tp is None:
        yield
        return
    try:
        yield
    except RankError:  # the group's own: its agreement failed, or it is closed
        raise
    except Exception as exc:
        tp.meet(_MEETING, "the meeting before a split")
        tp.agree(f"refused ({type(exc).__name__}: {exc})", _WHOLE, _SAME_MODEL)
        raise


_MEETING, _WHOLE = "the split of a model", "the whole model each rank splits"
_SAME_MODEL = ("every rank must split the same whole model, built with the same preset, "
               "seed and dtype (build_model) or loaded from the same checkpoint, with the "
               "same config (its ModelArgs): a share of another model on each rank gives "
               "the logits of no model")
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(model: torch.nn.Module) -> str:
    """A digest of every tensor of ``model``'s state: its name, dtype, shape and bits. On
    the host each tensor's bits are hashed (no copy; tensors side by side, on every core:
    hashlib lets go of the GIL); elsewhere two integer sums of them (all, every third)
    are taken where they are, and only those go to the host. A meta tensor: its name,
    dtype and shape."""
    digest, host, sums = hashlib.sha256(), [], {}
    for name, t in model.state_dict().items():
        digest.update(f"{name} {t.dtype} {tuple(t.shape)} {t.device.type};".encode())
        if t.is_meta or not t.numel():
            continue
        flat = t.detach().contiguous().reshape(-1)
        if t.device.type == "cpu":
            host.append(flat.view(torch.uint8).numpy())
            continue
        flat = flat.view(_INTS.get(flat.element_size(), torch.uint8))
        sums.setdefault(t.device, []).append(
            torch.stack([flat.sum(dtype=torch.int64), flat[::3].sum(dtype=torch.int64)]))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for part in pool.map(lambda b: hashlib.sha256(b).digest(), host):
            digest.update(part)
    for device in sorted(sums, key=str):
        digest.update(torch.stack(sums[device]).cpu().numpy().tobytes())
    return digest.hexdigest()
