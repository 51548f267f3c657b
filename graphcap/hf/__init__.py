"""Stock transformers causal LMs under graphcap, without editing the model.

Importing this package registers ``"graphcap"`` as a transformers attention
implementation (``graphcap.hf.attention``): HF's q/k/v go to graphcap's split op
``graphcap::attention``, packed requests attend causally within themselves, and no dense
mask is built. :class:`PrefillLM` wraps a causal LM as a graphcap prefill model.

    from transformers import AutoModelForCausalLM
    import graphcap
    from graphcap.hf import PrefillLM

    lm = PrefillLM(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda())
    runner = graphcap.capture(lm, "breakable", max_tokens=2048, max_requests=8)
    logits = runner(input_ids, positions, seq_lens=[700, 300])   # [1000, vocab]

See docs/hf.md for what is supported.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("graphcap.hf needs transformers: pip install 'torch-graphcap[hf]'"
                      ) from exc

from graphcap.hf.attention import NAME, UnsupportedModel, graphcap_attention
from graphcap.hf.model import CAPTURABLE_EXPERTS, PrefillLM

__all__ = ["CAPTURABLE_EXPERTS", "NAME", "PrefillLM", "UnsupportedModel",
           "graphcap_attention"]
