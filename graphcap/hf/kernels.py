"""opsdb's kernels in a stock transformers model, without editing its code.

:func:`substitute` walks a causal LM and, where it recognises the pattern
(:mod:`graphcap.hf.patterns`) and the probe agrees (:mod:`graphcap.hf.probe`), replaces
forwards on the model's own module instances (never its classes):

- each pre-norm decoder layer, ``h + self_attn(input_layernorm(h))`` then ``h +
  mlp(post_attention_layernorm(h))``, runs its attention half and its MLP half on
  graphcap's blocks (:mod:`graphcap.models.blocks`), each half apart: a half that is not
  recognised runs its stock modules;
- every other RMSNorm runs ``graphcap::rms_norm``; an ``nn.Embedding`` gathers rows.

Weights stay the model's: q/k/v and gate/up are fused once into one tensor each and the
modules' parameters become views of it (:mod:`graphcap.hf.fuse`). What runs where is in
:attr:`Substitution.parts` (``PrefillLM.kernels``); :func:`restore` puts the stock
forwards back.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from graphcap.core.graphs import capturing
from graphcap.errors import CaptureError, UnsupportedModel
from graphcap.hf import attention as hf_attention
from graphcap.hf import patterns, probe
from graphcap.hf.attention import NAME, attention_options, outside_graphcap, unwrapped_call
from graphcap.hf.patterns import structure
from graphcap.hf.rotary import rotary_cache
from graphcap.opsdb.attention.packed import packed
from graphcap.opsdb.norm import RMS_NORM

log = logging.getLogger("graphcap")

_MARK = "_graphcap_kernels"  # the instance attribute that holds a module's kernels
_RAN: list | None = None  # layers whose graphcap path ran, while the model probe runs
_CACHES = ("past_key_values", "cache", "past_key_value")  # its name across versions


@dataclass
class LayerKernels:
    """A decoder layer's two halves: graphcap kernels, or its stock modules (None)."""

    attention: patterns.AttentionKernels | None
    mlp: patterns.SwigluKernels | patterns.MoeKernels | None
    config: object = None  # the model's: its attention implementation, read per call

    def stock(self, layer, hidden_states, args, positions) -> bool:
        """Whether this call runs the layer as written: another attention implementation
        (``set_attn_implementation("sdpa")``), training, gradients to compute (the kernels
        read the fused weights detached), a call the kernels do not take, or a probe of
        what the attention function receives (``attention.SEEN``)."""
        return bool(args or layer.training or hidden_states.dim() != 3
                    or hf_attention.SEEN is not None
                    or hidden_states.shape[0] != 1
                    or (self.attention is not None and positions is None)
                    or getattr(self.config, "_attn_implementation", NAME) != NAME
                    or (torch.is_grad_enabled()
                        and any(p.requires_grad for p in layer.parameters())))

    def forward(self, layer, hidden_states, args, kwargs):
        positions = kwargs.get("position_ids")
        if self.stock(layer, hidden_states, args, positions):
            return type(layer).forward(layer, hidden_states, *args, **kwargs)  # as written
        if outside_graphcap():  # the model's own forward or generate(), not graphcap's
            raise unwrapped_call(type(layer).__name__)
        if kwargs.get("attention_mask") is not None:
            raise UnsupportedModel(
                f"{type(layer).__name__}: graphcap kernels got an attention mask; request "
                "boundaries come from seq_lens (the forward context), so call the model "
                "without attention_mask")
        if any(kwargs.get(name) is not None for name in _CACHES):
            raise UnsupportedModel(
                f"{type(layer).__name__}: graphcap kernels got a transformers KV cache, and "
                "keep none (graphcap's paged cache is read from the forward context); call "
                "the model with use_cache=False")
        if _RAN is not None:
            _RAN.append(layer)
        h = hidden_states[0]
        h = self.attention(h, positions.reshape(-1)) if self.attention is not None \
            else patterns.stock_attention(layer, h, kwargs)
        h = self.mlp(h) if self.mlp is not None else patterns.stock_mlp(layer, h)
        return h[None]

    def fused(self):
        return [f for half in (self.attention, self.mlp) if half is not None
                for f in half.fused()]


