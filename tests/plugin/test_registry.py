"""The processor registry: entry-point discovery, strict registration, and third-party plugins."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
from pydantic import BaseModel, Field
from torch import nn

import msquant
from msquant import (
    ConfigError,
    ConfigIssue,
    RegistryError,
    config_json_schema,
    load_config_text,
)
from msquant.load.calibration import read_calibration_texts
from msquant.plugin import (
    ENTRY_POINT_GROUP,
    DecoderLayer,
    Processor,
    ProcessorConfig,
    ProcessorRegistry,
    QuantizedLinear,
    RunContext,
    default_registry,
)

CALIB_TXT = Path(__file__).parents[1] / "data" / "calib.txt"
RunCli = Callable[..., Any]

# --- a third-party plugin, defined here as a plugin package would ---------------------------------


class ProbeConfig(ProcessorConfig):
    type: Literal["test_probe"] = "test_probe"
    tag: str = "probe"
    threshold: float = Field(1.0, gt=0)


class ProbeProcessor(Processor):
    """Records every hook call and what it saw; instances are collected for the test to inspect."""

    type_name = "test_probe"
    config_class = ProbeConfig
    stage = "process"
    instances: ClassVar[list[ProbeProcessor]] = []
    config: ProbeConfig

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self.events: list[tuple[Any, ...]] = []
        self.forward_calls: dict[int, list[tuple[int, ...]]] = {}
        self._hook: Any = None
        type(self).instances.append(self)

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        if getattr(config, "tag", None) == "forbidden":
            return [ConfigIssue("tag", "the tag 'forbidden' is reserved; choose another")]
        return []

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        device = next(model.parameters()).device.type
        self.events.append(("check_model", device, len(layers)))
        return []

    def setup(self, ctx: RunContext) -> None:
        self.events.append(("setup", ctx.model_type, len(ctx.layers)))
        self.output_dir = ctx.output_dir
        self.staging_existed = ctx.output_dir.is_dir()
        self.config_text = ctx.config_text

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        quantized_in_model = sum(isinstance(m, QuantizedLinear) for m in ctx.model.modules())
        self.events.append(("before_layer", layer.index, layer.name, quantized_in_model))
        calls = self.forward_calls.setdefault(layer.index, [])

        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            calls.append(tuple(args[0].shape))

        self._hook = layer.module.register_forward_hook(record)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._hook.remove()
        quantized_in_layer = sum(isinstance(m, QuantizedLinear) for m in layer.module.modules())
        self.events.append(("after_layer", layer.index, layer.name, quantized_in_layer))

    def finalize(self, ctx: RunContext) -> None:
        quantized = sum(isinstance(m, QuantizedLinear) for m in ctx.model.modules())
        self.events.append(("finalize", quantized))


class CalibProbeConfig(ProcessorConfig):
    type: Literal["test_calib_probe"] = "test_calib_probe"


class CalibProbeProcessor(ProbeProcessor):
    """The same probe, but asking for calibration data."""

    type_name = "test_calib_probe"
    config_class = CalibProbeConfig
    requires_calibration = True
    instances: ClassVar[list[ProbeProcessor]] = []


class ManifestSaverConfig(ProcessorConfig):
    type: Literal["test_manifest"] = "test_manifest"
    filename: str = "manifest.json"


class ManifestSaver(Processor):
    """A save-stage plugin that writes one JSON file listing the quantized modules."""

    type_name = "test_manifest"
    config_class = ManifestSaverConfig
    stage = "save"
    config: ManifestSaverConfig

    def finalize(self, ctx: RunContext) -> None:
        names = sorted(n for n, m in ctx.model.named_modules() if isinstance(m, QuantizedLinear))
        (ctx.output_dir / self.config.filename).write_text(json.dumps(names))


@pytest.fixture(autouse=True)
def _reset_probes() -> None:
    ProbeProcessor.instances.clear()
    CalibProbeProcessor.instances.clear()


@pytest.fixture
def registry() -> ProcessorRegistry:
    reg = default_registry()
    reg.register(ProbeProcessor)
    reg.register(CalibProbeProcessor)
    reg.register(ManifestSaver)
    return reg


LINEAR_QUANT = "    - type: linear_quant\n      qconfig: {weight: {method: minmax}}\n"


# --- built-ins through entry points --------------------------------------------------------------


def test_builtins_are_found_through_entry_points() -> None:
    reg = default_registry()
    assert {"linear_quant", "ascendv1_saver"} <= set(reg.names())
    assert reg.names("process") == sorted(n for n in reg.names() if reg.get(n).stage == "process")
    assert "linear_quant" in reg.names("process") and "ascendv1_saver" in reg.names("save")
    assert "linear_quant" in reg and "ascendv1_saver" in reg and "nope" not in reg
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["linear_quant"] == "msquant.processors.linear_quant.processor:LinearQuantProcessor"
    assert eps["ascendv1_saver"] == "msquant.processors.formats.ascend.saver:AscendV1Saver"


def test_builtins_live_in_msquant_processors() -> None:
    reg = default_registry()
    linear, saver = reg.get("linear_quant"), reg.get("ascendv1_saver")
    assert linear.__module__ == "msquant.processors.linear_quant.processor"
    assert saver.__module__ == "msquant.processors.formats.ascend.saver"
    first = importlib.import_module("msquant.processors.linear_quant.processor")
    second = importlib.import_module("msquant.processors.linear_quant.processor")
    assert first is second is sys.modules["msquant.processors.linear_quant.processor"]
    assert first.LinearQuantProcessor is linear
    assert importlib.import_module("msquant.processors.formats.ascend.saver").AscendV1Saver is saver
    # Never imported twice under the bare top-level name (two copies of every class).
    assert "processors.linear_quant.processor" not in sys.modules
    assert "processors.formats.ascend.saver" not in sys.modules


def test_default_registry_is_fresh_each_call() -> None:
    first, second = default_registry(), default_registry()
    assert first is not second
    first.register(ProbeProcessor)
    assert "test_probe" in first and "test_probe" not in second
    assert "test_probe" not in default_registry()


# --- registration rules --------------------------------------------------------------------------


def test_registering_another_class_under_a_taken_name_fails() -> None:
    reg = default_registry()
    original = reg.get("linear_quant")

    class LinearQuantConfig2(ProcessorConfig):
        type: Literal["linear_quant"] = "linear_quant"

    class ImpostorLinearQuant(Processor):
        type_name = "linear_quant"
        config_class = LinearQuantConfig2

    with pytest.raises(RegistryError) as info:
        reg.register(ImpostorLinearQuant)
    message = str(info.value)
    assert "'linear_quant'" in message
    assert "msquant.processors.linear_quant.processor.LinearQuantProcessor" in message
    assert "ImpostorLinearQuant" in message
    assert reg.get("linear_quant") is original


def test_reregistering_the_same_class_is_idempotent() -> None:
    reg = default_registry()
    count = len(reg)
    cls = reg.get("linear_quant")
    assert reg.register(cls) is cls
    assert reg.register(cls, "linear_quant") is cls
    assert len(reg) == count
    reg.register(ProbeProcessor)
    reg.register(ProbeProcessor)
    assert len(reg) == count + 1


def test_register_works_as_a_decorator() -> None:
    reg = ProcessorRegistry()

    class DecoratedConfig(ProcessorConfig):
        type: Literal["decorated"] = "decorated"

    @reg.register
    class Decorated(Processor):
        type_name = "decorated"
        config_class = DecoratedConfig

    assert reg.get("decorated") is Decorated
    assert reg.names() == ["decorated"]


def test_register_under_a_different_name_fails() -> None:
    with pytest.raises(RegistryError, match="declares type_name 'test_probe'.*'alias'"):
        ProcessorRegistry().register(ProbeProcessor, "alias")


def test_get_unknown_lists_registered_names() -> None:
    reg = default_registry()
    with pytest.raises(KeyError) as info:
        reg.get("nope")
    message = info.value.args[0]
    assert (
        "'nope'" in message
        and "ascendv1_saver, autoawq_saver, awq_saver, compressed_tensors, dynamic_cache, fa3_quant, flex_awq_ssz, "
        "flex_smooth_quant, float_sparse, gptq_saver, group, iter_smooth, linear_quant, mindie_format_saver, "
        "online_quarot, quarot, smooth_quant"
        in message
    )
    with pytest.raises(KeyError) as info:
        ProcessorRegistry().get("nope")
    assert "(none)" in info.value.args[0]


def test_constructor_registers_classes() -> None:
    reg = ProcessorRegistry([ProbeProcessor, ManifestSaver])
    assert reg.names() == ["test_manifest", "test_probe"]
    assert reg.names("save") == ["test_manifest"]
    assert reg.config_classes("process") == [ProbeConfig]


def _bad_classes() -> dict[str, type]:
    class NotAProcessor:
        type_name = "x"
        config_class = ProbeConfig

    class NoTypeName(Processor):
        config_class = ProbeConfig

    class NoConfigClass(Processor):
        type_name = "no_config"

    class PlainPydanticConfig(BaseModel):
        type: Literal["plain"] = "plain"

    class ConfigNotProcessorConfig(Processor):
        type_name = "plain"
        config_class = PlainPydanticConfig  # type: ignore[assignment]

    class ConfigNotAClass(Processor):
        type_name = "not_a_class"
        config_class = "ProbeConfig"  # type: ignore[assignment]

    class WrongStage(Processor):
        type_name = "test_probe"
        config_class = ProbeConfig
        stage = "train"  # type: ignore[assignment]

    class UntypedConfig(ProcessorConfig):
        pass

    class TypeNotLiteral(Processor):
        type_name = "untyped"
        config_class = UntypedConfig

    class TypeMismatch(Processor):
        type_name = "mismatch"
        config_class = ProbeConfig  # its type is Literal["test_probe"]

    class EmptyTypeName(Processor):
        type_name = ""
        config_class = ProbeConfig

    return {
        "not_a_processor": NotAProcessor,
        "no_type_name": NoTypeName,
        "no_config_class": NoConfigClass,
        "config_not_processor_config": ConfigNotProcessorConfig,
        "config_not_a_class": ConfigNotAClass,
        "wrong_stage": WrongStage,
        "type_not_literal": TypeNotLiteral,
        "type_mismatch": TypeMismatch,
        "empty_type_name": EmptyTypeName,
    }


BAD_CLASS_MESSAGES = {
    "not_a_processor": "not a msquant.plugin.Processor subclass",
    "no_type_name": "'type_name'",
    "no_config_class": "'config_class'",
    "config_not_processor_config": "must subclass msquant.plugin.ProcessorConfig",
    "config_not_a_class": "must subclass msquant.plugin.ProcessorConfig",
    "wrong_stage": "'process' or 'save', got 'train'",
    "type_not_literal": "Literal['untyped']",
    "type_mismatch": "Literal['mismatch']",
    "empty_type_name": "non-empty string",
}


@pytest.mark.parametrize("kind", sorted(BAD_CLASS_MESSAGES))
def test_malformed_processor_classes_are_rejected(kind: str) -> None:
    reg = default_registry()
    count = len(reg)
    with pytest.raises(RegistryError) as info:
        reg.register(_bad_classes()[kind])  # type: ignore[arg-type]
    assert BAD_CLASS_MESSAGES[kind] in str(info.value)
    assert len(reg) == count
    # The registry still builds a working schema afterwards.
    assert load_config_text("spec:\n  process:\n" + LINEAR_QUANT, reg)


# --- a third-party plugin in configs ---------------------------------------------------------------


def test_plugin_yaml_validates_against_its_registry(registry: ProcessorRegistry) -> None:
    text = (
        "spec:\n  process:\n    - {type: test_probe, tag: hello, threshold: 0.5}\n" + LINEAR_QUANT
    )
    config = load_config_text(text, registry)
    probe, linear = config.spec.process
    assert isinstance(probe, ProbeConfig)
    assert (probe.tag, probe.threshold) == ("hello", 0.5)
    assert linear.type == "linear_quant"
    # The same YAML is refused by a registry without the plugin, naming the registered types.
    with pytest.raises(ConfigError) as info:
        load_config_text(text, default_registry())
    issue = next(i for i in info.value.issues if i.path == "spec.process[0].type")
    assert "test_probe" in issue.message and "linear_quant" in issue.message


def test_plugin_defaults_apply(registry: ProcessorRegistry) -> None:
    (probe,) = load_config_text(
        "spec:\n  process:\n    - type: test_probe\n", registry
    ).spec.process
    assert probe == ProbeConfig(type="test_probe", tag="probe", threshold=1.0)


def test_plugin_unknown_key_is_rejected_with_path(registry: ProcessorRegistry) -> None:
    text = "spec:\n  process:\n" + LINEAR_QUANT + "    - {type: test_probe, tagg: hello}\n"
    with pytest.raises(ConfigError) as info:
        load_config_text(text, registry, "plugin.yaml")
    (issue,) = info.value.issues
    assert issue.path == "spec.process[1].tagg"
    assert (
        "unknown key" in issue.message and "tag" in issue.message and "threshold" in issue.message
    )


def test_plugin_field_errors_and_semantic_checks(registry: ProcessorRegistry) -> None:
    text = (
        "spec:\n  process:\n"
        "    - {type: test_probe, threshold: 0}\n"
        "    - {type: test_probe, tag: [not, a, string]}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config_text(text, registry)
    paths = {i.path for i in info.value.issues}
    assert paths == {"spec.process[0].threshold", "spec.process[1].tag"}
    with pytest.raises(ConfigError) as info:
        load_config_text("spec:\n  process:\n    - {type: test_probe, tag: forbidden}\n", registry)
    (issue,) = info.value.issues
    assert issue.path == "spec.process[0].tag" and "reserved" in issue.message


def test_plugin_save_stage_is_separate(registry: ProcessorRegistry) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text("spec:\n  process:\n    - type: test_manifest\n", registry)
    assert "test_probe" in info.value.issues[0].message
    config = load_config_text(
        "spec:\n  save:\n    - {type: test_manifest, filename: m.json}\n", registry
    )
    assert isinstance(config.spec.save[0], ManifestSaverConfig)


def test_plugin_appears_in_the_schema(registry: ProcessorRegistry) -> None:
    text = json.dumps(config_json_schema(registry))
    assert "test_probe" in text and "test_manifest" in text and "threshold" in text
    assert "test_probe" not in json.dumps(config_json_schema(default_registry()))


# --- a third-party plugin in a run ---------------------------------------------------------------


def test_quantize_calls_plugin_hooks(
    tiny_llama: Path, tmp_path: Path, registry: ProcessorRegistry
) -> None:
    text = "spec:\n  process:\n    - {type: test_probe, tag: run}\n" + LINEAR_QUANT
    config_file = tmp_path / "plugin.yaml"
    config_file.write_text(text, encoding="utf-8")
    save = tmp_path / "out"
    result = msquant.quantize(tiny_llama, save, config_file, registry=registry, progress=False)

    # One instance per run (check_model happens on the instance that runs).
    (probe,) = ProbeProcessor.instances
    assert probe.config.tag == "run"
    assert probe.events == [
        ("check_model", "meta", 2),  # on a weightless copy, before weights are loaded
        ("setup", "llama", 2),
        ("before_layer", 0, "model.layers.0", 0),
        ("after_layer", 0, "model.layers.0", 0),  # the probe runs before linear_quant (YAML order)
        ("before_layer", 1, "model.layers.1", 7),  # layer 0's 7 linears were quantized meanwhile
        ("after_layer", 1, "model.layers.1", 0),
        ("finalize", 14),  # by now linear_quant replaced every decoder linear
    ]
    assert probe.forward_calls == {0: [], 1: []}, (
        "no calibration forward without requires_calibration"
    )
    assert probe.staging_existed and probe.output_dir != save.absolute()
    assert not probe.output_dir.exists(), "the staging folder was moved into place"
    assert probe.config_text == text
    assert len(result.quantized_modules) == 14
    assert result.calibration_samples == 0
    assert (save / "quant_model_description.json").is_file()  # the default saver still ran


def test_quantize_with_a_plugin_saver(
    tiny_llama: Path, tmp_path: Path, registry: ProcessorRegistry
) -> None:
    config = {
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": {"method": "minmax"}}}],
            "save": [{"type": "test_manifest", "filename": "manifest.json"}],
        }
    }
    save = tmp_path / "out"
    result = msquant.quantize(tiny_llama, save, config, registry=registry, progress=False)
    # no default saver added; msquant_export.json marks every export folder
    assert sorted(p.name for p in save.iterdir()) == [
        "manifest.json",
        "msquant_export.json",
        "quant_report.json",
    ]
    assert json.loads((save / "manifest.json").read_text()) == sorted(result.quantized_modules)


def test_quantize_feeds_calibration_to_a_plugin(
    tiny_llama: Path, tmp_path: Path, registry: ProcessorRegistry
) -> None:
    config = {"spec": {"process": [{"type": "test_calib_probe"}, {"type": "test_probe"}]}}
    save = tmp_path / "out"
    result = msquant.quantize(
        tiny_llama,
        save,
        config,
        calib_path=CALIB_TXT,
        registry=registry,
        progress=False,
        max_calib_tokens=16,
    )
    samples = len(read_calibration_texts(CALIB_TXT))
    assert result.calibration_samples == samples > 1
    (calib,) = CalibProbeProcessor.instances
    assert [e[0] for e in calib.events] == [
        "check_model",
        "setup",
        "before_layer",
        "after_layer",
        "before_layer",
        "after_layer",
        "finalize",
    ]
    # Between before_layer and after_layer every layer ran once per batch of equal-length samples
    # ([n, seq<=16, hidden], at most 4096 tokens), each sample exactly once.
    lengths = sorted(len(ids) for ids in _calib_ids(tiny_llama, 16))
    for index in (0, 1):
        shapes = calib.forward_calls[index]
        assert sorted(s[1] for s in shapes for _ in range(s[0])) == lengths
        assert all(1 <= s[1] <= 16 and s[2] == 64 and s[0] * s[1] <= 4096 for s in shapes)
        assert len(shapes) < samples  # truncation to 16 tokens makes most samples equal length
    assert calib.forward_calls[0] == calib.forward_calls[1]
    # The plain probe shares the run and sees the same forwards through its own hooks.
    (probe,) = ProbeProcessor.instances
    assert probe.forward_calls == calib.forward_calls
    assert (save / "quant_model_description.json").is_file()


def _calib_ids(model_dir: Path, max_tokens: int) -> list[list[int]]:
    """The token ids msquant calibrates on for CALIB_TXT (truncated to ``max_tokens``)."""
    from msquant.load.calibration import read_calibration_texts, tokenize_samples
    from msquant.load.model_folder import load_tokenizer

    texts = read_calibration_texts(CALIB_TXT)
    return [s[0].tolist() for s in tokenize_samples(texts, load_tokenizer(model_dir), max_tokens)]


def test_calibration_forward_matches_the_model(tiny_llama: Path, tmp_path: Path) -> None:
    """The activations fed to layer 1 are what layer 0 produces inside the real model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    captured: dict[str, list[torch.Tensor]] = {"inputs": []}

    class Layer1InputConfig(ProcessorConfig):
        type: Literal["test_layer1_inputs"] = "test_layer1_inputs"

    class Layer1Inputs(Processor):
        type_name = "test_layer1_inputs"
        config_class = Layer1InputConfig
        requires_calibration = True

        def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
            if layer.index == 1:
                self.hook = layer.module.register_forward_pre_hook(
                    lambda m, args: captured["inputs"].append(args[0].detach().clone())
                )

        def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
            if layer.index == 1:
                self.hook.remove()

    reg = ProcessorRegistry([Layer1Inputs, default_registry().get("ascendv1_saver")])
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(["The river quietly builds the long report.", "def add(a, b):"]))
    msquant.quantize(
        tiny_llama,
        tmp_path / "out",
        {"spec": {"process": [{"type": "test_layer1_inputs"}]}},
        calib_path=calib,
        registry=reg,
        progress=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert len(captured["inputs"]) == 2
    for text, got in zip(json.loads(calib.read_text()), captured["inputs"], strict=True):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(got, hidden, rtol=1e-4, atol=1e-5)


def test_calibration_plugin_without_data_uses_the_shipped_set(
    tiny_llama: Path, tmp_path: Path, registry: ProcessorRegistry
) -> None:
    """No spec.dataset and no calib_path: the shipped default set calibrates, one call per sample."""
    from msquant.load.calibration import default_dataset_path, read_calibration_texts

    shipped = read_calibration_texts(default_dataset_path())
    assert len(shipped) >= 200
    config = {"spec": {"process": [{"type": "test_calib_probe"}]}}
    msquant.quantize(
        tiny_llama, tmp_path / "out", config, registry=registry, max_calib_tokens=8, progress=False
    )
    probe = CalibProbeProcessor.instances[0]
    assert [sum(s[0] for s in probe.forward_calls[i]) for i in (0, 1)] == [len(shipped)] * 2


def test_msmodelslim_default_dataset_name_maps_to_the_shipped_set(tmp_path: Path) -> None:
    from msquant.load.calibration import default_dataset_path, resolve_dataset_path

    assert resolve_dataset_path("mix_calib.jsonl", tmp_path) == default_dataset_path()
    (tmp_path / "mix_calib.jsonl").write_text('{"text": "a file of the user wins"}\n')
    assert resolve_dataset_path("mix_calib.jsonl", tmp_path) == tmp_path / "mix_calib.jsonl"
    assert resolve_dataset_path("other.jsonl", tmp_path) == Path("other.jsonl")


def test_calibration_dataset_is_resolved_beside_the_yaml(
    tiny_llama: Path, tmp_path: Path, registry: ProcessorRegistry
) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "samples.jsonl").write_text(
        "\n".join(
            json.dumps({"inputs_pretokenized": t}) for t in ["one sample", "two samples", "three"]
        )
    )
    config_file = folder / "calib.yaml"
    config_file.write_text(
        "spec:\n  dataset: samples.jsonl\n  process:\n    - type: test_calib_probe\n"
    )
    result = msquant.quantize(
        tiny_llama, tmp_path / "out", config_file, registry=registry, progress=False
    )
    assert result.calibration_samples == 3
    assert sum(s[0] for s in CalibProbeProcessor.instances[0].forward_calls[0]) == 3


