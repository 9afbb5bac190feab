"""Per-module quantization end to end: the issue's example ``dynamic`` rules on a 22-layer tiny
Llama, exported as GPTQ and compressed-tensors, read back by ``msquant verify``, by an independent
transcription of vLLM's rule lookup (for the GPTQ ``dynamic`` written) and by transformers (for
the compressed-tensors export)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
import msquant.plugin
import msquant.plugin.numerics
import msquant.plugin.planning
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer

NUM_LAYERS = 22
PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
NAMES = [f"model.layers.{i}.{part}" for i in range(NUM_LAYERS) for part in PARTS]
FUSED = [
    f"model.layers.{i}.{fused}"
    for i in range(NUM_LAYERS)
    for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj")
]
IDS = torch.tensor([[1, 5, 9, 42, 7, 300, 11, 64, 3, 17]])

#: The issue's first example, on a 4-bit group-32 base.
RULES_1 = {
    r".*\.(?:1[0-5])\..*": {"bits": 8},
    r".*\.(?:1[6-9]|20|21)\..*": {"bits": 8, "group_size": 64},
}
#: The issue's second example with the gate rules widened to the whole fused gate/up group
#: (``gate`` alone matches gate_proj but not up_proj, which splits vLLM's gate_up_proj).
RULES_2 = {
    r"+:.*\.18\..*(?:gate|up).*": {"bits": 4, "group_size": 32},
    r".*\.19\..*(?:gate|up).*": {"bits": 8, "group_size": 64},
    r"-:.*\.20\..*(?:gate|up).*": {},
    "-:.*down.*": {},
}
#: The second example as the issue writes it.
RULES_2_LITERAL = {
    r"+:.*\.18\..*gate.*": {"bits": 4, "group_size": 32},
    r".*\.19\..*gate.*": {"bits": 8, "group_size": 64},
    r"-:.*\.20\..*gate.*": {},
    "-:.*down.*": {},
}

Scheme = tuple[int, int] | None  # (bits, group_size), None = float


def layer_of(name: str) -> int:
    return int(name.split(".")[2])


def expected_1(name: str) -> Scheme:
    layer = layer_of(name)
    if 10 <= layer <= 15:
        return (8, 32)
    if 16 <= layer <= 21:
        return (8, 64)
    return (4, 32)


def expected_2(name: str) -> Scheme:
    layer, leaf = layer_of(name), name.rpartition(".")[2]
    if "down" in leaf or (layer == 20 and leaf in ("gate_proj", "up_proj", "gate_up_proj")):
        return None
    if layer == 19 and leaf in ("gate_proj", "up_proj", "gate_up_proj"):
        return (8, 64)
    return (4, 32)


def config(dynamic: dict[str, Any], *savers: str, method: str = "minmax") -> dict[str, Any]:
    weight = {
        "dtype": "int4",
        "scope": "per_group",
        "symmetric": True,
        "method": method,
        "ext": {"group_size": 32},
    }
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"weight": weight}, "dynamic": dynamic}
            ],
            "save": [{"type": saver, "part_file_size": 0} for saver in savers],
        },
    }


@pytest.fixture(scope="module")
def deep_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def exports(deep_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both examples quantized once, each exported as GPTQ and compressed-tensors."""
    found = {}
    for key, rules in (("1", RULES_1), ("2", RULES_2)):
        save = tmp_path_factory.mktemp(f"per_module_{key}") / "out"
        msquant.quantize(
            deep_llama, save, config(rules, "gptq_saver", "compressed_tensors"), progress=False
        )
        found[key] = save
    return found


def quantization_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))["quantization_config"]


