"""Showing benchmark results: a rich table (plain text without rich) and PNG plots (with
matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path


def style(i: int) -> dict:
    """Arm ``i``'s colour and marker: matplotlib's ten colours, then the next marker, so no
    two arms of a plot look alike."""
    return {"color": f"C{i % 10}", "marker": "os^Dv"[i // 10 % 5]}


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for line in [header, *rows]:
            print("  ".join(f"{c:>12}" for c in line))
        return
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    import sys

    Console(width=None if sys.stdout.isatty() else 160).print(table)


def show_targets(targets: list[dict]) -> None:
    print_table("targets", ["target", "measured", "limit", "met"],
                 [[t["target"], str(t["measured"]), t["limit"],
                   "NOT JUDGED" if "not_judged" in t else "yes" if t["met"] else "MISS"]
                  for t in targets])
    for t in targets:
        if "not_judged" in t:
            print(f"  not judged: {t['target']}: {t['not_judged']}")


def show_prefill(result: dict) -> None:
    for model in result["models"]:
        arms = [a for a in result["arms"] if a in model["rows"][0]["ms"]]
        rows = []
        for row in model["rows"]:
            eager = row["ms"].get("eager")
            cells = [str(row["tokens"])]
            for a in arms:
                ms = row["ms"][a]
                cells.append(f"{ms:.3f}" + (f" ({eager / ms:.1f}x)" if eager else ""))
            rows.append(cells)
        print_table(f"{model['model']}: ms per prefill (speed-up over eager)",
                     ["tokens", *arms], rows)
        if model["skipped"]:
            for arm, why in model["skipped"].items():
                print(f"  not run: {arm}: {why}")
        for idle in model.get("idle", []):
            if idle.get("top_kernels"):
                print_table(f"{model['model']}: kernels of one {idle.get('arm', 'full')} replay at "
                            f"{idle['tokens']} tokens ({idle['kernel_ms']} ms of kernels, "
                            f"{idle.get('busy_ms', idle['kernel_ms'])} ms busy, "
                            f"{idle['wall_ms']} ms wall)",
                            ["kernel", "launches", "us", "share"],
                            [[k["kernel"][:60], str(k["launches"]), str(k["us"]),
                              f"{k['share']:.1%}"] for k in idle["top_kernels"]])
        show_targets(model["targets"])


def wider_table(model: dict) -> int | None:
    """The tokens of a decode result's block tables where they are wider than its context
    and the step's token (``bench decode --max-len``, as an engine's ``max_len``), else
    None (and in results written before ``max_len`` was recorded)."""
    table = model.get("max_len", model["context"] + 1)
    return table if table != model["context"] + 1 else None


def show_decode(result: dict) -> None:
    line = result.get("launch_line")
    if line and "failed" in line:
        print(f"the launch line was not measured: {line['failed']}")
    elif line:
        print(f"one streaming launch on this device: {line['fixed_us']:.2f} us + bytes at "
              f"{line['bytes_per_s'] / 1e12:.2f} TB/s (largest miss "
              f"{line['largest_miss_us']:.2f} us)")
    for model in result["models"]:
        arms = [a for a in result["arms"] if any(a in r["ms"] for r in model["rows"])]
        launch = any(r.get("launch_floor_ms") is not None for r in model["rows"])
        rows = []
        for row in model["rows"]:
            eager = row["ms"].get("eager")
            floors = [f"{row['floor_ms']:.3f}"] + (
                [f"{row['launch_floor_ms']:.3f}" if row.get("launch_floor_ms") else "-"]
                if launch else [])
            rows.append([str(row["batch"]), *floors] + [
                (f"{row['ms'][a]:.3f}" + (f" ({eager / row['ms'][a]:.1f}x)" if eager else ""))
                if a in row["ms"] else "-" for a in arms])
        table = wider_table(model)
        print_table(f"{model['model']}: ms per decode step at a {model['context']}-token "
                    "context" + (f" in {table}-token tables" if table else "")
                    + " (speed-up over eager), beside the bandwidth floor"
                    + (" and the floor of a launch per projection and attention"
                       if launch else ""),
                    ["batch", "floor", *(["launch floor"] if launch else []), *arms], rows)
        fed = [a for a in arms if any(a in r.get("ms_back_to_back", {}) for r in model["rows"])]
        if fed:
            print_table(f"{model['model']}: ms per step, steps fed back to back",
                        ["batch", *fed], [[str(r["batch"])] + [
                            f"{r['ms_back_to_back'][a]:.3f}" if a in r.get(
                                "ms_back_to_back", {}) else "-" for a in fed]
                            for r in model["rows"]])
        hosted = [a for a in arms if any(a in r.get("host_us", {}) for r in model["rows"])]
        if hosted:
            print_table(f"{model['model']}: host us of a call from an idle device",
                        ["batch", *hosted], [[str(r["batch"])] + [
                            f"{r['host_us'][a]:.0f}" if a in r.get("host_us", {}) else "-"
                            for a in hosted] for r in model["rows"]])
        profiled = [(row["batch"], arm, p) for row in model["rows"]
                    for arm, p in row.get("profile", {}).items() if p.get("kernels")]
        if profiled:
            print_table(f"{model['model']}: kernels per step and GPU idle share",
                        ["batch", "arm", "kernels", "idle"],
                        [[str(b), arm, str(p["kernels"]), f"{p['idle_share']:.1%}"]
                         for b, arm, p in profiled])
        for arm, why in model["skipped"].items():
            print(f"  not run: {arm}: {why}")
        if model.get("targets"):
            show_targets(model["targets"])


def show_ladder(result: dict) -> None:
    first = next(iter(result["arms"].values()))
    keys = [k for k, v in first.items() if not isinstance(v, list | dict)]
    print_table(result["what"], ["arm", *keys],
                 [[arm, *(str(v[k]) for k in keys)] for arm, v in result["arms"].items()])
    cached = {arm: v["pt2_cache"] for arm, v in result["arms"].items()
              if v.get("pt2_cache", {}).get("hit")}
    if cached:
        print("torch.compile cache lookups (code an earlier process compiled): " + ", ".join(
            f"{arm} {c['hit']} hit, {c['miss']} miss" for arm, c in cached.items()))
    if "kernel_warmup_s" in result:
        print(f"kernels JIT-compiled before the arms (one eager forward per shape, "
              f"no arm charged): {result['kernel_warmup_s']} s")
    show_targets(result["targets"])


def _pyplot():
    """matplotlib's pyplot drawing to files, or None (said once per plot) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'torch-graphcap[bench]'): no plot")
        return None
    return plt


