"""``group``: a container of ``spec.process`` entries applied together to each decoder layer.

The group's children act on each layer in order over one flow of the calibration data, which is
what msquant already does with the entries of ``spec.process``: a group of two ``linear_quant``
entries must therefore export exactly what the same two entries export flat. Its children are
validated as entries of their own, with YAML paths through ``configs[j]``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
from conftest import CALIB_TXT

import msquant
from msquant import ConfigError
from msquant.config.processors import build_processors
from msquant.config.spec import MAX_NESTING, validate_config
from msquant.plugin import Processor, ProcessorConfig, ProcessorRegistry
from msquant.run.checkpoint.opening import checkpoint_blocker
from msquant.run.runner import batch_token_limit, calibrates_on_quantized, needs_calibration

GPTQ_ATTN = {
    "type": "linear_quant",
    "qconfig": {
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "gptq"}
    },
    "include": ["*self_attn*"],
}
MINMAX_MLP = {
    "type": "linear_quant",
    "qconfig": {
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": False, "method": "minmax"}
    },
    "include": ["*mlp*"],
    "exclude": ["*down_proj"],
}
W8A8_STATIC = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"dtype": "int8", "scope": "per_tensor", "symmetric": False, "method": "minmax"},
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"},
    },
    "include": ["*down_proj"],
}


def cfg(*process: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": [copy.deepcopy(p) for p in process], **spec},
    }


def group(*children: dict[str, Any]) -> dict[str, Any]:
    return {"type": "group", "configs": [copy.deepcopy(c) for c in children]}


#: Files that record the config itself (the copied YAML, and the marker listing its hash) or times.
CONFIG_RECORDS = {"quant_report.json", "llama_best_practice.yaml", "msquant_export.json"}


def files_of(directory: Path) -> dict[str, bytes]:
    """Every exported file's bytes but those recording the config text or times."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in CONFIG_RECORDS
    }


def issues(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data, msquant.plugin.default_registry())
    return {issue.path: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_group_exports_exactly_what_the_flat_entries_export(
    tiny_llama: Path, tmp_path: Path, runner: str
) -> None:
    flat = cfg(GPTQ_ATTN, MINMAX_MLP, W8A8_STATIC, runner=runner)
    grouped = cfg(group(GPTQ_ATTN, MINMAX_MLP), W8A8_STATIC, runner=runner)
    options: dict[str, Any] = {"calib_path": CALIB_TXT, "progress": False}
    flat_run = msquant.quantize(tiny_llama, tmp_path / "flat", flat, **options)
    group_run = msquant.quantize(tiny_llama, tmp_path / "group", grouped, **options)
    assert group_run.quantized_modules == flat_run.quantized_modules
    assert len(group_run.quantized_modules) == 2 * 7  # q/k/v/o, gate/up, down per layer
    flat_files, group_files = files_of(tmp_path / "flat"), files_of(tmp_path / "group")
    assert any(name.endswith(".safetensors") for name in flat_files)
    assert group_files.keys() == flat_files.keys()
    assert (tmp_path / "group" / "llama_best_practice.yaml").read_text().count("type: group") == 1
    different = [name for name in flat_files if group_files[name] != flat_files[name]]
    assert different == []


def test_group_plan_names_the_child_that_decides(tiny_llama: Path) -> None:
    rows = {
        row.module: row
        for row in msquant.plan(tiny_llama, cfg(W8A8_STATIC, group(GPTQ_ATTN, MINMAX_MLP)))
    }
    assert rows["model.layers.0.self_attn.q_proj"].decided_by == "spec.process[1].configs[0]"
    assert rows["model.layers.1.mlp.up_proj"].decided_by == "spec.process[1].configs[1]"
    assert rows["model.layers.1.mlp.up_proj"].sym is False
    assert rows["model.layers.0.mlp.down_proj"].decided_by == "spec.process[0]"
    assert rows["model.layers.0.mlp.down_proj"].act == "W8A8"


def test_two_children_selecting_one_module_are_refused(tiny_llama: Path) -> None:
    everything = copy.deepcopy(MINMAX_MLP)
    everything["include"] = ["*"]
    everything["exclude"] = []
    with pytest.raises(msquant.QuantizationError, match=r"group: model\.layers\.0\.self_attn\.q_proj "
                       r"is selected by configs\[0\] and configs\[1\]"):  # fmt: skip
        msquant.plan(tiny_llama, cfg(group(GPTQ_ATTN, everything)))


W8A8_DYNAMIC = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"},
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"},
    },
}
ITER_SMOOTH = {"type": "iter_smooth", "alpha": 0.9}
FLEX_SMOOTH = {"type": "flex_smooth_quant", "alpha": 0.6, "beta": 0.4}


