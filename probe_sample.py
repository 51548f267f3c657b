import json, os, torch
from graphcap.opsdb.sample import sample_reference
V = 151936
out = {}
for B in (1, 8, 64):
    logits = torch.randn(B, V, device="cuda", dtype=torch.bfloat16)
    t = torch.zeros(B, device="cuda"); k = torch.zeros(B, dtype=torch.long, device="cuda")
    p = torch.ones(B, device="cuda"); seed = torch.arange(B, device="cuda"); ctr = torch.arange(B, device="cuda")
    for name, fn in (("reference", lambda: sample_reference(logits, t, k, p, seed, ctr)),
                     ("argmax", lambda: logits.argmax(-1))):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            fn(); fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(5): g.replay()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(50): g.replay()
        b.record(); torch.cuda.synchronize()
        out[f"{name} B={B}"] = round(a.elapsed_time(b) / 50, 4)
print(json.dumps(out))
