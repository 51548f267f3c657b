"""The performance targets, evaluated on a benchmark's own figures. Each verdict says what
was measured, the limit, and whether it held, so a miss reads with its size; a target
whose arms were asked for and did not run is there too, not judged and so not met.

Prefill, 16 to 512 tokens: full at least 5x over eager (qwen3-0.6b: the other presets
have no speed-up target but the gpt-oss slice's below); breakable at least 0.93 and
tc_piecewise with inductor pieces at least 0.9 of full's speed-up (every preset; full with
the attention backend eager, breakable and tc_piecewise ran: the same kernels, never a full
arm of another backend; full's own speed-up takes the fastest full arm where that one did
not run); the fastest graphcap arm on the peer's kernels (its attention backend) at least
10% faster than torch.compile reduce-overhead at every length (every preset), and at most
1.0 ms at 16 tokens (qwen3-0.6b; the decode issue asks 0.70 ms of short prefill, its own
verdict); runner overhead at most 10% of the replay at 16 tokens; GPU idle at most 10% of a full
replay. Build (42 shapes):
breakable at least 5.2x faster than tc_piecewise with inductor pieces and under 10 s.
Memory: the 42 shapes hold at most 1 GiB of graph pool; the transient peak of the largest
prefill cut by at least 95%; the serving peak (the largest prefill after the build) below
the no-graph baseline (the build's own peak is reported beside it). Stock transformers
models (the ``hf-`` arms): with graphcap kernels under breakable and full, at most 1.10x
the preset's time under the same strategy; faster than HF + reduce-overhead by 2x at 16
tokens, 1.35x at 512 and 1.2x at 2048 (qwen3-0.6b), by 1.1x at 16 to 128 tokens and never
slower (llama3-8b); the stock model's 42-shape build under breakable within 3 s.

The gpt-oss-120b slice (the seed's own table, SGLang's prefill of one request): full at
least 1.93x over eager at 16 to 512 tokens, breakable at least 0.95 and tc_piecewise
with inductor pieces at least 0.9 of full's speed-up; with the ladder captured, the
transient peak of the largest prefill at most 1% of eager's (cut by 99%).
"""

from __future__ import annotations

SMALL = (16, 32, 64, 128, 256, 512)
# Full's speed-up over eager at SMALL lengths (None: not a target of the preset), then
# breakable's and tc_piecewise-inductor's shares of it; by preset, else DEFAULT_SPEEDUP.
SPEEDUP = {"qwen3-0.6b": (5.0, 0.93, 0.9), "gpt-oss-120b-4l": (1.93, 0.95, 0.9),
           "gpt-oss-120b-4l-mxfp4": (1.93, 0.95, 0.9)}
DEFAULT_SPEEDUP = (None, 0.93, 0.9)
# The least cut of the largest prefill's transient peak against eager's, by preset.
TRANSIENT_CUT = {"gpt-oss-120b-4l": 0.99, "gpt-oss-120b-4l-mxfp4": 0.99}
GRAPHCAP = ("tc_piecewise-eager", "tc_piecewise-inductor", "breakable", "full-triton",
            "full-flashinfer", "full-flash_attn")


def verdict(what: str, measured: float, limit: float, *, at_least: bool) -> dict:
    met = measured >= limit if at_least else measured <= limit
    return {"target": what, "measured": round(measured, 4),
            "limit": f"{'>=' if at_least else '<='} {limit}", "met": bool(met)}


def not_judged(what: str, arms: list[str], skipped: dict) -> dict:
    """A target the run could not judge: ``arms``, which it needs, were asked for and did
    not run (``skipped`` says why). Not met: the run's exit status says a claim went
    unmeasured rather than that every target held."""
    why = "; ".join(f"{arm}: {skipped[arm]}" for arm in arms)
    return {"target": what, "measured": None, "limit": "-", "met": False,
            "not_judged": f"did not run: {why}"}


