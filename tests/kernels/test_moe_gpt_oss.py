"""gpt-oss's experts on opsdb's MoE ops: its router (top-k of the logits, then a softmax
over them) is ``moe_topk_softmax`` with renormalisation, and its experts (biases, an
interleaved gate/up projection, the clamped GLU) are ``moe_experts`` with ``b13``,
``b2``, ``alpha`` and ``limit`` over de-interleaved weights: equal to transformers' own
modules, in the torch reference and the Triton kernel (Triton's interpreter without a
GPU)."""

from __future__ import annotations

import pytest
import torch

from graphcap.opsdb import reference
from graphcap.opsdb.triton import moe

transformers = pytest.importorskip("transformers")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def gpt_oss_moe(seed: int = 0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    experts, router = GptOssExperts(config), GptOssTopKRouter(config)
    with torch.no_grad():
        for p in (*experts.parameters(), *router.parameters()):
            p.normal_(0, 0.5)
    return config, experts, router


def ours(experts):
    """w13 [E, 2I, H] (gate rows, then up rows), b13, w2 [E, H, I], b2 from transformers'
    interleaved [E, H, 2I] gate_up_proj."""
    gate_up, bias = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    b13 = torch.cat([bias[..., ::2], bias[..., 1::2]], dim=-1)
    w2 = experts.down_proj.detach().transpose(1, 2)
    return (w13.contiguous(), w2.contiguous(), b13.contiguous(),
            experts.down_proj_bias.detach().contiguous())


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_gpt_oss_experts_are_moe_experts_with_biases_and_the_clamped_glu(tokens):
    config, experts, router = gpt_oss_moe(tokens)
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, scores, indices = router(x)
        want = experts(x, indices, scores)
    weights, ids = reference.moe_topk_softmax(logits, config.num_experts_per_tok, True)
    assert torch.equal(ids.long(), indices)
    torch.testing.assert_close(weights, scores, rtol=1e-6, atol=1e-6)
    w13, w2, b13, b2 = ours(experts)
    glu = (experts.alpha, experts.limit)  # the module's own: older configs do not carry them
    got = reference.moe_experts(x, w13, w2, weights, ids, b13, b2, *glu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids, b13, b2)]
    torch.testing.assert_close(moe.moe_experts(*args, *glu).cpu(), want, rtol=1e-4,
                               atol=1e-4)
