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


def test_msmodelslim_configs_table_names_what_is_missing(tmp_path: Path) -> None:
    """bench/msmodelslim_configs.py on a stand-in wheel (no download): one row per config, the
    verdict of ``msquant validate`` and, for a refusal, what msquant lacks."""
    import zipfile

    weight = "{scope: per_channel, dtype: int8, symmetric: true, method: %s}"
    valid = (
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: group\n      configs:\n"
        f"        - {{type: linear_quant, qconfig: {{weight: {weight % 'minmax'}}}}}\n"
    )
    refused = (
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: flatquant\n"
        f"    - {{type: linear_quant, qconfig: {{weight: {weight % 'mse_round'}}}}}\n"
    )
    wheel = tmp_path / "msmodelslim-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("msmodelslim/lab_practice/a/valid.yaml", valid)
        archive.writestr("msmodelslim/lab_practice/b/refused.yaml", refused)
        archive.writestr("msmodelslim/lab_practice/c/old.yaml", "apiversion: modelslim_v0\n")
        archive.writestr("msmodelslim/core/template.yaml", "steps: [1, 2]\n")  # not a config
    out = subprocess.run(
        [sys.executable, str(BENCH / "msmodelslim_configs.py"), "--wheel", str(wheel)],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    rows = {line.split("\t")[0]: line.split("\t") for line in out.splitlines() if "\t" in line}
    assert set(rows) == {"file", "a/valid.yaml", "b/refused.yaml", "c/old.yaml"}
    assert rows["a/valid.yaml"][2:5] == ["W8A16 minmax", "group[linear_quant]", "valid"]
    assert rows["b/refused.yaml"][4:6] == ["refused (2)", "method mse_round; processor flatquant"]
    assert rows["b/refused.yaml"][6].startswith("spec.process[0].type: unknown processor type")
    assert rows["c/old.yaml"][5] == "apiversion 'modelslim_v0'"
    assert "modelslim_v1: 1 of 2 validate" in out
    assert "lab_practice: 1 of 3 validate" in out


def test_msmodelslim_configs_run_quantizes_verifies_and_reports(tmp_path: Path) -> None:
    """``--run`` on a stand-in wheel: a valid config of a known family is quantized on that
    family's tiny model and verified; one a tiny model cannot satisfy is reported with msquant's
    own error line (not a traceback), one of an unknown family is reported as not run; refused
    files are not run at all."""
    import json
    import zipfile

    w8a16 = (
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: linear_quant\n      qconfig:\n"
        "        weight: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}\n"
    )
    no_match = w8a16 + "      include: ['*.no_such_linear']\n"
    wheel = tmp_path / "msmodelslim-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("msmodelslim/lab_practice/default/ok.yaml", w8a16)
        archive.writestr("msmodelslim/lab_practice/default/nothing.yaml", no_match)
        archive.writestr("msmodelslim/lab_practice/unheard_of/x.yaml", w8a16)
        archive.writestr("msmodelslim/lab_practice/default/old.yaml", "apiversion: modelslim_v0\n")
    out = subprocess.run(
        [sys.executable, str(BENCH / "msmodelslim_configs.py"), "--wheel", str(wheel), "--run",
         "--run_dir", str(tmp_path / "runs"), "--run_json", str(tmp_path / "runs.json")],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    runs = {r["file"]: r for r in json.loads((tmp_path / "runs.json").read_text())}
    assert set(runs) == {"default/ok.yaml", "default/nothing.yaml", "unheard_of/x.yaml"}
    assert runs["default/ok.yaml"]["model"] == "Llama"
    assert runs["default/ok.yaml"]["verdict"] == "exported+verified"
    assert (tmp_path / "runs" / "ok" / "export" / "quant_model_description.json").is_file()
    assert runs["default/nothing.yaml"]["verdict"] == "refused"
    assert runs["default/nothing.yaml"]["detail"].startswith("msquant: error:")
    assert runs["unheard_of/x.yaml"]["verdict"] == "not run"
    assert "no tiny model for family 'unheard_of'" in runs["unheard_of/x.yaml"]["detail"]
    assert "run, modelslim_v1: 3 valid files: " in out and "1 exported+verified" in out


def test_activation_practices_bench_finds_every_shipped_activation_config() -> None:
    """bench/activation_practices.py's rows: the W8A16 reference, every example and practice
    that quantizes activations (also inside a group), each tagged with what it runs first."""
    sys.path.insert(0, str(BENCH))
    try:
        import activation_practices
    finally:
        sys.path.remove(str(BENCH))
    rows = {row.name: row.transforms for row in activation_practices.discover_rows()}
    assert set(rows) == {
        "w8a16_per_channel_minmax",
        "w4a8_dynamic_quarot",
        "w8a8_dynamic_flex_smooth",
        "w8a8_dynamic_iter_smooth",
        "w8a8_dynamic_per_token",
        "w8a8_fp8",
        "w8a8_static_flex_smooth",
        "w8a8_static_iter_smooth",
        "w8a8_static_per_tensor_asym",
        "--quant_type w4a8",
        "--quant_type w8a8",
    }
    assert list(rows)[0] == "w8a16_per_channel_minmax"
    assert rows["w8a8_dynamic_per_token"] == () and rows["--quant_type w4a8"] == ()
    assert rows["w8a8_fp8"] == ()
    assert rows["w8a8_static_flex_smooth"] == ("flex_smooth_quant",)
    assert rows["--quant_type w8a8"] == ("iter_smooth",)
    assert rows["w4a8_dynamic_quarot"] == ("quarot",)
