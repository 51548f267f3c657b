"""``PrefillLM``: a stock transformers causal LM as a graphcap prefill model."""

from __future__ import annotations

import inspect
import logging
import weakref

import torch
from torch import nn
from transformers import PreTrainedModel

from graphcap.core import checks
from graphcap.errors import BadBatch
from graphcap.hf import attention as hf_attention
from graphcap.hf import changes, probe, rotary
from graphcap.hf import kernels as substitution
from graphcap.hf.attention import NAME, UnsupportedModel, attention_options, window_refusal
from graphcap.kv import longest_window
from graphcap.opsdb.attention.packed import packed

# Expert implementations of transformers' MoE layers that read no tensor on the host
# ("eager" loops over the experts hit, found with nonzero: a host sync).
CAPTURABLE_EXPERTS = ("grouped_mm", "batched_mm")
KERNELS = ("graphcap", "stock")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUBSTITUTION = "_graphcap_substitution"  # on the wrapped model: its Substitution
_CAME_AS = "_graphcap_came_as"  # and how it came to its first wrapper
_WRAPPERS = weakref.WeakKeyDictionary()  # model -> its live wrappers (kept off the model)
log = logging.getLogger("graphcap")


def _check_causal_lm(model) -> None:
    kind = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModel(
            f"{kind} is not a transformers PreTrainedModel; graphcap.hf.PrefillLM wraps "
            "a causal LM such as AutoModelForCausalLM.from_config(...) or "
            ".from_pretrained(...). Capture other modules with graphcap.capture directly")
    if getattr(model.config, "is_encoder_decoder", False) or model.get_output_embeddings() \
            is None:
        raise UnsupportedModel(
            f"{kind} is not a decoder-only causal LM (it has no LM head, or it is an "
            "encoder-decoder); load the model with AutoModelForCausalLM")


def _check_attention_features(model) -> None:
    """Refuse what graphcap::attention cannot express, before anything is switched."""
    kind, config = type(model).__name__, model.config
    if not getattr(config, "is_causal", True):
        raise UnsupportedModel(f"{kind}: config.is_causal=False (bidirectional); "
                               "graphcap prefill attention is causal")
    if getattr(config, "alibi", False) is True:
        raise UnsupportedModel(
            f"{kind}: ALiBi (config.alibi=True) adds a bias per head and distance to the "
            "attention scores, through the mask graphcap does not build; graphcap::attention "
            "takes no bias: run it with transformers' own attention (no PrefillLM)")
    if why := hf_attention.position_scaled_queries(model):
        raise UnsupportedModel(why)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if "chunked_attention" in kinds:
        raise UnsupportedModel(
            f"{kind} has chunked_attention layers (config.layer_types), which attend within "
            "fixed chunks of attention_chunk_size tokens: graphcap::attention runs full "
            "causal attention and sliding windows, not chunks: "
            f"{window_refusal(config)}")
    if other := sorted(kinds - {"full_attention", "sliding_attention"}):
        raise UnsupportedModel(
            f"{kind} has layers of type {', '.join(other)} (config.layer_types): neither "
            "full causal attention nor a sliding window, which is what graphcap::attention "
            "runs; they are the model's architecture, which no config field turns off: run "
            "it with transformers' own attention (no PrefillLM) or use another model")
    if why := rotary.refusal(config, kind, model):
        raise UnsupportedModel(why)


def _check_dtype(model) -> torch.dtype:
    """The model's dtype (its LM head's), refused unless one graphcap.hf runs."""
    dtype = model.get_output_embeddings().weight.dtype
    if dtype not in DTYPES:
        raise UnsupportedModel(
            f"{type(model).__name__} is in {str(dtype).removeprefix('torch.')}; "
            "graphcap.hf runs float32, float16 and bfloat16 models: convert it first "
            "(hf_model.to(torch.float32))")
    return dtype


def _own_attention(model: PreTrainedModel) -> list[str]:
    """The model's attention module classes whose ``forward`` never looks up
    transformers' attention functions (``ALL_ATTENTION_FUNCTIONS``): they compute
    attention themselves, whatever the config says. Read from the compiled code, so no
    source file or cached guess decides it."""
    own = set()
    for module in model.modules():
        cls = type(module)
        forward = getattr(cls, "forward", None)
        if "Attention" not in cls.__name__ or forward is None or \
                not cls.__module__.startswith("transformers.models."):
            continue
        code = getattr(inspect.unwrap(forward), "__code__", None)
        if code is not None and "ALL_ATTENTION_FUNCTIONS" not in _names(code):
            own.add(cls.__name__)
    return sorted(own)


