"""The savers and ``verify`` ask the model's adapter which linears engines fuse.

Qwen3.5's adapter (``processors/adapters/qwen3_5.py``) adds vLLM's fused Gated DeltaNet projections
``in_proj_qkvz`` (``in_proj_qkv`` + ``in_proj_z``) and ``in_proj_ba`` (``in_proj_b`` +
``in_proj_a``) to the generic table. vLLM matches GPTQ ``dynamic`` rules against those fused
names only, so a rule written per shard never reaches the layer vLLM builds. These tests export
the tiny ``qwen3_5_text`` model with mixed rules and check the written rules with an independent
copy of vLLM's matching (``tests/consumer_rules.py``; vLLM's own code runs on the same export in
``tests/consumers/test_adapter_rules.py``, opt-in), the AWQ config, the Saver base's fused check
and ``verify``'s fused checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from consumer_rules import vllm_linear_scheme

import msquant
import msquant.plugin
import msquant.plugin.devices
import msquant.plugin.numerics
from msquant import QuantizationError
from msquant.plugin import (
    ExportFormat,
    ExportReader,
    FormatRegistry,
    LayerReport,
    ModelAdapter,
    QuantizedLinear,
)
from msquant.processors.adapters.qwen3_5 import Qwen35Adapter
from msquant.processors.formats.autoawq.config import build_quantization_config as awq_config
from msquant.processors.formats.autoawq.saver import AutoAWQSaver, AutoAWQSaverConfig
from msquant.processors.formats.gptq.config import build_quantization_config, layer_units
from msquant.processors.formats.gptq.scheme import GPTQScheme

ATTN = "model.layers.0.linear_attn."
W4_G32 = {
    "dtype": "int4",
    "scope": "per_group",
    "symmetric": True,
    "method": "minmax",
    "ext": {"group_size": 32},
}
W8_CH = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
INT4 = {"bits": 4, "group_size": 32, "sym": True, "desc_act": False}
INT8 = {"bits": 8, "group_size": -1, "sym": True, "desc_act": False}
#: The rules a mixed export of the tiny Qwen3.5 must carry for the Gated DeltaNet projections.
FUSED_RULES = {
    "+:model\\.layers\\.0\\.linear_attn\\.(?:in_proj_qkv|in_proj_z|in_proj_qkvz)$": {
        "bits": 8,
        "group_size": -1,
    },
    "+:model\\.layers\\.0\\.linear_attn\\.(?:in_proj_b|in_proj_a|in_proj_ba)$": {
        "bits": 8,
        "group_size": -1,
    },
}


def mixed_config(save: str = "gptq_saver") -> dict[str, Any]:
    """int4 group 32 everywhere except the linear-attention layer's projections, int8."""
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": W4_G32},
                    "exclude": ["*linear_attn*"],
                },
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": W8_CH},
                    "include": ["*linear_attn*"],
                },
            ],
            "save": [{"type": save, "part_file_size": 0}],
        },
    }