def unjudged(result: dict, needs: list[tuple[str, list[str]]]) -> list[dict]:
    """A :func:`not_judged` entry for each ``(target, arms)`` of ``needs`` whose arms the
    run asked for (those it ran or skipped; any of ``arms`` judges the target) all
    skipped: one of them running judges it, an arm not asked for is no claim."""
    skipped = result.get("skipped", {})
    ran = {arm for row in result.get("rows", []) for arm in row.get("ms", {})}
    out = []
    for what, arms in needs:
        asked = [arm for arm in arms if arm in skipped or arm in ran]
        if asked and all(arm in skipped for arm in asked):
            out.append(not_judged(what, asked, skipped))
    return out


def _best(ms: dict, names) -> tuple[str, float] | None:
    have = [(ms[n], n) for n in names if n in ms]
    return (min(have)[1], min(have)[0]) if have else None


def same_kernels_full(arms, attention: str | None) -> str | None:
    """The name of the full arm among ``arms`` that runs the attention backend the other
    arms share (the same kernels as eager), or None when it did not run."""
    name = f"full-{attention}"
    return name if name in arms else None


def prefill_targets(result: dict) -> list[dict]:
    out = []
    full_names = [n for n in GRAPHCAP if n.startswith("full-")]
    least, *shares = SPEEDUP.get(result.get("model"), DEFAULT_SPEEDUP)
    for row in result["rows"]:
        n, ms = row["tokens"], row["ms"]
        name = same_kernels_full(ms, result.get("attention"))
        # Full's own speed-up: the same-kernel full arm, else the fastest; the strategies'
        # shares of it only of the same kernels (another backend's would time kernels).
        full = (name, ms[name]) if name else _best(ms, full_names)
        fastest = _best(ms, GRAPHCAP)
        # The peer ran the run's attention backend: a claim about the runner is measured
        # against graphcap arms on the same kernels (a full arm of another backend is not).
        peer_kernels = _best(ms, [a for a in GRAPHCAP if not a.startswith("full-")]
                             + ([name] if name else []))
        if n in SMALL and full and "eager" in ms:
            full_x = ms["eager"] / full[1]
            if least is not None:
                out.append(verdict(f"{n} tokens: full ({full[0]}) speed-up over eager",
                                   full_x, least, at_least=True))
            for arm, share in zip(("breakable", "tc_piecewise-inductor"), shares,
                                  strict=True):
                if arm in ms and name:
                    out.append(verdict(f"{n} tokens: {arm} speed-up / {full[0]}'s",
                                       ms["eager"] / ms[arm] / full_x, share, at_least=True))
        if peer_kernels and "compile-reduce-overhead" in ms:
            out.append(verdict(f"{n} tokens: reduce-overhead ms ({result.get('attention')} "
                               f"attention) / fastest graphcap arm on its kernels "
                               f"({peer_kernels[0]}) ms",
                               ms["compile-reduce-overhead"] / peer_kernels[1], 1.1,
                               at_least=True))
        if n == 16 and fastest and result.get("model") == "qwen3-0.6b":  # its shape only
            out.append(verdict(f"16 tokens: fastest arm ({fastest[0]}) ms", fastest[1], 1.0,
                               at_least=False))
            out.append(verdict(f"16 tokens: fastest arm ({fastest[0]}) ms, the decode "
                               "issue's short prefill", fastest[1], 0.70, at_least=False))
    for key in ("runner_overhead", "runner_overhead_fastest"):
        # The target is 16 tokens' (a run from longer prompts measures its shortest, where
        # the replay is longer and the share smaller: no verdict on the 16-token limit).
        if result.get(key, {}).get("tokens") == 16:
            o = result[key]
            out.append(verdict(f"{o['tokens']} tokens: runner overhead / replay "
                               f"({o.get('arm', 'full')})",
                               o["overhead_share"], 0.10, at_least=False))
    for idle in result.get("idle", []):
        out.append(verdict(f"{idle['tokens']} tokens: GPU idle share of a "
                           f"{idle.get('arm', 'full')} replay",
                           idle["idle_share"], 0.10, at_least=False))
    small = any(row["tokens"] in SMALL for row in result["rows"])
    needs = [("reduce-overhead ms / fastest graphcap arm on its kernels",
              ["compile-reduce-overhead"])]
    if small:
        strategies = ("breakable", "tc_piecewise-inductor")
        needs += [("full's speed-up over eager and the shares of it", full_names),
                  *((f"{arm} speed-up / full's", [arm]) for arm in strategies)]
        if any(arm in row["ms"] for row in result["rows"] for arm in strategies):
            same = f"full-{result.get('attention')}"
            needs.append((f"{' and '.join(strategies)} speed-up / {same}'s", [same]))
    if result.get("model") in HF_VS_REDUCE_OVERHEAD:
        needs.append(("hf-compile-reduce-overhead ms / the stock model's graphcap arms' ms",
                      ["hf-compile-reduce-overhead"]))
    return out + hf_targets(result) + unjudged(result, needs)


