"""Outputs are atomic: a failed run leaves the save path as it was; shards and index are exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import load_file

import msquant
import msquant.plugin
from msquant import OutputPathError
from msquant.plugin import DecoderLayer, Processor, ProcessorConfig, RunContext
from msquant.plugin.export import ShardedSafetensorsWriter, StagedOutputDir

CONFIG = {
    "spec": {"process": [{"type": "linear_quant", "qconfig": {"weight": {"method": "minmax"}}}]}
}


class ExplodeConfig(ProcessorConfig):
    type: Literal["explode"] = "explode"


class Explode(Processor):
    """Fails in the middle of the run, after the saver has already written some tensors."""

    type_name = "explode"
    config_class = ExplodeConfig

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if layer.index == 1:
            raise RuntimeError("boom in layer 1")


def _registry_with_explode() -> msquant.plugin.ProcessorRegistry:
    registry = msquant.plugin.default_registry()
    registry.register(Explode)
    return registry


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_failed_run_leaves_no_output(tiny_llama: Path, tmp_path: Path) -> None:
    config = {
        "spec": {
            "process": [*CONFIG["spec"]["process"], {"type": "explode"}],
            "save": [{"type": "ascendv1_saver", "part_file_size": 0}],
        }
    }
    with pytest.raises(RuntimeError, match="boom"):
        msquant.quantize(
            tiny_llama, tmp_path / "out", config, registry=_registry_with_explode(), progress=False
        )
    assert list(tmp_path.iterdir()) == []  # neither the output nor a staging folder


def test_failed_run_keeps_previous_export(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    msquant.quantize(tiny_llama, save, CONFIG, progress=False)
    before = _snapshot(save)
    config = {"spec": {"process": [{"type": "explode"}]}}
    with pytest.raises(RuntimeError):
        msquant.quantize(
            tiny_llama,
            save,
            config,
            registry=_registry_with_explode(),
            progress=False,
            overwrite=True,
        )
    assert _snapshot(save) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_successful_run_replaces_previous_export(tiny_llama: Path, tmp_path: Path) -> None:
    """Every file of the previous export goes, those the new one does not write included."""
    save = tmp_path / "out"
    mindie = {**CONFIG, "spec": {**CONFIG["spec"], "save": [{"type": "mindie_format_saver"}]}}
    msquant.quantize(tiny_llama, save, mindie, progress=False)
    stale = save / "quant_model_weight_w8a16.safetensors"
    assert stale.is_file()
    asym = {
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": {"method": "minmax", "symmetric": False}},
                }
            ]
        }
    }
    msquant.quantize(tiny_llama, save, asym, progress=False, overwrite=True)
    assert not stale.exists()
    offsets = load_file(str(save / "quant_model_weights-00001-of-00001.safetensors"))
    assert torch.count_nonzero(offsets["model.layers.0.mlp.up_proj.weight_offset"]) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_has_ordinary_permissions(tiny_llama: Path, tmp_path: Path) -> None:
    msquant.quantize(tiny_llama, tmp_path / "out", CONFIG, progress=False)
    assert (tmp_path / "out").stat().st_mode & 0o755 == 0o755
    for file in (tmp_path / "out").iterdir():
        assert file.stat().st_mode & 0o644 == 0o644, file


def test_staged_dir_rules(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="is a file"):
        StagedOutputDir(tmp_path / "file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="does not hold a previous export"):
        StagedOutputDir(tmp_path / "busy")
    with StagedOutputDir(tmp_path / "a" / "b") as staging:
        (staging / "x.txt").write_text("done")
    assert (tmp_path / "a" / "b" / "x.txt").read_text() == "done"
    with pytest.raises(KeyboardInterrupt), StagedOutputDir(tmp_path / "c") as staging:
        (staging / "partial").write_text("half")
        raise KeyboardInterrupt
    assert not (tmp_path / "c").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "busy", "file"]


def test_sharded_writer_splits_by_size_and_indexes(tmp_path: Path) -> None:
    writer = ShardedSafetensorsWriter(tmp_path, "w", max_shard_bytes=1000)
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(7)}  # 400 bytes each
    tensors["big"] = torch.zeros(600)  # 2400 bytes: a shard of its own
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    weight_map = writer.close()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"w-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads((tmp_path / "w.safetensors.index.json").read_text())
    assert index["weight_map"] == dict(sorted(weight_map.items()))
    assert index["metadata"]["total_size"] == 7 * 400 + 2400
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(tmp_path / file))
        assert sum(t.numel() * 4 for t in part.values()) <= 1000 or len(part) == 1
        loaded.update(part)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="written twice"):
        w2 = ShardedSafetensorsWriter(tmp_path, "x", None)
        w2.add("a", torch.zeros(1))
        w2.add("a", torch.zeros(1))


def test_unsharded_writer_writes_single_file(tmp_path: Path) -> None:
    writer = ShardedSafetensorsWriter(tmp_path, "w", None)
    writer.add("a", torch.arange(5))
    assert writer.close() == {"a": "w.safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
