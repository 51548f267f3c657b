"""A fresh process: qwen3-0.6b captured with no kernel compiled or loaded yet, as a user's
first build, full then breakable, each replay against eager (device side):
PYTHONPATH=. python3 tools/gpu/cold_build.py; JSON in $OUT."""

import json
import os
import time

import torch

import graphcap
from graphcap.bench.arms import prompts
from graphcap.models import build_model

model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
eager = graphcap.capture(model, "eager", attention="triton")
lens = [16, 100, 512, 2048]
inputs = prompts(lens, model.args.vocab_size, "cuda")
result = {}
for strategy in ("full", "breakable"):
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner = graphcap.capture(model, strategy, max_tokens=2048, attention="triton")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    rep = runner.report()
    err = {n: float((runner(*inputs[n], seq_lens=[n]).float()
                     - eager(*inputs[n], seq_lens=[n]).float()).abs().max()) for n in lens}
    result[strategy] = {"build_s": round(build_s, 2), "warmups": rep["warmups"],
                        "warmup_retries": rep["warmup_retries"],
                        "pool_mb": round(rep["graph_pool_bytes"] / 2**20, 1),
                        "max_abs_err_vs_eager": err}
    del runner
print(json.dumps(result, indent=1))
with open(os.path.join(os.environ.get("OUT", "/tmp"), "cold-build.json"), "w") as f:
    json.dump(result, f, indent=1)