# Stock transformers arms (graphcap.bench.hf): graphcap kernels in the stock model against
# graphcap's own preset under the same strategy, and against HF + reduce-overhead.
HF_VS_PRESET = 1.10
# Per preset: the floor of reduce-overhead's time over the arm's by length, and elsewhere.
HF_VS_REDUCE_OVERHEAD = {"qwen3-0.6b": ({16: 2.0, 512: 1.35, 2048: 1.2}, None),
                         "llama3-8b": ({16: 1.1, 32: 1.1, 64: 1.1, 128: 1.1}, 1.0)}


def hf_targets(result: dict) -> list[dict]:
    out = []
    floors, elsewhere = HF_VS_REDUCE_OVERHEAD.get(result.get("model"), ({}, None))
    for row in result["rows"]:
        n, ms = row["tokens"], row["ms"]
        preset_full = same_kernels_full(ms, result.get("attention"))
        for strategy, preset in (("breakable", "breakable"), ("full", preset_full)):
            arm = f"hf-{strategy}-graphcap"
            if arm not in ms:
                continue
            if preset in ms:
                out.append(verdict(f"{n} tokens: {arm} ms / the preset's {preset} ms",
                                   ms[arm] / ms[preset], HF_VS_PRESET, at_least=False))
            floor = floors.get(n, elsewhere)
            if "hf-compile-reduce-overhead" in ms and floor is not None:
                out.append(verdict(f"{n} tokens: hf-compile-reduce-overhead ms / {arm} ms",
                                   ms["hf-compile-reduce-overhead"] / ms[arm], floor,
                                   at_least=True))
    return out


def build_targets(arms: dict, model: str = "") -> list[dict]:
    out = []
    if "breakable" in arms:
        limit = 3.0 if model.startswith("hf") else 10.0  # a stock model: no compiler either
        out.append(verdict("breakable: 42-shape build seconds", arms["breakable"]["total_s"],
                           limit, at_least=False))
        if "tc_piecewise-inductor" in arms:
            out.append(verdict("tc_piecewise-inductor build s / breakable build s",
                               arms["tc_piecewise-inductor"]["total_s"]
                               / arms["breakable"]["total_s"], 5.2, at_least=True))
    return out


def memory_targets(result: dict) -> list[dict]:
    out = []
    cut = TRANSIENT_CUT.get(result.get("model"), 0.95)
    for arm, m in result["arms"].items():
        out.append(verdict(f"{arm}: graph pool GiB of the 42 shapes",
                           m["graph_pool_bytes"] / 2**30, 1.0, at_least=False))
        out.append(verdict(f"{arm}: transient peak of the largest prefill cut vs eager",
                           1 - m["transient_bytes"] / max(result["eager"]["transient_bytes"], 1),
                           cut, at_least=True))
        out.append(verdict(f"{arm}: serving peak GiB / no-graph baseline peak GiB",
                           m["peak_bytes"] / result["eager"]["peak_bytes"], 1.0,
                           at_least=False))
    return out
