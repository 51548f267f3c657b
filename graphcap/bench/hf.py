"""Stock transformers arms of ``graphcap bench prefill``: the model a user brings, of a
preset's config (random weights), run as a user would run it instead of graphcap, and
under graphcap.hf with its stock kernels and with graphcap's.

- ``hf-eager``: transformers' own forward, SDPA attention;
- ``hf-compile-reduce-overhead``: ``torch.compile(mode="reduce-overhead")`` of it with
  static shapes, one compile per prompt length, as users do (compile seconds reported);
- ``hf-<strategy>-<stock|graphcap>``: ``graphcap.capture(PrefillLM(hf, kernels=...),
  strategy)`` for breakable, full and tc_piecewise (inductor pieces).

Every arm returns the last token's logits (``logits_to_keep=1``, ``PrefillLM(...,
logits="last")``), as the preset's arms do. Each kind of arm has its own copy of the
model (PrefillLM switches a model's attention and forwards): three copies at most.
"""

from __future__ import annotations

import time

import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.bench.arms import Arm, prompts
from graphcap.errors import GraphcapError, UnsupportedModel
from graphcap.models import PRESETS

HF_ARMS = ("hf-eager", "hf-compile-reduce-overhead",
           *(f"hf-{s}-{k}" for s in GRAPHED for k in ("stock", "graphcap")))


def unmirrored(preset: str) -> str | None:
    """Why :func:`hf_config` has no stock model of ``preset`` (what the preset has that
    the config it would take, Llama, Qwen3 or Qwen3-MoE, does not), or None."""
    a = PRESETS[preset]
    has = [name for name, on in (
        ("q/k/v biases", a.qkv_bias), ("an o bias", a.o_bias),
        ("sliding windows", a.window), ("soft-capping", a.softcap), ("sinks", a.sinks),
        ("scaled rotary frequencies", a.rope_scaling), ("expert biases", a.moe_bias),
        ("the clamped GLU", a.glu_alpha or a.glu_limit), ("MXFP4 experts", a.moe_mxfp4),
        ("experts without q/k norms (Qwen3-MoE has them)", a.experts and not a.qk_norm))
        if on]
    if not has:
        return None
    return (f"no stock transformers model mirrors {preset}: it has {', '.join(has)}, "
            "which the Llama, Qwen3 and Qwen3-MoE configs do not")


def hf_config(preset: str):
    """The transformers config of a preset's shape: Qwen3 (q/k norms), Qwen3-MoE
    (experts) or Llama; ``UnsupportedModel`` for a preset none of them mirrors
    (:func:`unmirrored`: a stock model of another architecture is no peer of it)."""
    import transformers

    a = PRESETS[preset]
    if why := unmirrored(preset):
        raise UnsupportedModel(why)
    common = dict(vocab_size=a.vocab_size, hidden_size=a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  head_dim=a.head_dim, intermediate_size=a.intermediate, rms_norm_eps=a.eps,
                  max_position_embeddings=a.max_position,
                  tie_word_embeddings=a.tie_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta})
    if a.experts:
        return transformers.Qwen3MoeConfig(**common, num_experts=a.experts,
                                           num_experts_per_tok=a.top_k,
                                           moe_intermediate_size=a.moe_intermediate,
                                           norm_topk_prob=a.norm_topk)
    if a.qk_norm:
        return transformers.Qwen3Config(**common)
    return transformers.LlamaConfig(**common)


