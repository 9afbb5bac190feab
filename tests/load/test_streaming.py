"""Streamed runs (spec.runner layer_wise / auto): one decoder layer in memory at a time, and the
same export, byte for byte, as a run that loads the whole model (model_wise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
from conftest import CALIB_TXT
from safetensors.torch import load_file
from torch import nn

import msquant
from msquant import ConfigError, ModelLoadError
from msquant.load.model_folder import build_meta_model, load_causal_lm, load_model_config
from msquant.load.streaming import StreamedWeights, streaming_device_map
from msquant.model.layers import find_decoder_layers
from msquant.plugin import (
    DecoderLayer,
    Processor,
    ProcessorConfig,
    ProcessorRegistry,
    QuantizedLinear,
    RunContext,
    default_registry,
)
from msquant.plugin.numerics import quantize_weight_minmax
from msquant.quant.spill import MergedWeights
from msquant.run.checkpoint.store import LayerStore

SAVERS = [
    {"type": "ascendv1_saver"},
    {"type": "gptq_saver"},
    {"type": "compressed_tensors"},
    {"type": "mindie_format_saver"},
]


def _config(runner: str, save: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    weight = {
        "scope": "per_group",
        "dtype": "int4",
        "symmetric": True,
        "method": "gptq",
        "ext": {"group_size": 32},
    }
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": weight},
                    # layer 1 in int8: layers differ, so a mix-up between layers would show
                    "dynamic": {r".*\.1\..*": {"bits": 8}},
                }
            ],
            "save": save or SAVERS,
        },
    }


def _quantize(model: Path, save: Path, config: dict[str, Any], **kwargs: Any) -> Any:
    return msquant.quantize(
        model, save, config, calib_path=CALIB_TXT, max_calib_tokens=32, progress=False, **kwargs
    )


def _files(root: Path) -> dict[str, bytes]:
    """Every file of an export but the run report, with the runner's name taken out of the
    config copies (the one thing that differs between the runs compared) and their checksums out
    of the marker."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != "quant_report.json":
            data = path.read_bytes()
            if path.name == "msquant_export.json":
                data = _without_config_checksums(data)
            if path.suffix in (".yaml", ".json"):
                for runner in (b"layer_wise", b"model_wise", b"auto"):
                    data = data.replace(b"runner: " + runner, b"runner: *")
            files[str(path.relative_to(root))] = data
    return files


def _without_config_checksums(marker: bytes) -> bytes:
    data = json.loads(marker)
    data["files"] = {k: v for k, v in data["files"].items() if not k.endswith(".yaml")}
    return json.dumps(data).encode()


def _report_without_times(root: Path) -> Any:
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not k.endswith("seconds")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    report = json.loads((root / "quant_report.json").read_text())
    report.pop("config_sha256")  # the configs differ in spec.runner
    return strip(report)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_streamed_export_is_identical_to_the_whole_model_run(
    arch: str, tiny_model_factory: Any, tmp_path: Path
) -> None:
    model = tiny_model_factory(arch, num_layers=3)
    _quantize(model, tmp_path / "streamed", _config("layer_wise"))
    _quantize(model, tmp_path / "whole", _config("model_wise"))
    streamed, whole = _files(tmp_path / "streamed"), _files(tmp_path / "whole")
    assert sorted(streamed) == sorted(whole)
    assert any(name.endswith(".safetensors") for name in streamed)
    for name in whole:
        assert streamed[name] == whole[name], f"{name} differs"
    assert _report_without_times(tmp_path / "streamed") == _report_without_times(tmp_path / "whole")
    assert not list(tmp_path.glob(".msquant-scratch-*"))


def test_auto_runner_streams_like_layer_wise(tiny_llama: Path, tmp_path: Path) -> None:
    save = [{"type": "ascendv1_saver"}]
    _quantize(tiny_llama, tmp_path / "auto", _config("auto", save))
    _quantize(tiny_llama, tmp_path / "layer_wise", _config("layer_wise", save))
    assert _files(tmp_path / "auto") == _files(tmp_path / "layer_wise")