def test_failing_plugin_leaves_no_output(tiny_llama: Path, tmp_path: Path) -> None:
    """An exception inside a hook aborts the run and removes the staging folder."""

    class ExplodeConfig(ProcessorConfig):
        type: Literal["test_explode"] = "test_explode"

    class Explode(Processor):
        type_name = "test_explode"
        config_class = ExplodeConfig

        def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
            (ctx.output_dir / "partial.bin").write_bytes(b"half")
            if layer.index == 1:
                raise msquant.QuantizationError(f"{layer.name}: simulated failure")

    reg = default_registry()
    reg.register(Explode)
    config = {"spec": {"process": [{"type": "test_explode"}]}}
    save = tmp_path / "out"
    with pytest.raises(msquant.QuantizationError, match="model.layers.1: simulated failure"):
        msquant.quantize(tiny_llama, save, config, registry=reg, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- entry points --------------------------------------------------------------------------------


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, *specs: tuple[str, str]) -> list[str]:
    """Make ``msquant.registry_base.entry_points`` return ``specs`` (name, value); returns the groups asked."""
    asked: list[str] = []

    def fake(*, group: str) -> list[EntryPoint]:
        asked.append(group)
        return [EntryPoint(name=name, value=value, group=group) for name, value in specs]

    monkeypatch.setattr("msquant.registry_base.entry_points", fake)
    return asked