@pytest.fixture(scope="module")
def qwen3_5_gptq(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The mixed GPTQ export of the tiny Qwen3.5 (read back by ``verify`` during the run)."""
    save = tmp_path_factory.mktemp("qwen3_5_gptq") / "out"
    msquant.quantize(tiny_model_factory("qwen3_5_text"), save, mixed_config(), progress=False)
    return save


def quantization_config(export: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((export / "config.json").read_text(encoding="utf-8"))
    return dict(config["quantization_config"])


# -- GPTQ dynamic rules ----------------------------------------------------------------------------


def test_gptq_rules_name_qwen3_5s_fused_projections(qwen3_5_gptq: Path) -> None:
    """One rule per fused matrix, matching its shards and the fused name vLLM builds."""
    qc = quantization_config(qwen3_5_gptq)
    assert (qc["bits"], qc["group_size"]) == (4, 32)
    for rule, override in FUSED_RULES.items():
        assert qc["dynamic"][rule] == override
    assert not [rule for rule in qc["dynamic"] if rule.endswith(("in_proj_qkv$", "in_proj_z$"))]
    # vLLM's lookup (re.match on the names it builds, first rule wins), re-implemented
    for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj"):
        assert vllm_linear_scheme(qc, ATTN + name) == INT8, name
    assert vllm_linear_scheme(qc, "model.layers.1.self_attn.qkv_proj") == INT4
    assert vllm_linear_scheme(qc, "model.layers.0.mlp.gate_up_proj") == INT4


def test_the_generic_table_wrote_rules_vllm_never_matches() -> None:
    """Why the adapter is asked: the same layer's units under the generic heuristics give one
    rule per shard, and vLLM's lookup of ``in_proj_qkvz`` falls through to the base scheme."""
    int4, int8 = GPTQScheme(4, 32, True), GPTQScheme(8, -1, True)
    shapes = {"in_proj_qkv": 128, "in_proj_z": 64, "in_proj_b": 4, "in_proj_a": 4, "out_proj": 64}
    linears = {ATTN + n: (int8, torch.nn.Linear(64, out)) for n, out in shapes.items()}
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_expert.down_proj"]
    linears.update({f"model.layers.0.{n}": (int4, torch.nn.Linear(64, 64)) for n in mlp})
    linears[ATTN + "out_proj"] = (int4, torch.nn.Linear(64, 64))  # base: 5 int4 against 4 int8
    generic = build_quantization_config(
        layer_units("model.layers.0", linears, ModelAdapter()), "gptq", ["minmax"]
    )
    adapted = build_quantization_config(
        layer_units("model.layers.0", linears, Qwen35Adapter()), "gptq", ["minmax"]
    )
    assert vllm_linear_scheme(generic, ATTN + "in_proj_qkvz") == INT4  # stored int8: mis-read
    assert vllm_linear_scheme(generic, ATTN + "in_proj_qkv") == INT8
    assert vllm_linear_scheme(adapted, ATTN + "in_proj_qkvz") == INT8
    assert vllm_linear_scheme(adapted, ATTN + "in_proj_ba") == INT8
    assert set(FUSED_RULES) <= set(adapted["dynamic"])


def test_a_rule_for_an_adapter_fused_name_reaches_its_shards(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A ``dynamic`` rule written for the name vLLM loads Qwen3.5's fused projection under
    (``in_proj_qkvz``, ``in_proj_ba``, from the adapter, not the generic table) applies to both shards, in the
    plan and in the export, as vLLM applies it when it reads the export back."""
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": W4_G32},
                    "dynamic": {".*in_proj_(?:qkvz|ba)": {"bits": 8, "group_size": -1}},
                }
            ],
            "save": [{"type": "gptq_saver", "part_file_size": 0}],
        },
    }
    model = tiny_model_factory("qwen3_5_text")
    rows = {row.module: row for row in msquant.plan(model, config)}
    for shard in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        row = rows[ATTN + shard]
        assert (row.bits, row.group_size) == (8, -1), shard
        assert row.decided_by == 'spec.process[0].dynamic[".*in_proj_(?:qkvz|ba)"]'
    assert (rows[ATTN + "out_proj"].bits, rows[ATTN + "out_proj"].group_size) == (4, 32)
    save = tmp_path / "out"
    msquant.quantize(model, save, config, progress=False)
    qc = quantization_config(save)
    assert vllm_linear_scheme(qc, ATTN + "in_proj_qkvz") == INT8
    assert vllm_linear_scheme(qc, ATTN + "in_proj_ba") == INT8
    assert vllm_linear_scheme(qc, ATTN + "out_proj") == INT4


# -- verify ----------------------------------------------------------------------------------------


def test_verify_reads_the_export_back_clean(qwen3_5_gptq: Path) -> None:
    report = msquant.verify_export(qwen3_5_gptq)
    assert report.ok, report.errors
    assert {ATTN + "in_proj_qkv", ATTN + "in_proj_z"} <= {layer.name for layer in report.layers}


def test_verify_refuses_per_shard_rules_vllm_cannot_match(
    qwen3_5_gptq: Path, tmp_path: Path
) -> None:
    """The GPTQ reader checks the rules against the adapter's fused names: the rules the generic
    table wrote (one per shard) leave vLLM's ``in_proj_qkvz`` in the base scheme."""
    config = json.loads((qwen3_5_gptq / "config.json").read_text(encoding="utf-8"))
    dynamic = config["quantization_config"]["dynamic"]
    for rule in FUSED_RULES:
        override = dynamic.pop(rule)
        prefix, _, alternation = rule.partition("(?:")
        for shard in alternation.removesuffix(")$").split("|")[:2]:
            dynamic[f"{prefix}{shard}$"] = override
    export = tmp_path / "per_shard"
    export.mkdir()
    for file in qwen3_5_gptq.iterdir():
        if file.name not in ("config.json", "quantize_config.json", "msquant_export.json"):
            (export / file.name).write_bytes(file.read_bytes())
    (export / "config.json").write_text(json.dumps(config), encoding="utf-8")
    quantize_config = json.dumps(config["quantization_config"])
    (export / "quantize_config.json").write_text(quantize_config, encoding="utf-8")
    errors = msquant.verify_export(export).errors
    for fused, shards in (("in_proj_qkvz", "in_proj_qkv', '"), ("in_proj_ba", "in_proj_b', '")):
        expected = (
            f"{ATTN}{fused}: vLLM matches quantization_config.dynamic against the fused name and "
            f"gets int4 group 32 sym, but its shards ['{ATTN}{shards}"
        )
        assert [e for e in errors if e.startswith(expected)], errors
    assert len(errors) == 2, errors


class SchemesReader(ExportReader):
    """A reader whose stored schemes are given: the fused-shard check of ``verify`` alone."""

    format_name = "schemes"
    SCHEMES: dict[str, Hashable] = {ATTN + "in_proj_qkv": "int8", ATTN + "in_proj_z": "FLOAT"}

    def quantized_modules(self) -> list[str]:
        return []

    def decode(self, module: str) -> None:
        return None

    def entry(self, module: str) -> LayerReport:
        return LayerReport(module, "schemes")

    def schemes(self) -> tuple[dict[str, Hashable], dict[str, str]]:
        return dict(self.SCHEMES), {name: str(s) for name, s in self.SCHEMES.items()}


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama"])
def test_verify_checks_the_fused_shards_the_exports_adapter_names(
    model_type: str, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    registry = FormatRegistry(
        [
            ExportFormat(
                "schemes", "test", lambda path: True, reader=lambda path, f: SchemesReader(path, f)
            )
        ]
    )
    errors = msquant.verify_export(tmp_path, formats=registry).errors
    if model_type == "llama":  # the generic table knows no in_proj_qkvz
        assert errors == []
    else:
        assert errors == [
            f"{ATTN}in_proj_qkvz is loaded as one fused matrix by vLLM / vLLM-Ascend, but its "
            f"shards differ ({ATTN}in_proj_qkv: int8, {ATTN}in_proj_z: FLOAT); give them the same "
            "quantization (or skip all of them)"
        ]


# -- the Saver base and the AWQ config -------------------------------------------------------------


def test_the_saver_base_refuses_a_half_quantized_qwen3_5_projection(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The plan refuses this before weights load; the savers' own check (the last word before a
    layer is written) asks the same adapter."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen3_5_text"))
    layer = model.model.layers[0]
    linear = layer.linear_attn.in_proj_qkv
    qweight = msquant.plugin.numerics.quantize_weight_minmax(linear.weight.detach(), 4, True, 32)
    layer.linear_attn.in_proj_qkv = QuantizedLinear.from_linear(linear, qweight, "minmax")
    ctx = msquant.plugin.RunContext(
        model, tmp_path, tmp_path / "out", msquant.plugin.devices.get_backend("cpu"), []
    )
    saver = AutoAWQSaver(AutoAWQSaverConfig())
    saver.setup(ctx)
    assert type(saver.adapter) is Qwen35Adapter
    with pytest.raises(QuantizationError) as info:
        saver.check_fused(layer, "model.layers.0")
    assert str(info.value) == (
        f"autoawq_saver: {ATTN}in_proj_qkvz is loaded as one fused matrix by vLLM / vLLM-Ascend, but "
        f"its shards differ ({ATTN}in_proj_qkv: int4 group 32 sym, {ATTN}in_proj_z: FLOAT); give "
        "them the same quantization (or skip all of them)"
    )
    saver.adapter = ModelAdapter()
    saver.check_fused(layer, "model.layers.0")  # the generic table sees no fused group here


def test_awq_lists_the_fused_name_of_a_float_qwen3_5_projection() -> None:
    floats = [ATTN + "in_proj_qkv", ATTN + "in_proj_z", ATTN + "in_proj_b"]
    config = awq_config(128, floats, Qwen35Adapter())
    assert config["modules_to_not_convert"] == [*floats, ATTN + "in_proj_qkvz"]
    assert awq_config(128, floats, ModelAdapter())["modules_to_not_convert"] == floats