def _names(code) -> set[str]:
    """Global and attribute names a code object and the functions inside it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _switch_attention(model: PreTrainedModel) -> None:
    kind = type(model).__name__
    if own := _own_attention(model):
        raise UnsupportedModel(
            f"{kind} cannot switch its attention implementation: its attention modules "
            f"({', '.join(own)}) do not call transformers' AttentionInterface, so graphcap "
            "attention cannot be plugged in")
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError) as exc:
        raise UnsupportedModel(
            f"{kind} refused attn_implementation={NAME!r}: {exc}") from exc
    # transformers only logs a warning for models whose attention does not go through
    # its AttentionInterface; such a model would silently keep its own attention.
    if model.config._attn_implementation != NAME:
        raise UnsupportedModel(
            f"{kind} cannot switch its attention implementation (it is "
            f"{model.config._attn_implementation!r}): its attention modules do not call "
            "transformers' AttentionInterface, so graphcap attention cannot be plugged in")
    hf_attention.skip_padding_check(model)  # it never gets a mask


def _experts_for(model: PreTrainedModel, experts: str | None) -> str | None:
    """The capturable experts implementation to use, or None for a dense model."""
    if experts is not None and experts not in CAPTURABLE_EXPERTS:
        why = ("the eager experts loop finds the experts hit with nonzero, a host sync"
               if experts == "eager" else "no experts implementation of that name")
        raise UnsupportedModel(f"experts={experts!r} cannot be captured ({why}); choose "
                               f"one of {CAPTURABLE_EXPERTS}")
    if not any(hasattr(m, "experts") for m in model.modules()):
        return None
    if experts is None:  # grouped_mm falls back to a host loop off CUDA bf16 when compiled
        p = next(model.parameters())
        cuda_bf16 = p.device.type == "cuda" and p.dtype == torch.bfloat16
        experts = "grouped_mm" if cuda_bf16 else "batched_mm"
    return experts


def _give_back(model: nn.Module, came_as: tuple) -> nn.Module:
    """``model`` as it came (``came_as``: attention and experts implementations, each
    module's train mode): its own forwards, graphcap's attention and experts switched back."""
    substitution.restore(model)
    rotary.unpatch(model)
    hf_attention.skip_padding_check(model, skip=False)
    model.__dict__.pop(_SUBSTITUTION, None)
    model.__dict__.pop(_CAME_AS, None)
    _WRAPPERS.pop(model, None)
    attention, experts, training = came_as
    if attention is not None and model.config._attn_implementation != attention:
        model.set_attn_implementation(attention)
    if experts is not None and getattr(model.config, "_experts_implementation",
                                       None) != experts:
        model.set_experts_implementation(experts)
    modes = dict(training)  # by name; a module put in since takes the model's
    for name, module in model.train(modes[""]).named_modules():
        module.training = modes.get(name, module.training)
    return model


class PrefillLM(nn.Module):
    """A transformers causal LM as a graphcap prefill model: ``forward(input_ids[T],
    positions[T]) -> logits[T, vocab]`` over requests packed along dim 0.

    Construction switches the wrapped model to ``attn_implementation="graphcap"`` (and MoE
    experts to a capturable implementation, ``experts`` or by device: ``grouped_mm`` on
    CUDA bf16, else ``batched_mm``) and puts it, and the wrapper, in eval mode; the model's
    code and weights are untouched and shared, so the same ``hf_model`` now needs
    graphcap's forward context (``hf_model.set_attn_implementation("sdpa")`` switches it
    back).
    ``positions`` are per request (0..len-1) and drive the model's rotary embedding; no KV
    cache is kept. Called eagerly, give ``seq_lens=[...]``; through a runner, the runner
    prepares the metadata. Put the model on its device and dtype before wrapping it (the
    experts default depends on them).

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        runner = graphcap.capture(PrefillLM(hf), "full", max_tokens=2048, max_requests=8)
        logits = runner(input_ids, positions, seq_lens=[700, 300])
    """

    def __init__(self, hf_model: nn.Module, *, experts: str | None = None,
                 logits: str = "all", kernels: str = "graphcap"):
        super().__init__()
        if logits not in ("all", "last"):
            raise ValueError(f"logits={logits!r}: choose 'all' (every token) or 'last' (each "
                             "request's last token, as prefill that feeds generation needs)")
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r}: choose 'graphcap' (opsdb's kernels where "
                             "the model's modules fit them) or 'stock' (the model's own code)")
        self.output_rows = "tokens" if logits == "all" else "requests"
        _check_causal_lm(hf_model)
        _check_attention_features(hf_model)
        dtype = _check_dtype(hf_model)
        experts = _experts_for(hf_model, experts)  # checked before anything is switched
        # A causal LM whose forward takes no logits_to_keep (Whisper's) gives every row.
        self._keeps_rows = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
        self.hf_model = hf_model
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        # What its attention layers compute beyond causal attention (a backend must too).
        self.graphcap_attention_options = attention_options(hf_model)
        self._taken = changes.taken(hf_model)  # the cache's window, the vocabulary
        # What release() gives back: attention, experts, train mode, as at the first wrapper
        first = _CAME_AS not in hf_model.__dict__
        self._came_as = hf_model.__dict__.get(_CAME_AS) or (
            hf_model.config._attn_implementation,
            getattr(hf_model.config, "_experts_implementation", None),
            tuple((n, m.training) for n, m in hf_model.named_modules()))
        try:
            _switch_attention(hf_model)
            rotary.patch(hf_model)
            if experts is not None:
                hf_model.set_experts_implementation(experts)
            self.eval()  # the wrapper too: a runner compares its flag on every call
            # What the experts run once switched (or their own), None for a dense model.
            self.experts = experts and getattr(hf_model.config, "_experts_implementation",
                                               None)
            self.kv_shapes, self.kv_windows, self.kv_repeats = probe.kv_layers(
                hf_model, dtype, self.graphcap_attention_options)
            self._substitute(kernels, dtype)
        except BaseException:  # the model goes back as it came to its first wrapper
            if first:
                _give_back(hf_model, self._came_as)
            raise
        hf_model.__dict__[_CAME_AS] = self._came_as
        alive = _WRAPPERS.setdefault(hf_model, weakref.WeakSet())
        self.first_wrapper = not alive  # no other wrapper of the model lives
        alive.add(self)
        log.info("graphcap.hf: %s: %s", type(hf_model).__name__, self.kernels.summary())

    def release(self) -> nn.Module:
        """The wrapped model as it came to its first wrapper: its own module forwards
        (graphcap's kernels taken out, for every wrapper of it), its attention and experts
        implementations and its train or eval mode. No wrapper of it is usable after."""
        return _give_back(self.hf_model, self._came_as)

    def _substitute(self, kernels: str, dtype: torch.dtype) -> None:
        """One substitution per model, shared by every PrefillLM of it: a second wrapper
        with the same ``kernels`` reuses it; with the other, it switches the model (and so
        every wrapper of it)."""
        held = self.hf_model.__dict__.get(_SUBSTITUTION)
        if held is not None and held.kernels == kernels:
            held.ensure()
            return
        if held is not None:
            log.warning("graphcap.hf: %s was wrapped with kernels=%r; kernels=%r now "
                        "applies to every PrefillLM of it", type(self.hf_model).__name__,
                        held.kernels, kernels)
        if kernels == "graphcap":
            sub = substitution.substitute(self.hf_model, dtype)
        else:
            substitution.restore(self.hf_model)
            sub = substitution.Substitution(self.hf_model)
        self.hf_model.__dict__[_SUBSTITUTION] = sub

    @property
    def kernels(self) -> substitution.Substitution:
        """Which modules run graphcap's kernels and which their stock code
        (``summary()``, ``table()``): the model's, shared by its wrappers."""
        held = self.hf_model.__dict__.get(_SUBSTITUTION)
        if held is None:
            raise UnsupportedModel(
                f"this {type(self.hf_model).__name__} was released (PrefillLM.release(), "
                "by this wrapper or another of the model): wrap it again, PrefillLM(model)")
        return held

    def graphcap_before_capture(self) -> None:
        """Called by a runner outside any graph before it captures: weights the kernels
        read fused are fused again where the model's were replaced; a model switched to
        other attention or experts since wrapping is refused."""
        self._check_switched(capture=True)
        self.kernels.ensure()
        rotary.ensure(self.hf_model)

    def _check_switched(self, capture: bool = False) -> None:
        """Refuse a model whose attention implementation (for a capture, experts
        implementation) is no longer PrefillLM's, whose call-time config or vocabulary
        changed (``graphcap.hf.changes``), or cast since to a dtype graphcap.hf does not run."""
        kind, config = type(self.hf_model).__name__, self.hf_model.config
        self.kernels  # noqa: B018 (refuses a released model, whatever it runs now)
        _check_dtype(self.hf_model)
        if why := changes.refusal(self.hf_model, self._taken):
            raise UnsupportedModel(why)
        if (now := config._attn_implementation) != NAME:
            raise UnsupportedModel(
                f"{kind}'s attention implementation is {now!r}, not graphcap's: it was "
                f"switched after PrefillLM wrapped it (set_attn_implementation({now!r})), "
                "and only graphcap attention keeps the packed requests apart (and captures "
                "without host syncs); switch it back, hf_model.set_attn_implementation("
                f"{NAME!r}), or wrap the model again, PrefillLM(hf_model)")
        experts = getattr(config, "_experts_implementation", None)
        if capture and self.experts is not None and experts != self.experts and \
                experts not in CAPTURABLE_EXPERTS:
            raise UnsupportedModel(
                f"{kind}'s experts implementation is {experts!r}, not {self.experts!r}: it "
                f"was switched after PrefillLM wrapped it, and {experts!r} cannot be "
                "captured (it finds the experts hit with nonzero, a host sync); switch it "
                f"back, hf_model.set_experts_implementation({self.experts!r}), or run "
                "the model under strategy='eager'")

    graphcap_inputs = "prefill"

    @property
    def max_position(self) -> int | None:
        config = self.hf_model.config  # a decoder alone (Whisper's) names its own
        return rotary.served_positions(config, getattr(
            config, "max_position_embeddings", None) or getattr(
                config, "max_target_positions", None))

    @property
    def graphcap_kv(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of graphcap's paged K/V cache: the keys and values
        its attention layers receive (``kv_shapes``, found when it was wrapped: MLA's keys
        have all query heads and a head dim no config field names alone), one shape for
        every layer, or ``UnsupportedModel``."""
        if why := probe.repeated_calls(self.hf_model, self.kv_repeats):
            raise UnsupportedModel(why)
        found = sorted(set(self.kv_shapes.values()))
        if len(found) != 1:
            raise UnsupportedModel(
                f"{type(self.hf_model).__name__}: graphcap's paged K/V cache holds one [kv "
                f"heads, head dim] for every layer, and its attention layers with an int "
                f"layer_idx give {found or 'none'}; generate with transformers (its own "
                "attention: hf_model.set_attn_implementation('sdpa'), then "
                "hf_model.generate())")
        (heads, head_dim), = found
        return max(self.kv_shapes) + 1, heads, head_dim

    @property
    def graphcap_kv_window(self) -> int:
        """Every attention layer windowed: the longest window (pages behind it freed), else 0."""
        self._check_switched()
        return longest_window(self.kv_windows.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_rows=None,
                seq_lens=None):
        """``last_rows`` [requests] (``logits="last"``): the row of each request's last
        token; the runner passes it, an eager call with ``seq_lens`` derives it. Only
        those rows go through the LM head (transformers' ``logits_to_keep``)."""
        if not torch.compiler.is_compiling():
            self._check_switched()
            self.kernels.ensure()
            if seq_lens is None and hf_attention.outside_graphcap():
                raise BadBatch(
                    "PrefillLM was called without seq_lens outside a runner: give the packed "
                    "requests' lengths, lm(input_ids, positions, seq_lens=[...]), or call "
                    "it through a runner (graphcap.capture(lm, ...)); its attention reads "
                    "where requests begin and end from graphcap's forward context "
                    "(graphcap.packed(seq_lens, device))")
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise BadBatch(
                f"PrefillLM takes input_ids [T] and positions [T] of packed requests, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if seq_lens is not None:  # eager use: prepare this batch's attention metadata
            lens = checks.check_prefill(input_ids, positions, seq_lens, input_ids.device)
            if self.output_rows == "requests" and 0 in lens:
                raise BadBatch(f"seq_lens {lens} has a zero-length request, which has no "
                               "last token (logits='last'); drop empty requests")
            checks.check_ranges(input_ids, positions, self.vocab_size, self.max_position)
            dtype = self.hf_model.get_output_embeddings().weight.dtype
            with packed(seq_lens, input_ids.device, dtype=dtype,
                        options=self.graphcap_attention_options) as meta:
                if self.output_rows == "requests":
                    last_rows = meta.last_token_rows()
                return self._logits(input_ids, positions, last_rows)
        return self._logits(input_ids, positions, last_rows)

    def _logits(self, input_ids, positions, last_rows):
        keep = {}
        if self.output_rows == "requests":
            if last_rows is None:
                raise BadBatch("a PrefillLM built with logits='last' needs last_rows (or "
                               "seq_lens=[...] in an eager call)")
            keep = {"logits_to_keep": last_rows}
        logits = self.hf_model(input_ids=input_ids[None], position_ids=positions[None],
                               **probe.call_options(self.hf_model),
                               **(keep if self._keeps_rows else {})).logits[0]
        return logits if self._keeps_rows or not keep else logits[last_rows]

