"""Exporters never leave a half-written model: a write failing mid-way (disk full) keeps the
previous export byte for byte and leaves no staging folder; unsafe names never reach the disk."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import msquant
import msquant.export.shards as shards
from msquant import OutputPathError
from msquant.plugin.export import safe_file_stem
from msquant.processors.formats.ascend.saver import AscendV1Saver, AscendV1SaverConfig

SAVERS = ["ascendv1_saver", "mindie_format_saver", "gptq_saver", "compressed_tensors"]


def config(saver: str, dtype: str = "int8") -> dict[str, Any]:
    weight = {"dtype": dtype, "scope": "per_group", "method": "minmax", "ext": {"group_size": 32}}
    return {
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
            "save": [{"type": saver}],
        }
    }


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("saver", SAVERS)
def test_disk_full_while_writing_keeps_the_previous_export(
    saver: str, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = tmp_path / "out"
    msquant.quantize(tiny_llama, save, config(saver), progress=False)
    before = snapshot(save)
    calls = {"n": 0}

    real_write = shards.write_shard_file

    def failing_write(path: Path, entries: Any, data_paths: Any) -> None:
        calls["n"] += 1
        # write part of the file, as a full disk would, then fail
        real_write(path, entries, data_paths)
        with open(path, "r+b") as handle:
            handle.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(shards, "write_shard_file", failing_write)
    with pytest.raises(OSError, match="No space left"):
        msquant.quantize(tiny_llama, save, config(saver, "int4"), progress=False, overwrite=True)
    assert calls["n"] == 1
    assert snapshot(save) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


@pytest.mark.parametrize("value", ["../evil", "a/b", "..", "", "x\\y", "llama\n"])
def test_unsafe_names_are_refused(value: str) -> None:
    with pytest.raises(OutputPathError, match="cannot be used in a file name"):
        safe_file_stem(value, "model_type")


def test_safe_names_pass() -> None:
    assert safe_file_stem("qwen2_5_vl", "model_type") == "qwen2_5_vl"
    assert safe_file_stem("deepseek-v3.1", "model_type") == "deepseek-v3.1"


def test_ascend_saver_refuses_a_model_type_that_would_escape_the_folder() -> None:
    saver = AscendV1Saver(AscendV1SaverConfig())
    model = SimpleNamespace(config=SimpleNamespace(model_type="../../etc/x"))
    [problem] = saver.check_model(model, [])  # type: ignore[arg-type]
    assert "ascendv1_saver" in problem and "'../../etc/x'" in problem
    assert saver.check_model(SimpleNamespace(config=SimpleNamespace(model_type="llama")), []) == []  # type: ignore[arg-type]