def _layer_forward(self, hidden_states, *args, **kwargs):
    return getattr(self, _MARK).forward(self, hidden_states, args, kwargs)


def _norm_forward(self, x):
    eps = getattr(self, _MARK)
    if x.dtype != self.weight.dtype or x.shape[-1] != self.weight.shape[0] or (
            torch.is_grad_enabled() and self.weight.requires_grad):
        return type(self).forward(self, x)
    return RMS_NORM(x.reshape(-1, x.shape[-1]), self.weight, eps).view(x.shape)


def _embedding_forward(self, ids):
    return self.weight[ids]  # a gather: F.embedding's index_select is slower for few rows


@dataclass
class Part:
    """One module of the model: ``kind`` (attention, mlp, norm, embedding), whether it
    runs graphcap's kernels or its stock code, and which ops, or why."""

    module: str
    kind: str
    graphcap: bool
    what: str  # the ops, or why the module stays stock

    def __str__(self) -> str:
        return f"{self.module}: {'graphcap' if self.graphcap else 'stock'} ({self.what})"


@dataclass
class Substitution:
    model: nn.Module
    dtype: torch.dtype | None = None  # None: the stock kernels everywhere
    parts: list[Part] = field(default_factory=list)
    layers: list[tuple[nn.Module, LayerKernels]] = field(default_factory=list)
    structure: tuple = ()  # the modules (and rotary buffer) recognition read

    @property
    def kernels(self) -> str:
        return "stock" if self.dtype is None else "graphcap"

    def summary(self) -> str:
        """One line: of each kind of module, how many run graphcap's kernels."""
        counts: dict[str, list[int]] = {}
        for p in self.parts:
            c = counts.setdefault(p.kind, [0, 0])
            c[0] += p.graphcap
            c[1] += 1
        if not counts:
            return "no module on graphcap kernels"
        return "graphcap kernels in " + ", ".join(f"{g}/{n} {k}" for k, (g, n) in
                                                  counts.items())

    def table(self) -> dict[str, str]:
        """Module name -> ``"graphcap: <ops>"`` or ``"stock: <why>"``."""
        return {p.module: f"{'graphcap' if p.graphcap else 'stock'}: {p.what}"
                for p in self.parts}

    def ensure(self) -> None:
        """The kernels current with the model: a submodule replaced since (a new
        ``nn.Linear``, an adapter's subclass, another rotary embedding) makes the model
        recognised and probed again; a fused slot assigned anew or moved (``model.to``,
        ``load_state_dict(assign=True)``) is fused again. Host work only when nothing
        changed; refused inside a capture (a runner calls it before capturing)."""
        if self.dtype is None:
            return
        if self.structure != structure(self.model):
            self._outside_capture("its modules were replaced")
            # In the model's dtype now (a cast since?): its probes pick a backend for it.
            fresh = substitute(self.model, self.model.get_output_embeddings().weight.dtype)
            self.parts, self.layers, self.structure, self.dtype = fresh.parts, \
                fresh.layers, fresh.structure, fresh.dtype
            log.info("graphcap.hf: modules of %s were replaced: recognised again (%s)",
                     type(self.model).__name__, self.summary())
            return
        stale = [f for _, lk in self.layers for f in lk.fused() if not f.intact()]
        if not stale:
            return
        self._outside_capture("its q/k/v or gate/up weights were replaced")
        for f in stale:
            f.rebuild()
        log.info("graphcap.hf: fused %d weight groups again (their tensors were replaced)",
                 len(stale))

    def _outside_capture(self, what: str) -> None:
        if capturing():
            raise CaptureError(
                f"graphcap.hf: {type(self.model).__name__} changed during a capture ({what});"
                " change a model before capturing it, or call runner.recapture() after")


def _patch(module: nn.Module, forward, state) -> None:
    setattr(module, _MARK, state)
    # A partial, not a bound method: a bound method pickles as a lookup of its function's
    # name on the module, which has none, so a saved model would not load.
    module.forward = functools.partial(forward, module)


