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
    ok = worst < 1e-4
    print("replay matches eager" if ok else "MISMATCH between replay and eager")
    return 0 if ok else 1