def test_streamed_run_without_checkpoints_verifies_from_its_scratch_store(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Without resume checkpoints the released layers' quantized weights go to a scratch store
    (ctx.spill) for the read-back check; the export is the same, and the scratch is removed."""
    save = [{"type": "gptq_saver"}]
    _quantize(tiny_llama, tmp_path / "plain", _config("layer_wise", save), checkpoints=False)
    _quantize(tiny_llama, tmp_path / "checkpointed", _config("layer_wise", save))
    assert _files(tmp_path / "plain") == _files(tmp_path / "checkpointed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpointed", "plain"]


# -- one layer in memory at a time ------------------------------------------------------------


class LayerWatchConfig(ProcessorConfig):
    type: Literal["test_layer_watch"] = "test_layer_watch"


class LayerWatch(Processor):
    """Records, at each layer, which decoder layers hold real (non-meta) tensors."""

    type_name = "test_layer_watch"
    config_class = LayerWatchConfig
    requires_calibration = True
    seen: ClassVar[list[list[int]]] = []

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        LayerWatch.seen.append(
            [
                other.index
                for other in ctx.layers
                if any(not t.is_meta for t in other.module.state_dict().values())
            ]
        )


def test_only_the_running_layer_is_in_memory(
    tiny_model_factory: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model_factory("llama", num_layers=4)
    registry = ProcessorRegistry([LayerWatch, *(default_registry().get(t) for t in _types())])
    config = _config("layer_wise", [{"type": "ascendv1_saver"}])
    config["spec"]["process"].insert(0, {"type": "test_layer_watch"})
    LayerWatch.seen = []
    with caplog.at_level("INFO", logger="msquant"):
        _quantize(model, tmp_path / "out", config, registry=registry)
    # layer 0 is read once before the loop (capture learns its output type from it)
    assert LayerWatch.seen == [[0], [1], [2], [3]]
    assert "streamed from disk one at a time" in caplog.text
    LayerWatch.seen = []
    config["spec"]["runner"] = "model_wise"
    _quantize(model, tmp_path / "whole", config, registry=registry)
    assert LayerWatch.seen == [[0, 1, 2, 3]] * 4


def _types() -> list[str]:
    return ["linear_quant", "ascendv1_saver"]


# -- failures leave nothing behind -------------------------------------------------------------


class ExplodeConfig(ProcessorConfig):
    type: Literal["test_explode_late"] = "test_explode_late"


class ExplodeLate(Processor):
    """Fails in the second layer, after the first was exported and released."""

    type_name = "test_explode_late"
    config_class = ExplodeConfig

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if layer.index == 1:
            raise RuntimeError("boom in layer 1")


def test_failed_streamed_run_leaves_no_scratch_or_staging(tiny_llama: Path, tmp_path: Path) -> None:
    registry = ProcessorRegistry([ExplodeLate, *(default_registry().get(t) for t in _types())])
    config = _config("layer_wise", [{"type": "ascendv1_saver"}])
    config["spec"]["process"].append({"type": "test_explode_late"})
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        _quantize(tiny_llama, tmp_path / "out", config, registry=registry)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


class NotesConfig(ProcessorConfig):
    type: Literal["test_notes_saver"] = "test_notes_saver"


class NotesSaver(Processor):
    """A saver of a format msquant cannot read back."""

    type_name = "test_notes_saver"
    config_class = NotesConfig
    stage = "save"


def test_streamed_run_with_eval_data_needs_a_readable_export(
    tiny_llama: Path, tmp_path: Path
) -> None:
    registry = ProcessorRegistry([NotesSaver, default_registry().get("linear_quant")])
    config = _config("layer_wise", [{"type": "test_notes_saver"}])
    with pytest.raises(ConfigError, match=r"spec\.save: --eval_data in a streamed run"):
        _quantize(tiny_llama, tmp_path / "out", config, registry=registry, eval_data=CALIB_TXT)


def test_streamed_eval_equals_whole_model_eval(tiny_llama: Path, tmp_path: Path) -> None:
    save = [{"type": "compressed_tensors"}]
    results = [
        _quantize(
            tiny_llama,
            tmp_path / runner,
            _config(runner, save),
            eval_data=CALIB_TXT,
            eval_seqlen=64,
        ).report.evaluation
        for runner in ("layer_wise", "model_wise")
    ]
    assert results[0].tokens == results[1].tokens > 0
    assert results[0].ppl == pytest.approx(results[1].ppl, rel=1e-6)


# -- the pieces --------------------------------------------------------------------------------


def test_device_map_streams_exactly_the_decoder_layers(tiny_llama: Path) -> None:
    meta = build_meta_model(load_model_config(tiny_llama))
    names = [layer.name for layer in find_decoder_layers(meta)]
    device_map = streaming_device_map(meta, names)
    assert device_map == {
        "model.embed_tokens": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    with pytest.raises(ModelLoadError, match=r"not found in the model: \['model.layers.7'\]"):
        streaming_device_map(meta, ["model.layers.7"])


def test_materialize_reads_the_checkpoint_and_release_frees(tiny_llama: Path) -> None:
    whole = load_causal_lm(tiny_llama)
    layer = find_decoder_layers(whole)[1]
    original = {k: v.clone() for k, v in layer.module.state_dict().items()}
    meta = build_meta_model(load_model_config(tiny_llama))
    target = find_decoder_layers(meta)[1]
    weights = StreamedWeights(
        {f"{layer.name}.{k}": (lambda v=v: v.clone()) for k, v in original.items()}
    )
    weights.materialize(target.module, target.name)
    loaded = target.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in original.items())
    assert weights.loaded_bytes == sum(v.numel() * v.element_size() for v in original.values())
    StreamedWeights.release(target.module)
    assert all(t.is_meta for t in target.module.state_dict().values())
    partial = StreamedWeights({})
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.1\..* has no source in the checkpoint"
    ):
        partial.materialize(target.module, target.name)


def test_spill_returns_what_was_written(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16, bias=False))
    qweights = {}
    for index, bits, group in ((0, 4, 16), (1, 8, None)):
        linear = layer[index]
        assert isinstance(linear, nn.Linear)
        linear.weight.data = torch.randn(linear.weight.shape, generator=generator)
        qweights[f"block.{index}"] = quantize_weight_minmax(linear.weight, bits, index == 1, group)
        layer[index] = QuantizedLinear.from_linear(linear, qweights[f"block.{index}"], "minmax")
    spill = LayerStore(tmp_path)  # what a streamed run without checkpoints keeps as ctx.spill
    assert sorted(spill.save("block", layer, "block")) == ["block.0", "block.1"]
    assert sorted(spill.save("block", layer, "block")) == ["block.0", "block.1"]  # replaced
    assert sorted(spill) == ["block.0", "block.1"] and len(spill) == 2
    for name, expected in qweights.items():
        got = spill[name]
        assert (got.bits, got.symmetric, got.group_size) == (
            expected.bits,
            expected.symmetric,
            expected.group_size,
        )
        for part in ("codes", "scale", "offset"):
            assert torch.equal(getattr(got, part), getattr(expected, part))
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and set(load_file(str(files[0]))) == {
        f"{name}.{part}" for name in qweights for part in ("codes", "scale", "offset")
    } | {"block.0.bias"}
    merged = MergedWeights({"other": qweights["block.0"]}, spill)
    assert sorted(merged) == ["block.0", "block.1", "other"] and len(merged) == 3
    assert torch.equal(merged["other"].codes, qweights["block.0"].codes)
    with pytest.raises(KeyError):
        merged["missing"]


def test_streamed_modules_free_without_a_garbage_collection(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """No module of a streamed model is in a reference cycle (accelerate's hook removal leaves
    each module's ``forward`` bound to it): a linear layer ``linear_quant`` replaces is freed
    as soon as it is dropped, with no ``gc.collect``."""
    import gc
    import weakref

    from msquant.load.streaming import load_causal_lm_streaming

    meta = build_meta_model(load_model_config(tiny_llama))
    names = [layer.name for layer in find_decoder_layers(meta)]
    model, _ = load_causal_lm_streaming(tiny_llama, meta, names, tmp_path / "offload")
    assert not any("forward" in vars(module) for module in model.modules())
    parent = find_decoder_layers(model)[0].module.self_attn
    gc.disable()
    try:
        gc.collect()
        dropped = weakref.ref(parent.q_proj)
        parent.q_proj = nn.Identity()
        assert dropped() is None
    finally:
        gc.enable()


def test_layer_loop_collections_leave_older_objects_alone() -> None:
    """Inside ``collect_new_objects_only`` what was alive at entry is frozen (a collection does not
    traverse it) and cyclic garbage made inside is still collected; on exit nothing stays frozen,
    and a caller's own freeze is left as it was."""
    import gc
    import weakref

    from msquant.load.streaming import collect_new_objects_only

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    with collect_new_objects_only():
        assert gc.get_freeze_count() > 0
        cycle = Node()
        cycle.self = cycle  # type: ignore[attr-defined]
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collect_new_objects_only():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
