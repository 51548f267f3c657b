"""``graphcap demo``: capture a small MLP, replay it on fresh inputs, check it against eager."""

from __future__ import annotations

import time

import torch

from graphcap.core.graphs import new_pool


def _ms(fn, device: torch.device, reps: int = 20) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / reps


def mlp(width: int = 256, depth: int = 6) -> torch.nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.SiLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, width))


def strategies_table(device: torch.device, steps: int) -> bool:
    """The tiny reference decoder under every strategy, against eager; True if all match."""
    import graphcap
    from graphcap.api import GRAPHED
    from graphcap.bench.report import print_table
    from graphcap.core.buckets import prefill_ladder
    from graphcap.models import build_model
    from graphcap.progress import progress

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model("tiny", device=device, dtype=dtype)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    batches = [[37, 12], [5], [64, 64, 3], [1, 1, 1, 1], [200]][:max(steps, 1)]
    truth = graphcap.capture(model, "eager", buckets=[256], max_requests=4,
                             attention="torch_masked")
    print(f"\ntiny decoder ({model.args.layers} layers) on {device}, the default ladder to "
          "256 tokens, 4 request slots, attention torch_masked")
    ids64 = torch.randint(1, model.args.vocab_size, (64,), device=device)
    pos64 = torch.arange(64, device=device)
    eager_ms = _ms(lambda: truth(ids64, pos64, seq_lens=[64]), device, 5)
    print(f"eager: {eager_ms:.2f} ms for a 64-token prompt")
    rows, ok = [], True
    with progress(len(GRAPHED) * len(prefill_ladder(256)), "capturing") as step:
        for strategy in GRAPHED:
            start = time.perf_counter()
            runner = graphcap.capture(model, strategy, max_tokens=256, max_requests=4,
                                      attention="torch_masked",
                                      progress=lambda done, total, s=strategy: step(s))
            build = time.perf_counter() - start
            worst = 0.0
            for seed, lens in enumerate(batches):
                gen = torch.Generator().manual_seed(seed)
                ids = torch.randint(1, model.args.vocab_size, (sum(lens),), generator=gen)
                ids = ids.to(device)
                pos = torch.cat([torch.arange(n) for n in lens]).to(device)
                got = runner(ids, pos, seq_lens=lens)
                worst = max(worst, (got - truth(ids, pos, seq_lens=lens)).abs().max().item())
            replay = _ms(lambda r=runner: r(ids64, pos64, seq_lens=[64]), device, 5)
            rep = runner.report()
            top = rep["shapes"][-1]
            good = worst <= tol
            ok &= good
            rows.append([strategy, str(len(rep["shapes"])), str(rep["segments"][top]),
                         str(rep["breaks"][top]), f"{rep['graph_pool_bytes'] / 1024:.0f}",
                         f"{build:.2f}", f"{replay:.2f}", f"{worst:.2e}",
                         str(sum(rep["fallbacks"].values())), "yes" if good else "NO"])
    if device.type != "cuda":
        print("(CPU: graphs run on the emulator, which re-runs every recorded op through "
              "a dispatch mode; its timings say nothing about GPUs)")
    print_table("replay against eager", ["strategy", "shapes", "segments", "breaks",
                                         "pool KiB", "build s", "64-token ms",
                                         "max err", "fallbacks", "match"], rows)
    return ok


def run_demo(device: str | None = None, steps: int = 5, tokens: int = 64) -> int:
    """Capture, replay ``steps`` fresh inputs, print a table; exit status 1 on mismatch."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model = mlp().to(device).eval()
    pool = new_pool(device)
    static_x = torch.randn(tokens, 256, device=device)
    with torch.inference_mode():
        with pool.warmup():
            model(static_x)
        graph = pool.graph()
        start = time.perf_counter()
        static_y = graph.capture(model, static_x)
        capture_s = time.perf_counter() - start

        print(f"graphcap demo: {type(model).__name__} of {len(model)} modules, {tokens} tokens "
              f"on {device} ({pool.kind} graph, torch {torch.__version__})")
        print(f"captured in {capture_s * 1e3:.1f} ms, {graph.bytes_held / 2**10:.0f} KiB held\n")
        print(f"{'step':>4}  {'max |replay - eager|':>20}  {'match':>5}")
        worst = 0.0
        for step in range(steps):
            fresh = torch.randn(tokens, 256, device=device)
            static_x.copy_(fresh)
            graph.replay()
            err = (static_y - model(fresh)).abs().max().item()
            worst = max(worst, err)
            print(f"{step:>4}  {err:>20.3e}  {'yes' if err < 1e-4 else 'NO':>5}")

        eager_ms = _ms(lambda: model(static_x), device)
        replay_ms = _ms(graph.replay, device)
    print(f"\neager {eager_ms:.3f} ms, replay {replay_ms:.3f} ms per forward "
          f"({eager_ms / replay_ms:.2f}x)")
    if pool.emulated:
        print("(the CPU emulator re-runs recorded ops: its timings say nothing about GPUs)")
    ok = worst < 1e-4 and strategies_table(device, steps)
    print("\nreplay matches eager" if ok else "\nMISMATCH between replay and eager")
    return 0 if ok else 1
