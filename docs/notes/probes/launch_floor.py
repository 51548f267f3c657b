"""What a decode step can reach when each kernel is a launch of its own, from recorded runs
(no GPU; reads docs/results):

    PYTHONPATH=. python3 docs/notes/probes/launch_floor.py

1. The cost of one launch that streams bytes: a least-squares line
   (:func:`graphcap.bench.launch_line.fit`) through the bare reads of
   ``2026-12-03-linear-floor-751a77d-h200.json`` (one launch reading a decode
   projection's weight, one row, CUDA graphs of launches over weights cycled past L2, PDL
   on): ``t = fixed + bytes / rate``. ``graphcap bench decode`` measures the same line
   on its own device (:func:`graphcap.bench.launch_line.measure`).
2. For each target of the decode bench (``2026-12-04-bench-decode-*-edd8c81-h200.json``):
   the step's bytes at that rate, the time left for fixed costs, and the launches that
   leave; today's step (kernels, back to back); and the floor of four projections and
   attention a layer as launches of their own at the line's cost
   (:func:`graphcap.bench.launch_line.decode_floor_ms`), plus the small kernels as
   profiled.
"""

import json
import pathlib

from graphcap.bench.launch_line import decode_floor_ms, fit
from graphcap.models import PRESETS

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "results"
TARGETS = {("qwen3-0.6b", 1): 0.50, ("qwen3-0.6b", 8): 0.70, ("qwen3-0.6b", 64): 2.4,
           ("llama3-8b", 1): 4.0, ("llama3-8b", 8): 4.3, ("llama3-8b", 64): 6.3}
CONTEXT = 1024


def recorded_line() -> dict:
    """The line of one streaming launch through the recorded bare reads (one row)."""
    record = json.loads((RESULTS / "2026-12-03-linear-floor-751a77d-h200.json").read_text())
    return fit([(v["bytes"], v["read"]["us"]) for k, v in record["pdl_on"].items()
                if k.endswith("m=1")])


def main() -> None:
    line = recorded_line()
    per_mb = 1e12 / line["bytes_per_s"]  # us a MB
    print(f"one streaming launch: {line['fixed_us']:.2f} us + bytes at "
          f"{line['bytes_per_s'] / 1e12:.2f} TB/s (largest miss {line['largest_miss_us']:.2f} "
          f"us over {len(line['points'])} reads of 4-235 MB)")
    for model in ("qwen3-0.6b", "llama3-8b"):
        record = json.loads((RESULTS / f"2026-12-04-bench-decode-{model}-edd8c81-h200.json")
                            .read_text())
        args = PRESETS[model]
        for row in record["models"][0]["rows"]:
            batch = row["batch"]
            target_us = TARGETS[(model, batch)] * 1e3
            bytes_us = row["bytes"] / 1e6 * per_mb
            budget = target_us - bytes_us
            profile = row["profile"]["full"]
            small = sum(k["us"] for k in profile["top_kernels"]
                        if not any(s in k["kernel"] for s in ("linear", "gemv", "nvjet",
                                                              "_decode_kernel")))
            floor = decode_floor_ms(args, batch, CONTEXT, line)
            print(f"\n{model} batch {batch}: target {target_us / 1e3:.2f} ms, bytes "
                  f"{row['bytes'] / 1e6:.0f} MB = {bytes_us:.0f} us at the line's rate; "
                  f"{budget:.0f} us left for fixed costs = {budget / line['fixed_us']:.0f} "
                  f"launches ({budget / line['fixed_us'] / args.layers:.1f} a layer)")
            print(f"  today: {profile['kernels']:.0f} kernels, back to back "
                  f"{row['ms_back_to_back']['full']:.3f} ms")
            print(f"  its {5 * args.layers + 1} streaming launches (4 projections and "
                  f"attention a layer, the LM head) at the line's cost: {floor:.3f} ms, plus "
                  f"{small:.0f} us of small kernels as profiled = {floor + small / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