def stock_model(preset: str, device, dtype):
    """A stock transformers causal LM of the preset's config, random weights, SDPA."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(preset), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _eager_arm(name, model, inputs) -> Arm:
    def call(n):
        ids, _ = inputs[n]
        with torch.inference_mode():
            return model(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits[0]

    return Arm(name, call, 0.0, {"attention": "sdpa"})


def _reduce_overhead_arm(name, model, lengths, inputs) -> Arm:
    """Static shapes: one compile (and CUDA graph) per prompt length."""
    from torch._dynamo.utils import counters

    from graphcap import compat

    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False, fullgraph=True)

    def call(n):
        ids, _ = inputs[n]
        with torch.inference_mode():
            return compiled(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits[0]

    start, compile_s = time.perf_counter(), {}
    with compat.allow_recompiles(len(lengths) + 8):  # its compiles are all made here
        for n in sorted(lengths, reverse=True):
            first = time.perf_counter()
            call(n)
            torch.cuda.synchronize()
            compile_s[n] = round(time.perf_counter() - first, 2)
            for _ in range(2):  # reduce-overhead records its graph on a later call
                call(n)
    graphs = counters["stats"]["unique_graphs"]
    for n in lengths:
        call(n)
    if counters["stats"]["unique_graphs"] != graphs:  # it would time compiles
        raise RuntimeError("the compiled stock model recompiles on repeated calls of one "
                           "length (run with TORCH_LOGS=recompiles to see the guard)")
    torch.cuda.synchronize()
    return Arm(name, call, time.perf_counter() - start,
               {"attention": "sdpa", "mode": "reduce-overhead", "dynamic": False,
                "compile_s": compile_s, "compile_total_s": round(sum(compile_s.values()), 2)})


def _graphcap_arm(name, lm, lengths, attention, inputs) -> Arm:
    strategy = name.split("-")[1]
    kwargs = {"compiler": "inductor"} if strategy == "tc_piecewise" else {}
    start = time.perf_counter()
    runner = graphcap.capture(lm, strategy, buckets=sorted(lengths), max_requests=1,
                              attention=attention, fallback=False, **kwargs)
    build = time.perf_counter() - start
    report = runner.report()

    def call(n):
        ids, pos = inputs[n]
        return runner(ids, pos, seq_lens=[n])

    return Arm(name, call, build, {"attention": attention, "kernels": lm.kernels.summary(),
                                   "graph_pool_bytes": report["graph_pool_bytes"],
                                   "compile_and_warmup_s": report["build_s"]["warmup"],
                                   "capture_s": report["build_s"]["capture"]}, runner)


def build_hf_arms(preset: str, names, lengths, attention: str, device, dtype,
                  on_arm=None) -> tuple[dict[str, Arm], dict[str, str]]:
    """The stock transformers arms among ``names`` that run here, and why the others do
    not."""
    from graphcap.hf import PrefillLM

    inputs = prompts(lengths, PRESETS[preset].vocab_size, device)
    models: dict[str, object] = {}

    def model_for(kind):
        if kind not in models:
            hf = stock_model(preset, device, dtype)
            models[kind] = hf if kind == "sdpa" else PrefillLM(hf, logits="last",
                                                               kernels=kind)
        return models[kind]

    unknown = [name for name in names if name not in HF_ARMS]
    if unknown:
        raise ValueError(f"no stock transformers arm {unknown[0]!r}; choose from "
                         f"{', '.join(HF_ARMS)}")
    if why := unmirrored(preset):  # another architecture would be timed under its name
        return {}, dict.fromkeys(names, why)
    arms, skipped = {}, {}
    for name in names:
        try:
            if name == "hf-eager":
                arms[name] = _eager_arm(name, model_for("sdpa"), inputs)
            elif name == "hf-compile-reduce-overhead":
                if torch.device(device).type != "cuda":
                    skipped[name] = "reduce-overhead records CUDA graphs: a CUDA device only"
                    continue
                arms[name] = _reduce_overhead_arm(name, model_for("sdpa"), lengths, inputs)
            else:
                kernels = name.rsplit("-", 1)[1]
                arms[name] = _graphcap_arm(name, model_for(kernels), lengths, attention,
                                           inputs)
        except (GraphcapError, RuntimeError) as exc:  # recorded, not hidden
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            if on_arm is not None:
                on_arm(name)
    return arms, skipped
