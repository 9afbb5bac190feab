"""The export-format registry: built-ins found through the ``msquant.formats`` entry points, its
registration rules, and a third-party format that ``quantize``'s read-back check, ``msquant
verify`` and evaluation read without any change to the engine."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import load_file

import msquant
import msquant.plugin
from msquant import ExportVerificationError, RegistryError, verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.plugin import (
    FORMAT_ENTRY_POINT_GROUP,
    DecodedLayer,
    ExportFormat,
    ExportReader,
    Findings,
    FormatRegistry,
    LayerReport,
    Processor,
    ProcessorConfig,
    QuantizedLinear,
    RunContext,
    Saver,
    SaverConfig,
    default_formats,
    default_registry,
)
from msquant.plugin.export import copy_model_files
from msquant.plugin.reading import detect_format, open_weights, read_json, trivial_g_idx

BUILTIN_FORMATS = ["ascend", "mindie", "gptq", "compressed-tensors", "autoawq"]
BUILTIN_SAVERS = {
    "ascendv1_saver",
    "mindie_format_saver",
    "gptq_saver",
    "compressed_tensors",
    "autoawq_saver",
    "awq_saver",  # the deprecated name of autoawq_saver
}
CALIB_TXT = Path(__file__).parents[1] / "data" / "calib.txt"


# --- built-ins -------------------------------------------------------------------------------


def test_builtin_formats_come_from_entry_points_in_detection_order() -> None:
    registry = default_formats()
    assert registry.names() == BUILTIN_FORMATS
    assert registry.verifiable_savers() == BUILTIN_SAVERS
    eps = {ep.name: ep.value for ep in entry_points(group=FORMAT_ENTRY_POINT_GROUP)}
    assert eps["gptq"] == "msquant.processors.formats.gptq.format:GPTQ"
    assert all(fmt.verifiable for fmt in registry.formats())


def test_default_saver_is_declared_by_exactly_one_builtin() -> None:
    """``spec.save`` empty -> the saver class that declares itself the default; the MindIE saver,
    a subclass of it, does not inherit the declaration."""
    from msquant.config.processors import default_saver

    registry = default_registry()
    assert default_saver(registry).type_name == "ascendv1_saver"


def test_two_default_savers_or_none_are_refused() -> None:
    from msquant.config.processors import default_saver

    class OtherDefault(Processor):
        type_name = "test_other_default"
        config_class = _config_class("test_other_default")
        stage = "save"
        default_saver = True

    registry = default_registry()
    registry.register(OtherDefault)
    with pytest.raises(RegistryError, match="several registered savers declare themselves"):
        default_saver(registry)
    empty = msquant.plugin.ProcessorRegistry()
    with pytest.raises(RegistryError, match="no registered saver declares itself the default"):
        default_saver(empty)


def test_unknown_format_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError) as info:
        default_formats().get("bitsandbytes")
    assert "unknown export format 'bitsandbytes'" in str(info.value)
    assert "ascend, mindie, gptq, compressed-tensors, autoawq" in str(info.value)


def test_registration_rules() -> None:
    registry = FormatRegistry([TOY])
    registry.register(TOY)  # the same entry again is a no-op
    assert len(registry) == 1 and "toy" in registry
    with pytest.raises(RegistryError, match="registered twice"):
        registry.register(ExportFormat("toy", "other", _is_toy))
    with pytest.raises(RegistryError, match="claimed by two export formats"):
        registry.register(ExportFormat("toy2", "other", _is_toy, savers=("toy_saver",)))
    with pytest.raises(RegistryError, match="is not a msquant.plugin.ExportFormat"):
        registry.register("toy")  # type: ignore[arg-type]


def _fake_format_entry_points(monkeypatch: pytest.MonkeyPatch, *extra: tuple[str, str]) -> None:
    """The real ``msquant.formats`` entry points plus ``extra`` (name, value) pairs."""
    real = entry_points

    def fake(group: str) -> list[EntryPoint]:
        found = list(real(group=group))
        if group == FORMAT_ENTRY_POINT_GROUP:
            found += [EntryPoint(name=n, value=v, group=group) for n, v in extra]
        return found

    monkeypatch.setattr("msquant.registry_base.entry_points", fake)


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("broken", "msquant_no_such_format_pkg:FMT", "No module named"),
        ("not_a_format", "json:dumps", "is not a msquant.plugin.ExportFormat"),
        ("other_name", f"{__name__}:TOY", "names the export format 'toy'"),
    ],
    ids=["import_error", "not_a_format", "name_mismatch"],
)
def test_broken_format_entry_points_are_set_aside(
    name: str, value: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_format_entry_points(monkeypatch, (name, value))
    registry = default_formats()
    assert "ascend" in registry and name not in registry  # the others stay usable
    with pytest.raises(RegistryError, match=needle):
        registry.get(name)
    assert [p.name for p in registry.problems()] == [name]


# --- a third-party format --------------------------------------------------------------------
#
# ``toy``: every tensor in ``toy.safetensors`` (a quantized linear P as P.codes int8 [out, in],
# P.scale and P.offset float32 [out, G]), the quantized modules listed in ``toy_format.json``,
# the model's config beside them. Its reader and saver live here, in the test, and reach msquant
# only through entry points (formats) and a processor registry (the saver).

TOY_MANIFEST = "toy_format.json"
TOY_PARTS = ("codes", "scale", "offset")


def _is_toy(directory: Path) -> bool:
    return (directory / TOY_MANIFEST).is_file()


class ToyReader(ExportReader):
    """Reads a ``toy`` export back (independently of :class:`ToySaver`)."""

    format_name = "toy"

    def __init__(self, directory: Path, findings: Findings) -> None:
        super().__init__(directory, findings)
        manifest = read_json(directory / TOY_MANIFEST, findings) or {}
        self.modules = sorted(manifest.get("quantized", []))
        self.store = open_weights(directory, "toy", findings)
        self.packed = {f"{m}.{part}" for m in self.modules for part in TOY_PARTS}

    def quantized_modules(self) -> list[str]:
        return list(self.modules)

    def entry(self, module: str) -> LayerReport:
        return LayerReport(module, "toy-int8", 8, None)

    def decode(self, module: str) -> DecodedLayer | None:
        assert self.store is not None
        codes, scale, offset = (self.store.get(f"{module}.{part}") for part in TOY_PARTS)
        groups = int(scale.shape[1])
        group_size = None if groups == 1 else int(codes.shape[1]) // groups
        return DecodedLayer(
            name=module,
            scheme="toy-int8",
            bits=8,
            group_size=group_size,
            codes=codes.to(torch.int32),
            scale=scale.float(),
            offset=offset.float(),
            g_idx=trivial_g_idx(int(codes.shape[1]), group_size or int(codes.shape[1])),
            scale_dtype=scale.dtype,
            tensors={
                "codes": f"{module}.codes",
                "scale": f"{module}.scale",
                "offset": f"{module}.offset",
                "g_idx": "(implicit)",
            },
        )

    def schemes(self) -> tuple[dict[str, Any], dict[str, str]]:
        return {m: "toy" for m in self.modules}, {m: "toy" for m in self.modules}


TOY = ExportFormat(
    name="toy",
    description="toy_format.json + toy.safetensors",
    detect=_is_toy,
    reader=ToyReader,
    savers=("toy_saver",),
    order=5,
)


def _config_class(type_name: str) -> type[ProcessorConfig]:
    return type(
        f"{type_name}_config",
        (ProcessorConfig,),
        {"__annotations__": {"type": Literal[type_name]}, "type": type_name},  # type: ignore[valid-type]
    )


class ToySaverConfig(SaverConfig):
    type: Literal["toy_saver"] = "toy_saver"


class ToySaver(Saver):
    """Writes the ``toy`` format: only its packing and its metadata are written here, the rest
    (writer, shards, written-tensor record, fused check, head, checkpoints) is the Saver base's.
    ``corrupt`` puts one code of the first quantized layer off, on purpose."""

    type_name = "toy_saver"
    config_class = ToySaverConfig
    weights_prefix = "toy"
    corrupt = False

    def pack(self, ctx: RunContext, name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
        codes = module.weight.detach().clone()
        if self.corrupt and not self.state.quantized:
            codes[0, 0] = 0 if int(codes[0, 0]) != 0 else 1
        return {
            f"{name}.codes": codes,
            f"{name}.scale": module.weight_scale,
            f"{name}.offset": module.weight_offset,
        }

    def write_config(self, ctx: RunContext) -> None:
        copy_model_files(ctx.model_path, self.directory)
        manifest = {"quantized": sorted(self.state.quantized)}
        (self.directory / TOY_MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


class CorruptToySaver(ToySaver):
    corrupt = True


TOY_CONFIG = {
    "spec": {
        "process": [{"type": "linear_quant", "qconfig": {"weight": {"method": "minmax"}}}],
        "save": [{"type": "toy_saver"}],
    }
}


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> Callable[[type[Processor]], Any]:
    """The ``toy`` format installed through a (faked) entry point; returns a function giving a
    processor registry with the given toy saver class."""
    assert sys.modules[__name__].TOY is TOY  # the entry point below loads this module
    _fake_format_entry_points(monkeypatch, ("toy", f"{__name__}:TOY"))

    def registry(saver: type[Processor]) -> msquant.plugin.ProcessorRegistry:
        built = default_registry()
        built.register(saver, "toy_saver")
        return built

    return registry


def test_a_third_party_format_is_read_back_by_the_run(
    tiny_llama: Path, tmp_path: Path, toy_registered: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert default_formats().names()[0] == "toy"
    save = tmp_path / "toy"
    with caplog.at_level(logging.INFO, logger="msquant"):
        msquant.quantize(
            tiny_llama, save, TOY_CONFIG, registry=toy_registered(ToySaver), progress=False
        )
    assert "verify: toy_saver export read back, 14 quantized layer(s) identical" in caplog.text
    assert detect_format(save) == "toy"
    report = verify_export(save, model_path=tiny_llama)
    assert report.ok, report.errors
    assert report.format == "toy" and len(report.layers) == 14


def test_the_run_catches_a_wrong_third_party_export(
    tiny_llama: Path, tmp_path: Path, toy_registered: Any
) -> None:
    """The read-back check really reads the toy files: one code off fails the run."""
    save = tmp_path / "bad"
    with pytest.raises(ExportVerificationError, match="toy export .* failed verification"):
        msquant.quantize(
            tiny_llama, save, TOY_CONFIG, registry=toy_registered(CorruptToySaver), progress=False
        )
    assert not list(save.glob("toy*.safetensors"))


def test_a_third_party_format_is_verified_and_evaluated(
    tiny_llama: Path, tmp_path: Path, toy_registered: Any, run_cli: Any
) -> None:
    save = tmp_path / "toy"
    msquant.quantize(
        tiny_llama, save, TOY_CONFIG, registry=toy_registered(ToySaver), progress=False
    )
    result = run_cli("verify", save, "--model_path", tiny_llama)
    assert result.code == 0, result.err
    assert "toy export" in result.out and "OK: 14 quantized layer(s)" in result.out
    model, kind = load_model_for_eval(save)
    assert kind == "toy"
    stored = {}
    for shard in sorted(save.glob("toy*.safetensors")):
        stored.update(load_file(str(shard)))
    name = "model.layers.0.mlp.down_proj"
    codes = stored[f"{name}.codes"].to(torch.float64)
    expected = (codes - stored[f"{name}.offset"].double()) * stored[f"{name}.scale"].double()
    weight = model.get_submodule(name).weight.detach().to(torch.float64)
    assert torch.allclose(weight, expected.to(weight.dtype).double(), rtol=0, atol=1e-6)
    assert torch.equal(
        model.get_submodule("model.embed_tokens").weight, stored["model.embed_tokens.weight"]
    )