def plot_prefill(result: dict, path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    models = result["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        lengths = [r["tokens"] for r in model["rows"]]
        arms = list(model["rows"][0]["ms"])
        for i, arm in enumerate(arms):  # one colour per arm in both panels
            ms = [r["ms"][arm] for r in model["rows"]]
            axes[0][col].plot(lengths, ms, label=arm, **style(i))
            if arm != "eager" and "eager" in arms:
                axes[1][col].plot(lengths, [r["ms"]["eager"] / r["ms"][arm]
                                            for r in model["rows"]], label=arm, **style(i))
        for ax, ylabel in ((axes[0][col], "ms per prefill"), (axes[1][col], "x over eager")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(model["model"])
        axes[0][col].legend(fontsize=7)
        axes[1][col].legend(fontsize=7)
    fig.suptitle(f"prefill, one request, {result['device']}, commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_decode(result: dict, path: Path) -> Path | None:
    """ms per decode step against the batch size, one panel per (model, context), every
    arm beside the bandwidth floor (and, where measured, the launch floor)."""
    plt = _pyplot()
    if plt is None:
        return None
    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    arms = list(result["arms"])
    for ax, model in zip(axes[0], models, strict=True):
        batches = [r["batch"] for r in model["rows"]]
        ax.plot(batches, [r["floor_ms"] for r in model["rows"]], color="k", linestyle="--",
                label="bandwidth floor")
        launch = [(r["batch"], r["launch_floor_ms"]) for r in model["rows"]
                  if r.get("launch_floor_ms")]
        if launch:
            ax.plot(*zip(*launch, strict=True), color="k", linestyle=":",
                    label="a launch per projection and attention")
        for i, arm in enumerate(arms):  # one colour per arm in every panel
            points = [(r["batch"], r["ms"][arm]) for r in model["rows"] if arm in r["ms"]]
            if points:
                ax.plot(*zip(*points, strict=True), label=arm, **style(i))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("ms per decode step")
        table = wider_table(model)
        ax.set_title(f"{model['model']}, context {model['context']}"
                     + (f", tables of {table}" if table else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode, {result['device']}, commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def show_tp(result: dict) -> None:
    tp = result["tp"]
    for model in result["models"]:
        arms = [a for a in result["arms"] if any(a in r["tp_over_1"] for r in model["ratios"])]
        split = {r["tokens"]: r["ms"] for r in model[f"tp{tp}"]["rows"]}
        rows = [[str(r["tokens"])] + [
            f"{split[r['tokens']][a]:.3f} ({r['tp_over_1'][a]:.2f}x)" if a in r["tp_over_1"]
            else "-" for a in arms] for r in model["ratios"]]
        print_table(f"{model['model']}: ms per prefill at TP={tp} (its ratio to TP=1)",
                    ["tokens", *arms], rows)
        for size in (1, tp):
            for arm, why in model[f"tp{size}"].get("skipped", {}).items():
                print(f"  not run at TP={size}: {arm}: {why}")
        show_targets(model["targets"])
