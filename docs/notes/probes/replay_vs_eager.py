"""qwen3-0.6b replay against eager at 480-1024 tokens, with both warm-up modes, and eager
against itself on the default and a side stream (device side):
PYTHONPATH=. python3 tools/gpu/replay_vs_eager.py; JSON in $OUT."""

import json
import os

import torch

import graphcap
from graphcap.bench.arms import prompts
from graphcap.models import build_model

model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
lens = [480, 500, 512, 1024]
inputs = prompts(lens, model.args.vocab_size, "cuda")
eager = graphcap.capture(model, "eager", attention="triton")
ref = {n: eager(*inputs[n], seq_lens=[n]).float() for n in lens}


def err(call):
    return {n: float((call(n).float() - ref[n]).abs().max()) for n in lens}


result = {"eager_again": err(lambda n: eager(*inputs[n], seq_lens=[n])),
          "ref_absmax": {n: float(ref[n].abs().max()) for n in lens}}
for warmup in ("first", "every"):
    runner = graphcap.capture(model, "full", max_tokens=2048, attention="triton",
                              warmup=warmup)
    result[f"full-{warmup}"] = err(lambda n, r=runner: r(*inputs[n], seq_lens=[n]))
    result[f"full-{warmup}-again"] = err(lambda n, r=runner: r(*inputs[n], seq_lens=[n]))
    del runner
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    on_side = eager(*inputs[512], seq_lens=[512]).float()
torch.cuda.current_stream().wait_stream(side)
result["eager_side_stream_512"] = float((on_side - ref[512]).abs().max())
print(json.dumps(result, indent=1))
with open(os.path.join(os.environ.get("OUT", "/tmp"), "err512.json"), "w") as f:
    json.dump(result, f, indent=1)