def _ours(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return _MARK in module.__dict__ and isinstance(forward, functools.partial) and \
        forward.func in (_layer_forward, _norm_forward, _embedding_forward)


def _foreign_forward(module: nn.Module) -> str | None:
    """Why ``module`` is left alone: a forward set on the instance by someone else."""
    if "forward" in module.__dict__ and not _ours(module):
        return "its forward is replaced on the instance (another library's hook, such as " \
               "accelerate's offloading): left as it is"
    return None


def _shared(layer: nn.Module, modules: Counter, params: Counter) -> str | None:
    """Why ``layer`` cannot be fused on its own: a module or weight it shares with another
    part of the model (fusing would untie it)."""
    for name, m in layer.named_modules(remove_duplicate=False):
        if modules[id(m)] > 1:
            return f"{name or 'the layer'} is shared with another part of the model"
    for name, p in layer.named_parameters(remove_duplicate=False):
        if params[id(p)] > 1:
            return f"{name} is tied to another parameter of the model"
    return None


def _unpatch(module: nn.Module) -> None:
    if _ours(module):
        module.__dict__.pop("forward", None)
    elif _MARK in module.__dict__:
        log.warning("graphcap.hf: %s's forward was replaced after graphcap's; it is left "
                    "in place", type(module).__name__)
        return
    module.__dict__.pop(_MARK, None)


def restore(model: nn.Module) -> None:
    """Every module of ``model`` back on its stock forward (fused weights stay views)."""
    for module in model.modules():
        if _MARK in module.__dict__:
            _unpatch(module)


def _probe_kwargs(model, h, pos):
    rotary = model.get_decoder().rotary_emb
    return {"attention_mask": None, "position_ids": pos[None],
            "position_embeddings": rotary(h[None], pos[None])}


def _layer(model, name: str, layer, hidden: int, cos_sin, sub: Substitution, shared):
    """Recognise and probe one decoder layer; patch it if any half runs graphcap's."""
    h = probe.hidden(hidden, next(layer.parameters()), seed=2)
    pos = probe.positions(probe.span(model.config), h.device, seed=3)
    kw = None
    if not (why := _foreign_forward(layer) or _shared(layer, *shared)
            or patterns.pre_norm_layer(layer)):
        try:
            kw = _probe_kwargs(model, h, pos)
        except (TypeError, ValueError, RuntimeError) as exc:  # a rotary of its own call
            why = f"its rotary embedding is called otherwise ({type(exc).__name__}: {exc})"
    if kw is None:
        for half, kind in (("self_attn", "attention"), ("mlp", "mlp")):
            sub.parts.append(Part(f"{name}.{half}", kind, False, why))
        return
    attention, attention_why = patterns.recognise_attention(layer, hidden, cos_sin)
    mlp, mlp_why = patterns.recognise_mlp(layer, hidden)
    if why := patterns.skipped_calls(layer, "attention"):
        attention, attention_why = None, why
    if why := patterns.skipped_calls(layer, "mlp"):
        mlp, mlp_why = None, why
    stock = LayerKernels(None, None)
    small = h * probe.BRANCH  # the halves' branches, not the residual, dominate
    # On h and, by its branches, on small: in half precision the residual hides a layer
    # that scales its branches (Granite's residual_multiplier) within the tolerance.
    if why := probe.mismatch(stock.forward(layer, h[None], (), kw),
                             type(layer).forward(layer, h[None], **kw), "the layer") or \
            probe.branch(stock.forward(layer, small[None], (), kw)[0],
                         type(layer).forward(layer, small[None], **kw)[0], small,
                         "the layer's branches"):
        why = "not the pre-norm layer h + self_attn(input_layernorm(h)), h + " \
              f"mlp(post_attention_layernorm(h)) ({why})"
        attention_why, mlp_why, attention, mlp = why, why, None, None
    if attention is not None:
        attention_why = probe.attention(layer, attention, small, pos, kw)
    if mlp is not None:
        mlp_why = probe.moe(layer, mlp, h) if isinstance(mlp, patterns.MoeKernels) else \
            probe.branch(mlp(small), patterns.stock_mlp(layer, small), small, "the MLP half")
    lk = LayerKernels(None if attention_why else attention, None if mlp_why else mlp,
                      model.config)
    for half, kind, kernels, why in (("self_attn", "attention", attention, attention_why),
                                     ("mlp", "mlp", mlp, mlp_why)):
        sub.parts.append(Part(f"{name}.{half}", kind, not why, why or kernels.ops))
    if lk.attention is not None or lk.mlp is not None:
        _patch(layer, _layer_forward, lk)
        sub.layers.append((layer, lk))


def _modules(model, sub: Substitution, skip: set[int]) -> None:
    """RMSNorms outside substituted halves, and embeddings."""
    for name, module in model.named_modules():
        if id(module) in skip or _MARK in module.__dict__:
            continue
        norm = "RMSNorm" in type(module).__name__
        if (norm or type(module) is nn.Embedding) and (why := _foreign_forward(module)):
            sub.parts.append(Part(name, "norm" if norm else "embedding", False, why))
            continue
        if type(module) is nn.Embedding and module.max_norm is None:
            _patch(module, _embedding_forward, True)
            sub.parts.append(Part(name, "embedding", True, "a gather of rows"))
        elif norm and isinstance(module._parameters.get("weight"), torch.Tensor):
            eps, why = patterns.rms_norm_of(module, module.weight.shape[0])
            why = why or probe.norm(module, eps)
            if why:
                sub.parts.append(Part(name, "norm", False, why))
                continue
            _patch(module, _norm_forward, eps)
            sub.parts.append(Part(name, "norm", True, "rms_norm"))


def substitute(model: nn.Module, dtype: torch.dtype) -> Substitution:
    """Put graphcap's kernels where they fit (the model in eval mode, on its device, its
    attention switched to graphcap's); a part that does not fit says why. Last, the whole
    model is probed: every patched layer must take its graphcap path, and in float32 the
    logits must be the stock model's; if not, every module goes back to stock."""
    restore(model)
    sub = Substitution(model, dtype)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    hidden = getattr(model.config, "hidden_size", None)
    names = {id(m): n for n, m in model.named_modules()}
    device = next(model.parameters()).device
    skip: set[int] = set()
    shared = (Counter(id(m) for _, m in model.named_modules(remove_duplicate=False)),
              Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False)))
    # On a backend computing the model's options, as its calls pick one (the best one for
    # none may lack them: FlashAttention 2/3 has no sinks).
    with torch.inference_mode(), packed([probe.TOKENS], device, dtype=dtype,
                                        options=attention_options(model)):
        ids = torch.randint(0, model.get_output_embeddings().weight.shape[0],
                            (1, probe.TOKENS), generator=torch.Generator().manual_seed(4)
                            ).to(device)
        pos = probe.spread(probe.span(model.config), probe.TOKENS, device)[None]
        want = _logits(model, ids, pos)
        if isinstance(layers, nn.ModuleList) and isinstance(hidden, int):
            cos_sin = rotary_cache(model)
            for layer in layers:
                _layer(model, names[id(layer)], layer, hidden, cos_sin, sub, shared)
            for layer, lk in sub.layers:  # norms inside substituted halves never run
                if lk.attention is not None:
                    skip.update(map(id, (layer.input_layernorm,
                                         *[getattr(layer.self_attn, n) for n in
                                           ("q_norm", "k_norm")
                                           if hasattr(layer.self_attn, n)])))
                if lk.mlp is not None:
                    skip.add(id(layer.post_attention_layernorm))
        _modules(model, sub, skip)
        why = _check_model(model, sub, ids, pos, want)
    if why:
        restore(model)
        log.warning("graphcap.hf: %s runs its stock kernels: %s", type(model).__name__, why)
        sub.parts = [Part(p.module, p.kind, False, why) for p in sub.parts]
        sub.layers = []
    sub.structure = structure(model)
    return sub


def _logits(model, ids, pos):
    return model(input_ids=ids, position_ids=pos, **probe.call_options(model)).logits


def _check_model(model, sub: Substitution, ids, pos, want) -> str | None:
    global _RAN
    _RAN = []
    try:
        got = _logits(model, ids, pos)
        ran = set(map(id, _RAN))
    finally:
        _RAN = None
    if any(id(layer) not in ran for layer, _ in sub.layers):
        return "the model did not call its decoder layers with position_ids"
    if want.dtype in (torch.float32, torch.float64):
        return probe.mismatch(got, want, "the model's logits")
    if not torch.isfinite(got).all():
        return "the model's logits on graphcap kernels are not finite"
    return None