@pytest.mark.parametrize(
    ("entries", "names"),
    [
        ([group(ITER_SMOOTH, W8A8_DYNAMIC)], "group configs[0] (iter_smooth) shares the group "
         "with configs[1] (linear_quant)"),
        ([group(W8A8_DYNAMIC, FLEX_SMOOTH)], "group configs[1] (flex_smooth_quant) shares the "
         "group with configs[0] (linear_quant)"),
        ([group(group(ITER_SMOOTH), W8A8_DYNAMIC)], "group configs[0].configs[0] (iter_smooth) "
         "shares the group with configs[1] (linear_quant)"),
    ],
)  # fmt: skip
def test_smoothing_and_linear_quant_in_one_group_are_refused(
    tiny_llama: Path, tmp_path: Path, entries: list[dict[str, Any]], names: str
) -> None:
    """msModelSlim 26.1.0 skips such a smoothing (or fails when it comes second): refused."""
    with pytest.raises(msquant.QuantizationError) as info:
        msquant.quantize(
            tiny_llama, tmp_path / "out", cfg(*entries), calib_path=CALIB_TXT, progress=False
        )
    message = str(info.value)
    assert names in message
    assert (
        "msModelSlim 26.1.0 smooths nothing in such a group (linear_quant wraps the layer's "
        "linears before the calibration forward" in message
    )
    assert "Put the smoothing entry before the group in spec.process to smooth" in message
    assert not (tmp_path / "out").exists()


