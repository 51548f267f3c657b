"""bf16 decode steps on graphcap's kernels (on CUDA the decode path's own: the one-row
GEMV with the RMSNorm folded in, the few-row linears with SwiGLU and the residual add,
``qkv_norm_rope``, decode attention writing the step's K/V) are no further from the
float32 model than the stock bf16 model is: the same tokens teacher-forced through both,
each decode step's logits against float32's at the same position. On the CPU the same
steps run opsdb's torch kernels."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from graphcap.engine.eager import decode_step, prefill  # noqa: E402
from graphcap.engine.engine import cache_shape  # noqa: E402
from graphcap.hf import PrefillLM  # noqa: E402
from graphcap.kv import PagedKVCache  # noqa: E402
from tests.support.runner_helpers import DEVICE  # noqa: E402

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

PROMPT, STEPS = 48, 6


def config(family: str):
    shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=2048, max_position_embeddings=4096)
    return {"qwen3": transformers.Qwen3Config,
            "llama": transformers.LlamaConfig}[family](**shape)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bf16_decode_steps_are_no_further_from_float32_than_the_stock_bf16_model(
        family, batch):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        truth = transformers.AutoModelForCausalLM.from_config(
            config(family), dtype=torch.float32, attn_implementation="sdpa").eval()
    stock = copy.deepcopy(truth).to(torch.bfloat16)
    lm = PrefillLM(copy.deepcopy(stock))
    assert "0/" not in lm.kernels.summary(), lm.kernels.table()
    seqs = torch.randint(0, truth.config.vocab_size, (batch, PROMPT + STEPS), device=DEVICE)
    with torch.inference_mode():  # step s feeds token PROMPT + s: its logits are these
        want = truth(seqs).logits[:, PROMPT:].float()
        bf16 = stock(seqs).logits[:, PROMPT:].float()
    shape = cache_shape(lm)
    cache = PagedKVCache(shape.layers, shape.kv_heads, shape.head_dim, max_requests=batch,
                         max_len=PROMPT + STEPS + 1, dtype=torch.bfloat16, device=DEVICE)
    slots = list(range(batch))
    for slot in slots:
        cache.admit(slot, PROMPT + STEPS + 1)
    prefill(lm, cache, seqs[:, :PROMPT].reshape(-1), [PROMPT] * batch, slots)
    ours = []
    for step in range(STEPS):
        positions = torch.full((batch,), PROMPT + step, device=DEVICE)
        ours.append(decode_step(lm, cache, seqs[:, PROMPT + step], positions, slots))
    ours = torch.stack(ours, dim=1).float()
    stock_err = float((bf16 - want).norm() / want.norm())
    ours_err = float((ours - want).norm() / want.norm())
    # Within 10% of stock's distance, as the prefill test's bound (test_hf_kernels.py).
    assert ours_err <= stock_err * 1.10, (ours_err, stock_err)
