"""Where a speculative verify step's time goes beside a plain decode step's (device side):

    PYTHONPATH=. python3 docs/notes/probes/verify_profile.py [preset]

The ``LLM`` the speculative bench builds (full strategy, bf16, n-gram proposer, k = 4),
one request prefilled to 128 tokens; the decode step (1 row) and the greedy verify step
(1 + 4 rows) timed interleaved as ``graphcap bench decode --speculative`` times them,
then profiled: kernels a step, GPU idle share, and the kernels that take the most time.
JSON in $OUT/verify-profile.json."""

import json
import os
import sys

import torch

from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.engine.eager import prefill
from graphcap.engine.llm import LLM
from graphcap.engine.proposers import NgramProposer
from graphcap.models import build_model

K, CONTEXT = 4, 128


def main(preset: str) -> None:
    model = build_model(preset, device="cuda", dtype=torch.bfloat16, logits="last")
    llm = LLM(model, strategy="full", max_batch=1, max_len=2 * CONTEXT,
              prefill_tokens=CONTEXT * 8, progress=False, stop_at_eos=False,
              speculative=NgramProposer(K))
    engine, cache = llm.engine, llm.cache
    vocab = model.args.vocab_size
    cache.admit(0, CONTEXT + 1 + K)
    gen = torch.Generator().manual_seed(3)
    prefill(model, cache, torch.randint(1, vocab, (CONTEXT,), generator=gen).cuda(),
            [CONTEXT], [0])
    tokens = torch.randint(1, vocab, (1 + K,), generator=gen).cuda()
    cases = {
        "decode": lambda: engine.decoder(tokens[:1], positions=[CONTEXT], slots=[0]),
        "verify": lambda: engine.verifier.runner(tokens, positions=[CONTEXT], slots=[0]),
    }
    times = time_interleaved(cases, reps=100, rounds=5)
    out = {"what": "verify step (1 + 4 rows) against a decode step, batch 1",
           **environment(), "preset": preset, "context": CONTEXT, "k": K,
           "ms": {name: t["median_ms"] for name, t in times.items()},
           "profile": {name: profile_steps(fn) for name, fn in cases.items()}}
    for name in cases:
        prof = out["profile"][name]
        print(name, out["ms"][name], "ms,", prof["kernels"], "kernels, idle",
              prof["idle_share"], flush=True)
        for row in prof["top_kernels"]:
            print("   ", row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "verify-profile.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b")