def test_a_group_of_smoothing_processors_smooths_as_the_flat_entries(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Without linear_quant beside them, smoothing children smooth (msModelSlim too: its export
    of this group equals msquant's, tests/oracle), each from the statistics of one forward."""
    for name, entries in (
        ("grouped", [group(ITER_SMOOTH), W8A8_DYNAMIC]),
        ("flat", [ITER_SMOOTH, W8A8_DYNAMIC]),
    ):
        msquant.quantize(
            tiny_llama, tmp_path / name, cfg(*entries), calib_path=CALIB_TXT, progress=False
        )
    assert files_of(tmp_path / "grouped") == files_of(tmp_path / "flat")


def test_nested_schema_errors_name_the_yaml_path() -> None:
    bad_dtype = copy.deepcopy(MINMAX_MLP)
    bad_dtype["qconfig"]["weight"]["dtype"] = "int3"
    typo = copy.deepcopy(MINMAX_MLP)
    typo["includ"] = ["*"]
    found = issues(
        cfg(GPTQ_ATTN, MINMAX_MLP, group(bad_dtype, typo, {"type": "quarot_x"}, {"configs": []}))
    )
    assert set(found) == {
        "spec.process[2].configs[0].qconfig.weight.dtype",
        "spec.process[2].configs[1].includ",
        "spec.process[2].configs[2].type",
        "spec.process[2].configs[3].type",
    }
    assert "int3" in found["spec.process[2].configs[0].qconfig.weight.dtype"]
    assert found["spec.process[2].configs[1].includ"].startswith("unknown key; valid keys here:")
    assert (
        "unknown processor type 'quarot_x'; registered process types: dynamic_cache, fa3_quant, "
        "flex_awq_ssz, flex_smooth_quant, float_sparse, group, iter_smooth, linear_quant, online_quarot, quarot, "
        "smooth_quant" in (found["spec.process[2].configs[2].type"])
    )
    assert "missing key 'type'" in found["spec.process[2].configs[3].type"]


def test_group_requires_configs_and_refuses_unknown_keys() -> None:
    found = issues(cfg({"type": "group", "config": []}))
    assert found["spec.process[0].configs"] == "Field required"
    assert found["spec.process[0].config"].startswith("unknown key; valid keys here: type, configs")


def test_semantic_errors_of_children_are_reported_with_the_schema_errors() -> None:
    asym_tokens = copy.deepcopy(MINMAX_MLP)  # an activation scheme msquant does not implement
    asym_tokens["qconfig"]["act"] = {
        "dtype": "int8", "scope": "per_token", "symmetric": False, "method": "minmax"
    }  # fmt: skip
    typo = copy.deepcopy(GPTQ_ATTN)
    typo["bogus"] = 1
    alone = issues(cfg(group(asym_tokens)))
    path = "spec.process[0].configs[0].qconfig.act"
    assert path in alone
    # one child failing its schema does not hide the semantic problem of its sibling
    together = issues(cfg(group(typo, asym_tokens)))
    sibling = "spec.process[0].configs[1].qconfig.act"
    assert set(together) == {"spec.process[0].configs[0].bogus", sibling}
    assert together[sibling] == alone[path]
    assert "is not implemented; implemented:" in alone[path]


def test_groups_nest_with_paths_through_every_level() -> None:
    bad = copy.deepcopy(MINMAX_MLP)
    bad["qconfig"]["weight"]["symmetric"] = "sometimes"
    inner = group(GPTQ_ATTN, group(bad))
    found = issues(cfg(group(inner)))
    assert list(found) == [
        "spec.process[0].configs[0].configs[1].configs[0].qconfig.weight.symmetric"
    ]
    ok = cfg(group(group(GPTQ_ATTN), MINMAX_MLP))
    validate_config(ok, msquant.plugin.default_registry())
    too_deep: dict[str, Any] = GPTQ_ATTN
    for _ in range(MAX_NESTING + 1):
        too_deep = group(too_deep)
    assert issues(cfg(too_deep))  # deeper than MAX_NESTING is refused, not silently accepted


class _Probe(ProcessorConfig):
    type: Literal["probe"] = "probe"
    calibrates: bool = True
    batches: bool = True
    on_quantized: bool = False


class Probe(Processor):
    """Records the hooks it hears; its runner attributes come from its config."""

    type_name = "probe"
    config_class = _Probe
    config: _Probe
    calls: ClassVar[list[str]] = []

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self.requires_calibration = self.config.calibrates
        self.batch_calibration = self.config.batches
        self.calibrate_on_quantized = self.config.on_quantized

    def calibration_passes(self, layer: msquant.plugin.DecoderLayer) -> int:
        return 2 if self.config.on_quantized else 1

    def before_layer(
        self, ctx: msquant.plugin.RunContext, layer: msquant.plugin.DecoderLayer
    ) -> None:
        Probe.calls.append(f"{id(self)}:before:{layer.index}")

    def after_layer(
        self, ctx: msquant.plugin.RunContext, layer: msquant.plugin.DecoderLayer
    ) -> None:
        Probe.calls.append(f"{id(self)}:after:{layer.index}")


def probe_registry() -> ProcessorRegistry:
    registry = msquant.plugin.default_registry()
    registry.register(Probe)
    return registry


def built_group(*children: dict[str, Any]) -> Processor:
    config = validate_config(cfg(group(*children)), probe_registry())
    processors = build_processors(config, probe_registry())
    return processors[0]


def test_group_derives_the_runner_attributes_from_its_children() -> None:
    plain = built_group({"type": "probe", "calibrates": False})
    assert not needs_calibration([plain])
    mixed = built_group(
        {"type": "probe", "calibrates": False, "batches": False},  # not calibrating: ignored
        {"type": "probe", "on_quantized": True},
    )
    assert needs_calibration([mixed]) and calibrates_on_quantized([mixed])
    assert batch_token_limit([mixed]) > 0
    one_by_one = built_group({"type": "probe"}, {"type": "probe", "batches": False})
    assert batch_token_limit([one_by_one]) == 0 and not calibrates_on_quantized([one_by_one])
    # the probe is not resumable, so a run holding it in a group writes no checkpoints
    assert "probe cannot be resumed" in (checkpoint_blocker([one_by_one]) or "")
    linear = built_group(GPTQ_ATTN, MINMAX_MLP)
    assert checkpoint_blocker([linear]) is None


def test_group_forwards_hooks_in_order(tiny_llama: Path, tmp_path: Path) -> None:
    Probe.calls.clear()
    data = cfg(group({"type": "probe"}, {"type": "probe", "on_quantized": True}), MINMAX_MLP)
    msquant.quantize(
        tiny_llama, tmp_path / "out", data, calib_path=CALIB_TXT, progress=False,
        registry=probe_registry(),
    )  # fmt: skip
    owners = list(dict.fromkeys(call.split(":")[0] for call in Probe.calls))  # first seen first
    assert len(owners) == 2
    letters = {owner: letter for owner, letter in zip(owners, "AB", strict=True)}
    named = [letters[call.split(":")[0]] + call[call.index(":") :] for call in Probe.calls]
    assert named == [
        "A:before:0", "B:before:0", "A:after:0", "B:after:0",
        "A:before:1", "B:before:1", "A:after:1", "B:after:1",
    ]  # fmt: skip


def test_a_group_in_a_dp_layer_wise_run_gives_the_flat_single_process_export(
    tiny_llama: Path, tmp_path: Path, run_cli: Any
) -> None:
    """Two processes share the calibration batches and the GPTQ solves of a group's children as
    they do for flat entries: the export is the single-process flat run's."""
    import yaml

    flat = cfg(GPTQ_ATTN, MINMAX_MLP, runner="dp_layer_wise")
    grouped = cfg(group(GPTQ_ATTN, MINMAX_MLP), runner="dp_layer_wise")
    paths = {}
    for name, data in (("flat", flat), ("group", grouped)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(data), encoding="utf-8")
    common = ["--calib_path", CALIB_TXT, "--max_calib_tokens", "24", "--no_progress"]
    single = run_cli("quant", "--model_path", tiny_llama, "--save_path", tmp_path / "single",
                     "--config_path", paths["flat"], *common)  # fmt: skip
    assert single.code == 0, single.err
    pair = run_cli("quant", "--model_path", tiny_llama, "--save_path", tmp_path / "pair",
                   "--config_path", paths["group"], "--nproc", "2", *common)  # fmt: skip
    assert pair.code == 0, pair.err
    assert files_of(tmp_path / "pair") == files_of(tmp_path / "single")
