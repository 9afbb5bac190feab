"""The benchmark scripts keep running (small sizes; their numbers are read by people, not asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_accuracy_bench_texts_are_plain_prose_and_disjoint() -> None:
    """The accuracy bench's text preparation: MediaWiki markup becomes prose (links to their
    labels, templates, references, tables, files and back matter dropped), articles alternate
    between calibration and held-out sides, and windows are consecutive and exact."""
    sys.path.insert(0, str(BENCH))
    try:
        import eval_texts
    finally:
        sys.path.remove(str(BENCH))
    raw = (
        "{{Infobox person|name=X {{nested|a}}}}\n"
        "'''Ada''' was a [[mathematician]] from [[London|the capital]].<ref>Cite</ref> "
        "She wrote [http://example.org notes].<!-- hidden -->\n\n"
        "== Work ==\n* Analytical [[Engine]]\n{| class=wikitable\n|-\n| cell\n|}\n"
        "[[File:Ada.jpg|thumb|A [[portrait]]]]\n[[Category:People]]\n\n"
        "== References ==\nBooks that are not prose.\n"
    )
    assert eval_texts.wiki_plain_text(raw) == (
        "Ada was a mathematician from the capital. She wrote notes.\n\nWork\nAnalytical Engine"
    )
    calib, held = eval_texts.split_articles(["a", "b", "c", "d", "e"])
    assert (calib, held) == (["a", "c", "e"], ["b", "d"])
    windows = eval_texts.token_windows(["x y", "z"], lambda t: list(range(len(t))), 2, 3)
    assert windows == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="fewer than 3 x 3"):
        eval_texts.token_windows(["x y", "z"], lambda t: list(range(len(t))), 3, 3)