BUILTIN_EPS = (
    ("linear_quant", "msquant.processors.linear_quant.processor:LinearQuantProcessor"),
    ("ascendv1_saver", "msquant.processors.formats.ascend.saver:AscendV1Saver"),
)


def test_load_entry_points_registers_a_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sys.modules[__name__].ProbeProcessor is ProbeProcessor
    asked = fake_entry_points(
        monkeypatch, *BUILTIN_EPS, ("test_probe", f"{__name__}:ProbeProcessor")
    )
    reg = ProcessorRegistry().load_entry_points()
    assert asked == [ENTRY_POINT_GROUP]
    assert reg.names() == ["ascendv1_saver", "linear_quant", "test_probe"]
    assert reg.get("test_probe") is ProbeProcessor
    # default_registry() goes through the same discovery.
    assert default_registry().get("test_probe") is ProbeProcessor


def test_load_entry_points_custom_group(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_entry_points(monkeypatch, ("test_probe", f"{__name__}:ProbeProcessor"))
    assert ProcessorRegistry().load_entry_points("my.group").names() == ["test_probe"]
    assert asked == ["my.group"]


def test_load_entry_points_tolerates_the_same_entry_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = ("test_probe", f"{__name__}:ProbeProcessor")
    fake_entry_points(monkeypatch, plugin, *BUILTIN_EPS, plugin)
    assert len(ProcessorRegistry().load_entry_points()) == 3


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("broken_plugin", "msquant_no_such_plugin_pkg.module:Processor", "No module named"),
        ("missing_attr", "msquant.processors.linear_quant.processor:NoSuchClass", "NoSuchClass"),
        ("not_a_processor", "json:dumps", "not a msquant.plugin.Processor subclass"),
        ("alias_name", f"{__name__}:ProbeProcessor", "declares type_name 'test_probe'"),
        ("linear_quant", f"{__name__}:ProbeProcessor", "claims the name 'linear_quant'"),
    ],
    ids=["import_error", "missing_attribute", "not_a_processor", "name_mismatch", "taken_name"],
)
def test_broken_entry_points_are_set_aside_and_refused_when_used(
    name: str, value: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_entry_points(monkeypatch, *BUILTIN_EPS, (name, value))
    registry = ProcessorRegistry().load_entry_points()  # the other processors stay usable
    assert "ascendv1_saver" in registry and name not in registry
    with pytest.raises(RegistryError) as info:
        registry.get(name)
    message = str(info.value)
    assert needle in message
    assert f"plugin {name!r}" in message and f"entry point {name} = {value}" in message
    assert isinstance(info.value, msquant.MsquantInputError)  # exit 2 from the CLI


def test_two_plugins_claiming_one_name(monkeypatch: pytest.MonkeyPatch) -> None:
    module = type(sys)("msquant_test_rival_plugin")

    class RivalConfig(ProcessorConfig):
        type: Literal["test_probe"] = "test_probe"

    class RivalProbe(Processor):
        type_name = "test_probe"
        config_class = RivalConfig

    RivalProbe.__module__ = module.__name__
    module.RivalProbe = RivalProbe  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    fake_entry_points(
        monkeypatch,
        ("test_probe", f"{__name__}:ProbeProcessor"),
        ("test_probe", f"{module.__name__}:RivalProbe"),
    )
    registry = ProcessorRegistry().load_entry_points()
    assert "test_probe" not in registry  # neither may be used while the other is installed
    with pytest.raises(RegistryError) as info:
        registry.get("test_probe")
    assert "ProbeProcessor" in str(info.value) and "RivalProbe" in str(info.value)


def test_cli_uses_entry_point_plugins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_cli: RunCli
) -> None:
    fake_entry_points(monkeypatch, *BUILTIN_EPS, ("test_probe", f"{__name__}:ProbeProcessor"))
    config = tmp_path / "plugin.yaml"
    config.write_text("spec:\n  process:\n    - {type: test_probe, tag: cli}\n" + LINEAR_QUANT)
    result = run_cli("validate", config)
    assert result.code == 0, result.err
    schema = run_cli("schema")
    assert schema.code == 0 and "test_probe" in schema.out


def test_cli_broken_plugin_is_set_aside(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_cli: RunCli
) -> None:
    """A broken plugin was an internal error (exit 1) for every command; now a config that does
    not name it is valid (with a warning), and one that does is refused naming it (exit 2)."""
    fake_entry_points(monkeypatch, *BUILTIN_EPS, ("broken_plugin", "msquant_no_such_plugin_pkg:X"))
    config = tmp_path / "c.yaml"
    config.write_text("spec: {}\n")
    result = run_cli("validate", config)
    assert result.code == 0, result.err
    assert "plugin 'broken_plugin'" in result.err and "msquant_no_such_plugin_pkg" in result.err
    config.write_text("spec: {process: [{type: broken_plugin}]}\n")
    result = run_cli("validate", config)
    assert result.code == 2, result.err
    assert (
        "spec.process[0].type: the processor plugin 'broken_plugin' (distribution an unknown "
        "distribution, entry point broken_plugin = msquant_no_such_plugin_pkg:X in group "
        "msquant.processors) failed to import: ModuleNotFoundError" in result.err
    )
