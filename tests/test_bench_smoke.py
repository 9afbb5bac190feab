"""The benchmark scripts keep running (small sizes; their numbers are read by people, not asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_gptq_layer_bench_runs_and_gptq_beats_rtn() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "gptq_layer.py"), "--size", "256"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    assert "float32 256^3 matmul" in out and "Hessian:" in out
    held_out = re.findall(r"held-out: GPTQ ([\d.]+)\s+RTN ([\d.]+)", out)
    assert len(held_out) == 3  # one line per configuration
    assert all(float(gptq) < float(rtn) for gptq, rtn in held_out)
