"""The fused q/k/v kernel (``graphcap.opsdb.triton.qkv``) with a program a head against its
tiles of several heads (device side):

    PYTHONPATH=. python3 docs/notes/probes/qkv_tiles.py

Per shape (qwen3-0.6b: 16 q, 8 k/v heads of 128 with qk-norm; gpt-oss: 64 q, 8 k/v heads
of 64 without) and token count: device microseconds of one call (graphed_ms: 20 calls a
graph), the library's heads a program against one head a program (``PROGRAMS`` set past
any grid), and whether both give the same bits. JSON in $OUT/qkv-tiles.json."""

import functools
import json
import os

import torch

from graphcap.bench.common import environment
from graphcap.bench.timing import graphed_ms
from graphcap.opsdb.reference import rope_cache
from graphcap.opsdb.triton import qkv as kernel

SHAPES = {"qwen3-0.6b": (16, 8, 128, True), "gpt-oss": (64, 8, 64, False)}
TOKENS = (1, 16, 64, 128, 512, 2048)


def main() -> None:
    rows = []
    library = kernel.PROGRAMS
    for name, (hq, hk, d, norm) in SHAPES.items():
        cache = rope_cache(d, 4096, 1e6).cuda()
        w = [torch.rand(d, device="cuda").bfloat16() + 0.5 for _ in range(2)] if norm \
            else [None, None]
        for tokens in TOKENS:
            qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda").bfloat16()
            pos = torch.randint(0, 4096, (tokens,), device="cuda")
            args = (qkv, pos, w[0], w[1], cache, hq, hk, d, 1e-6)
            row = {"shape": name, "tokens": tokens}
            outs = {}
            for label, programs in (("per_head", 1 << 40), ("tiles", library)):
                kernel.PROGRAMS = programs
                row[f"{label}_heads"] = kernel.heads_per_program(hq + 2 * hk, tokens, d)
                outs[label] = kernel.qkv_norm_rope(*args)
                row[f"{label}_us"] = round(1000 * graphed_ms(
                    functools.partial(kernel.qkv_norm_rope, *args), calls=20, reps=10), 2)
            kernel.PROGRAMS = library
            row["same_bits"] = all(torch.equal(a, b) for a, b in
                                   zip(outs["per_head"], outs["tiles"], strict=True))
            print(row, flush=True)
            rows.append(row)
    out = {"what": "the fused q/k/v kernel, a program a head against tiles of heads "
                   "(docs/notes/probes/qkv_tiles.py)", **environment(), "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "qkv-tiles.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
