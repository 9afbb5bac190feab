"""msModelSlim's calibration dataset names in ``spec.dataset``: read from an installed msModelSlim,
``mix_calib.jsonl`` mapped to msquant's shipped set, every other name refused clearly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import msquant.load.calibration as calibration
from msquant import CalibrationDataError
from msquant.load.calibration import default_dataset_path, resolve_dataset_path
from msquant.load.msmodelslim_datasets import MSMODELSLIM_TEXT_SETS, msmodelslim_lab_calib


@pytest.fixture
def no_msmodelslim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "msmodelslim_lab_calib", lambda: None)


@pytest.fixture
def fake_lab_calib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "site" / "msmodelslim" / "lab_calib"
    folder.mkdir(parents=True)
    (folder / "boolq.jsonl").write_text('{"inputs_pretokenized": "is it?"}\n', encoding="utf-8")
    (folder / "mix_calib.jsonl").write_text('{"inputs_pretokenized": "mix"}\n', encoding="utf-8")
    monkeypatch.setattr(calibration, "msmodelslim_lab_calib", lambda: folder)
    return folder


def test_known_name_without_msmodelslim_is_refused(no_msmodelslim: None, tmp_path: Path) -> None:
    with pytest.raises(CalibrationDataError) as info:
        resolve_dataset_path("boolq.jsonl", tmp_path)
    message = str(info.value)
    assert "spec.dataset 'boolq.jsonl' names a calibration set shipped with msModelSlim" in message
    assert "install msmodelslim" in message and "--calib_path" in message


def test_media_set_is_refused_as_multimodal(no_msmodelslim: None, tmp_path: Path) -> None:
    with pytest.raises(CalibrationDataError, match="image/video calibration sets"):
        resolve_dataset_path("calibImages", tmp_path)


def test_default_name_maps_to_the_shipped_set(no_msmodelslim: None, tmp_path: Path) -> None:
    assert resolve_dataset_path("mix_calib.jsonl", tmp_path) == default_dataset_path()


def test_installed_msmodelslim_provides_its_sets(fake_lab_calib: Path, tmp_path: Path) -> None:
    assert resolve_dataset_path("boolq.jsonl", tmp_path) == fake_lab_calib / "boolq.jsonl"
    assert resolve_dataset_path("mix_calib.jsonl", tmp_path) == fake_lab_calib / "mix_calib.jsonl"
    # a name it lacks is still refused, not silently replaced
    with pytest.raises(CalibrationDataError, match="cn_en.jsonl"):
        resolve_dataset_path("cn_en.jsonl", tmp_path)


def test_user_files_win_over_msmodelslim_names(fake_lab_calib: Path, tmp_path: Path) -> None:
    (tmp_path / "boolq.jsonl").write_text('{"text": "mine"}\n', encoding="utf-8")
    assert resolve_dataset_path("boolq.jsonl", tmp_path) == tmp_path / "boolq.jsonl"
    assert resolve_dataset_path("other.jsonl", tmp_path) == Path("other.jsonl")


def test_lab_calib_is_located_without_importing_msmodelslim(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = tmp_path / "msmodelslim"
    (package / "lab_calib").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert msmodelslim_lab_calib() == package / "lab_calib"


def test_the_name_list_covers_the_shipped_configs_text_sets() -> None:
    # every text set named by msModelSlim's v1 configs (mix_calib, test, qwen3_cot_w4a4, ...)
    for name in ("mix_calib.jsonl", "test.json", "qwen3_cot_w4a4.json", "laos_calib.jsonl"):
        assert name in MSMODELSLIM_TEXT_SETS


def test_cli_refuses_an_unresolvable_name_before_loading_weights(
    tiny_llama: Path,
    tmp_path: Path,
    run_cli: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(calibration, "msmodelslim_lab_calib", lambda: None)
    config = tmp_path / "c.yaml"
    config.write_text(
        "spec:\n  process:\n    - type: linear_quant\n      qconfig:\n"
        "        weight: {scope: per_channel, dtype: int8, symmetric: true, method: gptq}\n"
        "  dataset: cn_en.jsonl\n",
        encoding="utf-8",
    )
    result = run_cli(
        "quant",
        "--model_path",
        tiny_llama,
        "--save_path",
        tmp_path / "out",
        "--config_path",
        config,
    )
    assert result.code == 2
    assert (
        "spec.dataset 'cn_en.jsonl' names a calibration set shipped with msModelSlim" in result.err
    )
    assert "Traceback" not in result.err
    assert not (tmp_path / "out").exists()
