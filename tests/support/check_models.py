"""Factories for the graphcap check tests: a good model and one with a frozen side effect."""

from __future__ import annotations

import torch

from graphcap.models import build_model


def good():
    return build_model("tiny")

class Counting(torch.nn.Module):
    """A Python side effect that capture freezes: a call counter used in the output."""
    def __init__(self):
        super().__init__()
        self.inner = build_model("tiny")
        self.args = self.inner.args
        self.calls = 0
    def forward(self, input_ids, positions):
        self.calls += 1
        return self.inner(input_ids, positions) + self.calls

def counting():
    return Counting()


class Calibrated(torch.nn.Module):
    """A scale calibrated on the first batch it sees: a runner's warm-up's dummy batch
    sets it, where eager's reference sees a real batch first."""
    graphcap_inputs = "prefill"
    vocab_size = 50

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.scale = None

    def forward(self, input_ids, positions):
        h = self.emb(input_ids)
        if self.scale is None:
            self.scale = h.abs().amax().detach()
        return h / self.scale


def calibrated():
    torch.manual_seed(0)
    return Calibrated()


class Cycling(torch.nn.Module):
    """A frozen counter that scales the output by 1, 2 or 3 in turn: its replays differ
    from eager in more than one way (hypothesis finds several distinct failures)."""

    graphcap_inputs = "prefill"
    vocab_size = 50

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50)
        self.calls = 0

    def forward(self, input_ids, positions):
        self.calls += 1
        return self.head(self.emb(input_ids)) * (1 + self.calls % 3)


def cycling():
    torch.manual_seed(0)
    return Cycling().eval()


class SdpaDecoder(torch.nn.Module):
    """A decoder of packed requests whose attention is its own SDPA: blind to where the
    requests begin and end."""

    graphcap_inputs = "prefill"

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, input_ids, positions):
        q, k, v = self.qkv(self.embed(input_ids)).chunk(3, -1)
        out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None],
                                                               is_causal=True)
        return self.head(out[0])


def sdpa():
    return SdpaDecoder()


def _hf(config_class, **extra):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def hf_llama():
    """A stock transformers causal LM, returned as it is: check wraps it."""
    return _hf("LlamaConfig")


def hf_stablelm():
    """A family graphcap.hf names nowhere: LayerNorms, partial rotary, q/k/v biases."""
    return _hf("StableLmConfig", partial_rotary_factor=0.5, use_qkv_bias=True)


def hf_starcoder2():
    """Another: LayerNorms, biases everywhere, a GELU MLP, no sliding window."""
    return _hf("Starcoder2Config", sliding_window=None)


def hf_gemma2():
    """Sliding windows on alternate layers, soft-capped attention and final logits."""
    return _hf("Gemma2Config", head_dim=16, sliding_window=8, attn_logit_softcapping=2.0)


def hf_gemma3():
    """Five local layers to one global (two here), a rotary base per kind of layer."""
    return _hf("Gemma3TextConfig", head_dim=16, sliding_window=8)


def hf_cohere2():
    return _hf("Cohere2Config", sliding_window=8)


def hf_olmo3():
    return _hf("Olmo3Config", sliding_window=8)


def hf_gpt_oss():
    """Sliding windows, learned attention sinks, experts with a clamped gated activation."""
    return _hf("GptOssConfig", head_dim=16, sliding_window=8, num_local_experts=4,
               num_experts_per_tok=2)


def hf_mistral_windowed():
    return _hf("MistralConfig", sliding_window=8)


class TwoTensors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.lin(x) * scale


def two_tensors():
    """Neither a model of packed requests nor a causal LM."""
    return TwoTensors()


def short_positions():
    """The tiny decoder with 40 positions: a longer request reads past its rotary table."""
    import dataclasses

    from graphcap.models import PRESETS
    from graphcap.models.decoder import Decoder

    torch.manual_seed(0)
    return Decoder(dataclasses.replace(PRESETS["tiny"], max_position=40)).eval()
