"""moe_topk_softmax on tied and near-tied router logits chooses the experts transformers'
own routers choose: gpt-oss's (torch.topk over the logits, then a softmax over those)
and Mixtral's (torch.topk over the float32 softmax), in float32 and bfloat16, in the
torch reference and the Triton kernel (Triton's interpreter without a GPU).

Where logits tie exactly, torch.topk's choice among them is its implementation's (on the
CPU not the lowest index); so the property is that each token's experts are *a* top-k
under the stock router's own ranking, and where that top-k is unique, the same one."""

from __future__ import annotations

import importlib

import pytest
import torch

from graphcap.opsdb import reference
from graphcap.opsdb.triton import moe_routing

transformers = pytest.importorskip("transformers")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
KERNELS = {"torch": reference.moe_topk_softmax, "triton": moe_routing.moe_topk_softmax}
EXPERTS, TOP_K, TOKENS = 8, 2, 64


def tie_heavy_logits(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[TOKENS, EXPERTS] logits of a few values, many exactly equal, many a few units in
    the last place apart and tiny ones (0 against 1e-8), whose float32 softmax rounds to
    one probability (their difference lost in the logit less the row's largest)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([-1.0, 0.0, 0.3, 0.7, 1e-8, 2.0 ** -26, 2.0])
    logits = grid[torch.randint(len(grid), (TOKENS, EXPERTS), generator=gen)].to(dtype)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    bits = logits.view(ints)
    ulps = torch.randint(-2, 3, (TOKENS, EXPERTS), generator=gen).to(ints)
    ulps *= (torch.rand(TOKENS, EXPERTS, generator=gen) < 0.5).to(ints)
    logits = torch.where(logits != 0, (bits + ulps).view(dtype), logits)
    # 1e-8 - 5 rounds to 0 - 5 in float32: one probability, the larger logit's expert
    logits[0] = torch.tensor([0.0, 1e-8, 5.0, -1.0, -2.0, -3.0, -4.0, -5.0])
    return logits


def identity_router(cls, config, dtype):
    """A stock router whose logits are its input: an identity weight, a zero bias."""
    router = cls(config).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.eye(EXPERTS, dtype=dtype))
        if getattr(router, "bias", None) is not None:
            router.bias.zero_()
    return router


def check_same_choice(logits, key, stock_ids, stock_weights, kernel):
    """Our experts: a top-k under ``key`` (the stock router's ranking), the stock's own
    where that is unique, with the stock's weights there; token 0's, the larger logit's
    expert of 0 and 1e-8 (Mixtral's ranking, of probabilities, cannot tell them apart)."""
    weights, ids = KERNELS[kernel](logits.to(DEVICE), TOP_K, True)
    ids, weights = ids.cpu().long(), weights.cpu()
    want_key = key.topk(TOP_K, dim=-1).values
    got_key = key.gather(1, ids).sort(dim=-1, descending=True).values
    bad = (got_key != want_key).any(dim=-1).nonzero().flatten().tolist()
    assert not bad, (f"{kernel}: token {bad[0]}: chose {ids[bad[0]].tolist()} of logits "
                     f"{logits[bad[0]].tolist()}, the stock router {stock_ids[bad[0]].tolist()}")
    same = (ids.sort(-1).values == stock_ids.sort(-1).values).all(-1)
    assert ids[0].tolist() == [2, 1]  # 1e-8 above 0, not the lower id of one probability
    ours = torch.zeros(TOKENS, EXPERTS).scatter(1, ids, weights)
    theirs = torch.zeros(TOKENS, EXPERTS).scatter(1, stock_ids, stock_weights.float())
    tol = 1e-6 if logits.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours[same], theirs[same], rtol=tol, atol=tol)


# The stock router, its config, the seed of its logits, and what its torch.topk ranks:
# gpt-oss's the logits, Mixtral's their softmax (a top-k of which ours must be).
STOCK = {
    "gpt_oss": ("gpt_oss", "GptOssTopKRouter", "GptOssConfig", 0, lambda x: x.float()),
    "mixtral": ("mixtral", "MixtralTopKRouter", "MixtralConfig", 1,
                lambda x: torch.softmax(x.float(), dim=-1)),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", STOCK)
def test_router_ties_choose_a_top_k_of_what_the_stock_router_ranks(kernel, dtype, family):
    module, router_name, config_name, seed, ranked = STOCK[family]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, config_name)(hidden_size=EXPERTS,
                                                num_local_experts=EXPERTS,
                                                num_experts_per_tok=TOP_K)
    router = identity_router(getattr(modeling, router_name), config, dtype)
    logits = tie_heavy_logits(dtype, seed=seed)
    with torch.no_grad():
        stock_logits, stock_weights, stock_ids = router(logits)
    assert torch.equal(stock_logits, logits)
    check_same_choice(logits, ranked(stock_logits), stock_ids, stock_weights, kernel)