def vllm_lookup(qconfig: dict[str, Any], name: str) -> Scheme:
    """vLLM's ``get_dynamic_override`` + ``override_config`` (formats.md 1.3): rules in file order,
    a ``-:`` match leaves the layer unquantized, the first positive match overrides bits /
    group_size, other keys come from the base."""
    for pattern, overrides in qconfig.get("dynamic", {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return None
        elif re.match(pattern.removeprefix("+:"), name):
            return (
                overrides.get("bits", qconfig["bits"]),
                overrides.get("group_size", qconfig["group_size"]),
            )
    return (qconfig["bits"], qconfig["group_size"])


def test_plan_of_the_first_example(deep_llama: Path) -> None:
    rows = {row.module: row for row in msquant.plan(deep_llama, config(RULES_1))}
    assert list(rows) == NAMES
    for name, row in rows.items():
        assert (row.bits, row.group_size) == expected_1(name), name
    assert rows["model.layers.9.mlp.up_proj"].decided_by == "spec.process[0]"
    assert (
        rows["model.layers.12.mlp.up_proj"].decided_by
        == r'spec.process[0].dynamic[".*\.(?:1[0-5])\..*"]'
    )
    assert (
        rows["model.layers.21.mlp.up_proj"].decided_by
        == r'spec.process[0].dynamic[".*\.(?:1[6-9]|20|21)\..*"]'
    )
    assert rows["model.layers.1.mlp.up_proj"].bits == 4  # ".1." is not ".1[0-5]."


def test_plan_of_the_second_example(deep_llama: Path) -> None:
    result = msquant.plugin.planning.build_plan(deep_llama, config(RULES_2))
    # no rule warning (the widened rules match gate_up_proj too); only the default Ascend saver's
    # notes on what vLLM-Ascend does not load (W4A16, per-group W8A16)
    assert result.ok and result.warnings
    assert all(w.startswith("ascendv1_saver: vLLM-Ascend") for w in result.warnings)
    rows = {row.module: row for row in result.rows}
    for name, row in rows.items():
        assert (None if row.skipped else (row.bits, row.group_size)) == expected_2(name), name
    assert (
        rows["model.layers.18.mlp.gate_proj"].decided_by
        == r'spec.process[0].dynamic["+:.*\.18\..*(?:gate|up).*"]'
    )
    # the negative rules come first: -:.*down.* decides down_proj of layer 19, not the 19 rule
    assert (
        rows["model.layers.19.mlp.down_proj"].decided_by == 'spec.process[0].dynamic["-:.*down.*"]'
    )


def test_literal_gate_rules_are_refused_before_weights_load(
    deep_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(msquant.QuantizationError) as info:
        msquant.quantize(
            deep_llama, tmp_path / "out", config(RULES_2_LITERAL, "gptq_saver"), progress=False
        )
    message = str(info.value)
    assert "(2 problems)" in message
    assert (
        "model.layers.19.mlp.gate_up_proj is loaded as one fused matrix by vLLM / vLLM-Ascend, but "
        "its shards differ (model.layers.19.mlp.gate_proj: int8 group 64 sym by "
        r'dynamic[".*\.19\..*gate.*"], model.layers.19.mlp.up_proj: int4 group 32 sym by qconfig)'
    ) in message
    assert (
        r'model.layers.20.mlp.gate_proj: not quantized by dynamic["-:.*\.20\..*gate.*"]' in message
    )
    # layer 18's rule gives gate_proj the base scheme again: no split there
    assert "layers.18" not in message
    assert not (tmp_path / "out").exists()


def test_literal_gate_rules_are_reported_against_vllm_names(deep_llama: Path) -> None:
    result = msquant.plugin.planning.build_plan(deep_llama, config(RULES_2_LITERAL))
    layer_18 = [w for w in result.warnings if r"\.18\." in w]
    assert len(layer_18) == 1
    assert (
        "matches model.layers.18.mlp.gate_up_proj, the fused name vLLM and SGLang match"
        in layer_18[0]
    )
    assert "but only gate_proj of its shards gate_proj, up_proj here" in layer_18[0]


@pytest.mark.parametrize(("key", "expected"), [("1", expected_1), ("2", expected_2)])
def test_gptq_export_dynamic_gives_every_module_its_scheme_in_vllm(
    exports: dict[str, Path], key: str, expected: Callable[[str], Scheme]
) -> None:
    folder = exports[key] / "gptq_saver"
    qconfig = quantization_config(folder)
    assert (qconfig["bits"], qconfig["group_size"], qconfig["sym"]) == (4, 32, True)
    rules = list(qconfig["dynamic"])
    negatives = [r for r in rules if r.startswith("-:")]
    assert rules[: len(negatives)] == negatives  # GPTQModel's saved order: negatives first
    for name in NAMES + FUSED:
        assert vllm_lookup(qconfig, name) == expected(name), name
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        for name in NAMES:
            scheme = expected(name)
            if scheme is None:
                assert f"{name}.weight" in handle.keys() and f"{name}.qweight" not in handle.keys()
                continue
            bits, group_size = scheme
            in_features = 128 if name.endswith("down_proj") else 64
            assert handle.get_slice(f"{name}.qweight").get_shape()[0] == in_features * bits // 32, (
                name
            )
            assert handle.get_slice(f"{name}.scales").get_shape()[0] == in_features // group_size, (
                name
            )


@pytest.mark.parametrize(("key", "expected"), [("1", expected_1), ("2", expected_2)])
def test_compressed_tensors_groups_and_ignore(
    exports: dict[str, Path], key: str, expected: Callable[[str], Scheme]
) -> None:
    qconfig = quantization_config(exports[key] / "compressed_tensors")
    assert qconfig["ignore"] == [n for n in NAMES if expected(n) is None] + ["lm_head"]
    resolved: dict[str, Scheme] = {}
    for group in qconfig["config_groups"].values():
        weights = group["weights"]
        assert weights["symmetric"] and weights["strategy"] == "group"
        for target in group["targets"]:
            resolved[target] = (weights["num_bits"], weights["group_size"])
    assert resolved.pop("Linear") == (4, 32)
    assert resolved == {n: s for n in NAMES if (s := expected(n)) not in (None, (4, 32))}


@pytest.mark.parametrize(("key", "expected"), [("1", expected_1), ("2", expected_2)])
def test_msquant_verify_reads_back_each_module_precision(
    exports: dict[str, Path],
    key: str,
    expected: Callable[[str], Scheme],
    run_cli: Callable[..., Any],
) -> None:
    result = run_cli("verify", exports[key])
    assert result.code == 0, result.err
    for saver in ("gptq_saver", "compressed_tensors"):
        report = msquant.verify_export(exports[key] / saver)
        assert report.ok, report.errors
        found = {layer.name: (layer.bits, layer.group_size) for layer in report.layers}
        assert found == {n: s for n in NAMES if (s := expected(n)) is not None}, saver


def test_transformers_loads_the_mixed_export_with_the_expected_logits(
    deep_llama: Path, exports: dict[str, Path]
) -> None:
    """Real client: transformers + compressed-tensors serve example 2; its logits equal the
    float model's with each linear fake-quantized by its expected scheme (and not with another)."""
    original = AutoModelForCausalLM.from_pretrained(str(deep_llama)).eval()

    def reference(scheme_of: Callable[[str], Scheme]) -> torch.Tensor:
        model = copy.deepcopy(original)
        with torch.no_grad():
            for name in NAMES:
                scheme = scheme_of(name)
                if scheme is None:
                    continue
                linear = model.get_submodule(name)
                assert isinstance(linear, nn.Linear)
                q = msquant.plugin.numerics.quantize_weight_minmax(
                    linear.weight, scheme[0], True, scheme[1]
                )
                linear.weight.copy_(q.dequantize())
            return model(IDS).logits

    client = AutoModelForCausalLM.from_pretrained(str(exports["2"] / "compressed_tensors")).eval()
    with torch.no_grad():
        logits = client(IDS).logits.float()
    scale = float(logits.abs().max())
    assert float((logits - reference(expected_2)).abs().max()) <= 1e-3 * scale
    assert float((logits - reference(expected_1)).abs().max()) > 1e-3 * scale


def float_inputs(model_dir: Path, names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Inputs of the named linears in a plain float forward over the calibration samples."""
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(read_calibration_texts(CALIB_TXT), load_tokenizer(model_dir), 48)
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    handles = [
        model.get_submodule(name).register_forward_hook(
            lambda _, args, __, name=name: inputs[name].append(args[0].detach().clone())
        )
        for name in names
    ]
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return inputs


def test_gptq_method_takes_per_module_overrides(tiny_llama: Path, tmp_path: Path) -> None:
    """GPTQ with layer 1 at int8 per-channel asymmetric, act-order and other damping: its codes
    equal GPTQ run directly with those settings (and not with the base ones). The base runs
    msModelSlim's numerics (no act-order, float inputs), so only the rule's modules are
    recorded with ``actorder: "weight"`` in the compressed-tensors export."""
    dynamic = {
        r".*\.1\..*": {
            "bits": 8,
            "group_size": -1,
            "sym": False,
            "desc_act": True,
            "damp_percent": 0.05,
        }
    }
    cfg = config(dynamic, "ascendv1_saver", "compressed_tensors", method="gptq")
    cfg["spec"]["process"][0]["qconfig"]["weight"]["ext"]["numerics"] = "msmodelslim"
    save = tmp_path / "out"
    msquant.quantize(
        tiny_llama, save, cfg, progress=False, calib_path=CALIB_TXT, max_calib_tokens=48
    )
    qconfig = quantization_config(save / "compressed_tensors")
    groups = {
        (g["weights"]["num_bits"], g["weights"].get("group_size"), g["weights"]["symmetric"]): g[
            "targets"
        ]
        for g in qconfig["config_groups"].values()
    }
    layer_1 = [f"model.layers.1.{part}" for part in PARTS]
    assert groups == {(8, None, False): layer_1, (4, 32, True): ["Linear"]}
    actorders = {
        tuple(g["targets"]): g["weights"].get("actorder") for g in qconfig["config_groups"].values()
    }
    assert actorders == {tuple(layer_1): "weight", ("Linear",): None}

    export = read_ascend_export(save / "ascendv1_saver")
    assert export.description["model.layers.0.mlp.up_proj.weight"] == "W4A16"
    assert export.description["model.layers.1.mlp.up_proj.weight"] == "W8A16"
    names = ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    original = load_causal_lm(tiny_llama).state_dict()
    for name, xs in float_inputs(tiny_llama, names).items():
        codes = export.tensors[f"{name}.weight"]
        mismatched = {}
        for label, options in (("rule", {"desc_act": True, "percdamp": 0.05}), ("base", {})):
            gptq = msquant.plugin.numerics.WeightPerChannelGPTQ(
                bits=8, symmetric=False, name=name, **options
            )
            for x in xs:
                gptq.add_batch(x)
            direct = gptq.quantize(original[f"{name}.weight"]).quantized
            mismatched[label] = int((codes != direct.codes).sum())
        tolerance = max(2, codes.numel() // 5000)
        assert mismatched["rule"] <= tolerance < mismatched["base"], (name, mismatched)


def test_quantize_refuses_overlapping_entries_before_weights_load(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    cfg = config({})
    cfg["spec"]["process"].append(
        copy.deepcopy(cfg["spec"]["process"][0]) | {"include": ["*down_proj"]}
    )
    with pytest.raises(
        msquant.QuantizationError, match=r"spec.process\[0\] and spec.process\[1\] both select"
    ):
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)
