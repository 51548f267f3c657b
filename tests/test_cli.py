"""The graphcap command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, "-m", "graphcap", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_ops_lists_every_op_with_backends_fake_and_tags_as_json():
    proc = run("ops", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    ops = {row["op"]: row for row in json.loads(proc.stdout)["ops"]}
    assert {"graphcap::rms_norm", "graphcap::silu_and_mul", "graphcap::rotary_embedding",
            "graphcap::fused_add_rms_norm", "graphcap::moe_topk_softmax",
            "graphcap::moe_experts"} <= set(ops)
    norm = ops["graphcap::rms_norm"]
    assert norm["backends"]["torch"] == "available"
    assert norm["backends"]["flashinfer"] != "available"  # says why instead
    assert norm["fake"] == "derived" and ops["graphcap::moe_experts"]["fake"] == "given"
    assert norm["capturable"] is True and norm["split"] is False


def test_demo_replays_match_eager_and_print_a_table():
    proc = run("demo", "--device", "cpu", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "replay matches eager" in proc.stdout and "max |replay - eager|" in proc.stdout
