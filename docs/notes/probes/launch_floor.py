"""What a decode step can reach when each kernel is a launch of its own, from recorded runs
(no GPU; reads docs/results):

    python3 docs/notes/probes/launch_floor.py

1. The cost of one launch that streams bytes: a least-squares line through the bare
   reads of ``2026-12-03-linear-floor-751a77d-h200.json`` (one launch reading a decode
   projection's weight, one row, CUDA graphs of launches over weights cycled past L2, PDL
   on): ``t = fixed + bytes / rate``.
2. For each target of the decode bench (``2026-12-04-bench-decode-*-edd8c81-h200.json``):
   the step's bytes at that rate, the time left for fixed costs, and the launches that
   leave; the step as its profile ran (kernels, their time against the line's for the
   bytes each read) and the step if every kernel it launches ran at the line's cost.
"""

import json
import pathlib
import statistics

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "results"
TARGETS = {("qwen3-0.6b", 1): 0.50, ("qwen3-0.6b", 8): 0.70, ("qwen3-0.6b", 64): 2.4,
           ("llama3-8b", 1): 4.0, ("llama3-8b", 8): 4.3, ("llama3-8b", 64): 6.3}
# Bytes each launch of a projection reads (bf16 weights): q/k/v, o, gate/up, down.
LINEARS = {"qwen3-0.6b": (8.39e6, 4.19e6, 12.58e6, 6.29e6),
           "llama3-8b": (50.33e6, 33.55e6, 234.88e6, 117.44e6)}
KV_PER_TOKEN_LAYER = {"qwen3-0.6b": 4096, "llama3-8b": 4096}  # K and V, 8 heads of 128
LAYERS = {"qwen3-0.6b": 28, "llama3-8b": 32}
LM_HEAD = {"qwen3-0.6b": 311.2e6, "llama3-8b": 1050.7e6}
CONTEXT = 1024


def launch_line() -> tuple[float, float, list]:
    """(fixed us, us per MB, [(MB, us)]) of one streaming launch."""
    record = json.loads((RESULTS / "2026-12-03-linear-floor-751a77d-h200.json").read_text())
    points = [(v["bytes"] / 1e6, v["read"]["us"]) for k, v in record["pdl_on"].items()
              if k.endswith("m=1")]
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope, points


def modelled_step(model: str, batch: int, fixed: float, per_mb: float) -> dict:
    """Every launch of today's step at the line's cost: the four projections and decode
    attention a layer, the LM head, and the small kernels as profiled (they stream
    little: q/k-norm and rotary, RMSNorm, SiLU-and-mul, the places and copies)."""
    layers = LAYERS[model]
    kv = batch * CONTEXT * KV_PER_TOKEN_LAYER[model] * 1e-6
    streams = [*LINEARS[model], kv * 1e6]
    per_layer = sum(fixed + b / 1e6 * per_mb for b in streams)
    return {"streaming_launches": layers * 5 + 1,
            "streaming_us": round(layers * per_layer + fixed + LM_HEAD[model] / 1e6 * per_mb,
                                  1)}


def main() -> None:
    fixed, per_mb, points = launch_line()
    print(f"one streaming launch: {fixed:.2f} us + bytes at {1 / per_mb:.2f} TB/s "
          f"(largest miss {max(abs(fixed + per_mb * x - y) for x, y in points):.2f} us "
          f"over {len(points)} reads of 4-235 MB)")
    for model in ("qwen3-0.6b", "llama3-8b"):
        record = json.loads((RESULTS / f"2026-12-04-bench-decode-{model}-edd8c81-h200.json")
                            .read_text())
        for row in record["models"][0]["rows"]:
            batch = row["batch"]
            target_us = TARGETS[(model, batch)] * 1e3
            bytes_us = row["bytes"] / 1e6 * per_mb
            budget = target_us - bytes_us
            profile = row["profile"]["full"]
            small = sum(k["us"] for k in profile["top_kernels"]
                        if not any(s in k["kernel"] for s in ("linear", "gemv", "nvjet",
                                                              "_decode_kernel")))
            step = modelled_step(model, batch, fixed, per_mb)
            print(f"\n{model} batch {batch}: target {target_us / 1e3:.2f} ms, bytes "
                  f"{row['bytes'] / 1e6:.0f} MB = {bytes_us:.0f} us at the line's rate; "
                  f"{budget:.0f} us left for fixed costs = {budget / fixed:.0f} launches "
                  f"({budget / fixed / LAYERS[model]:.1f} a layer)")
            print(f"  today: {profile['kernels']:.0f} kernels, back to back "
                  f"{row['ms_back_to_back']['full']:.3f} ms")
            print(f"  its {step['streaming_launches']} streaming launches (4 projections "
                  f"and attention a layer, the LM head) at the line's cost: "
                  f"{step['streaming_us'] / 1e3:.3f} ms, plus {small:.0f} us of small "
                  f"kernels as profiled = {(step['streaming_us'] + small) / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
