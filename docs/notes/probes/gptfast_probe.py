"""Why the bench's gpt-fast peer is slow at batch 8 and 64 (device side):

    PYTHONPATH=. python3 docs/notes/probes/gptfast_probe.py [preset] [batch]

The recipe as the bench ran it until ``940b2e3`` (``bench``: every layer's cache a slice
of one 5-D buffer), and as ``graphcap.bench.gptfast`` holds it since: each layer's cache
its own buffer (as gpt-fast's ``KVCache`` modules hold it), with the heads repeated and
with SDPA's ``enable_gqa``. Each
compiled with ``mode="reduce-overhead"``; ms per step fed back to back, whether Inductor
skipped CUDA graphs (its log), and the step's top kernels. JSON in $OUT/gptfast-probe.json."""

import json
import logging
import os
import sys

import torch
import torch.nn.functional as F

from graphcap.bench.common import back_to_back_ms, environment
from graphcap.bench.decode import profile_steps
from graphcap.bench.gptfast import StaticCacheDecoder
from graphcap.models import build_model

CONTEXT = 1024


class OneBuffer(StaticCacheDecoder):
    """The recipe as the bench ran it until ``940b2e3``: every layer's cache a slice of
    one ``[layers, batch, kv_heads, max_len, head_dim]`` buffer, written with
    ``index_copy_``, the heads repeated."""

    def __init__(self, model, batch, max_len):
        super().__init__(model, batch, max_len)
        a = model.args
        for kind in "kv":
            whole = torch.stack([getattr(self, f"{kind}_cache{i}") for i in range(a.layers)])
            for i in range(a.layers):
                delattr(self, f"{kind}_cache{i}")
            self.register_buffer(f"{kind}_whole", whole, persistent=False)

    def attend(self, layer, q, k, v, pos, mask):
        self.k_whole[layer].index_copy_(2, pos, k)
        self.v_whole[layer].index_copy_(2, pos, v)
        group = self.a.heads // self.a.kv_heads
        return F.scaled_dot_product_attention(
            q, self.k_whole[layer].repeat_interleave(group, dim=1),
            self.v_whole[layer].repeat_interleave(group, dim=1), attn_mask=mask)


class Skips(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        text = record.getMessage()
        if "skipping cudagraphs" in text.lower() or "cudagraph" in text.lower():
            self.lines.append(text[:300])


def main(preset: str, batch: int) -> dict:
    model = build_model(preset, device="cuda", dtype=torch.bfloat16)
    handler = Skips()
    for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._dynamo"):
        logging.getLogger(name).addHandler(handler)
    torch._logging.set_logs(perf_hints=True)
    rows = []
    variants = {"bench": lambda: OneBuffer(model, batch, CONTEXT + 1),
                "per-layer": lambda: StaticCacheDecoder(model, batch, CONTEXT + 1),
                "per-layer-gqa": lambda: StaticCacheDecoder(model, batch, CONTEXT + 1,
                                                            gqa=True)}
    ids = torch.randint(1, model.args.vocab_size, (batch, 1), device="cuda")
    pos = torch.tensor([CONTEXT], device="cuda")
    for name, make in variants.items():
        torch._dynamo.reset()
        handler.lines.clear()
        compiled = torch.compile(make(), mode="reduce-overhead", fullgraph=True)

        def step(c=compiled):
            with torch.no_grad():
                return c(ids, pos)
        for _ in range(3):
            step()
        prof = profile_steps(step, 10)
        rows.append({"variant": name, "batch": batch,
                     "ms_back_to_back": round(back_to_back_ms(step), 4),
                     "cudagraph_log": handler.lines[:5], **prof})
        print(name, rows[-1]["ms_back_to_back"], prof.get("kernels"), handler.lines[:3],
              flush=True)
        for k in prof.get("top_kernels", [])[:5]:
            print(f"      {k['kernel'][:70]:70} {k['launches']:5.0f} {k['us']:9.1f} us",
                  flush=True)
        del compiled
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    out = {"what": "the gpt-fast peer's step at batch > 1", **environment(),
           "context": CONTEXT, **main(preset, batch)}
    with open(os.path.join(os.environ.get("OUT", "."), "gptfast-probe.json"), "w") as f:
        json.dump(out, f, indent=1)
