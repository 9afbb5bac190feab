"""MoE models through the whole pipeline: experts split into per-expert linear layers, GPTQ per
expert on the tokens routed to it, experts with too few tokens rounded to nearest and listed in
the report, exports under the checkpoint's own per-expert names."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS
from safetensors import safe_open

import msquant
import msquant.plugin
import msquant.plugin.model
import msquant.plugin.planning
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.model.moe import ExpertTokenCounter, unfuse_experts
from msquant.run.capture import batch_samples

pytestmark = NEEDS_MOE_TRANSFORMERS

MAX_TOKENS = 24


def _config(runner: str, ratio: float, calib_inputs: str | None = None) -> dict[str, Any]:
    ext: dict[str, Any] = {"group_size": 32, "expert_min_tokens": ratio}
    if calib_inputs is not None:
        ext["calib_inputs"] = calib_inputs
    weight = {
        "scope": "per_group",
        "dtype": "int8",
        "symmetric": True,
        "method": "gptq",
        "ext": ext,
    }
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
            "save": [{"type": "ascendv1_saver"}],
        },
    }


def _quantize(model: Path, save: Path, config: dict[str, Any]) -> Any:
    return msquant.quantize(
        model, save, config, calib_path=CALIB_TXT, max_calib_tokens=MAX_TOKENS, progress=False
    )


def _expert_tokens(model_dir: Path, export: Path | None = None) -> dict[str, int]:
    """Tokens routed to every expert linear in a plain forward of the float model (what a run
    with ``calib_inputs: float`` calibrates on), or with the dequantized weights of ``export``'s
    layer 0 (what layer 1 of a run with quantized calibration inputs sees)."""
    model = load_causal_lm(model_dir)
    unfuse_experts(model)
    if export is not None:
        stored = read_ascend_export(export)
        with torch.no_grad():
            for name in stored.quantized_modules():
                if name.startswith("model.layers.0."):
                    model.get_submodule(name).weight.copy_(stored.dequantized(name))
    samples = tokenize_samples(
        read_calibration_texts(CALIB_TXT), load_tokenizer(model_dir), MAX_TOKENS
    )
    with ExpertTokenCounter(model) as counter, torch.no_grad():
        for batch in batch_samples(samples):
            model(input_ids=batch)
    return counter.counts


@pytest.fixture(scope="module")
def qwen3_moe(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3_moe", num_layers=2)


def test_experts_are_solved_or_rounded_by_their_token_counts(
    qwen3_moe: Path, tmp_path: Path
) -> None:
    counts = _expert_tokens(qwen3_moe)
    # a ratio that puts half of the experts' gate/up (in_features 64) below the threshold
    gate = sorted(n for name, n in counts.items() if name.endswith("gate_proj"))
    ratio = (gate[len(gate) // 2] + 0.5) / 64
    result = _quantize(qwen3_moe, tmp_path / "out", _config("layer_wise", ratio, "float"))
    modules = {m.name: m for m in result.report.modules}
    experts = [name for name in modules if ".experts." in name]
    assert len(experts) == 2 * 8 * 3  # every expert's gate/up/down in both layers
    fallbacks = {name for name in experts if modules[name].fallback is not None}
    for name in experts:
        in_features = 64 if not name.endswith("down_proj") else 32
        assert modules[name].tokens == counts[name], name
        expected_rtn = counts[name] == 0 or counts[name] < ratio * in_features
        assert (name in fallbacks) == expected_rtn, (name, counts[name])
        if expected_rtn:
            assert modules[name].method == "gptq" and modules[name].gptq_loss is None
            assert f"received {counts[name]} calibration token(s)" in modules[name].fallback
        else:
            assert modules[name].gptq_loss is not None
    assert 0 < len(fallbacks) < len(experts)
    report = json.loads((tmp_path / "out" / "quant_report.json").read_text())
    assert {m["name"] for m in report["modules"] if m["fallback"]} == fallbacks


def test_quantized_calibration_inputs_route_layer_1_through_the_quantized_layer_0(
    qwen3_moe: Path, tmp_path: Path
) -> None:
    """With the default ``calib_inputs: quantized`` the tokens each expert of layer 1 is
    calibrated on are those the router sends it when layer 0 is quantized: the token counts in
    the report equal a forward of the model holding the export's layer 0, and differ from the
    float model's for some expert."""
    result = _quantize(qwen3_moe, tmp_path / "out", _config("layer_wise", 0.0))
    tokens = {m.name: m.tokens for m in result.report.modules if ".experts." in m.name}
    sequential = _expert_tokens(qwen3_moe, tmp_path / "out")
    floating = _expert_tokens(qwen3_moe)
    layer_1 = [name for name in tokens if name.startswith("model.layers.1.")]
    assert layer_1 and all(tokens[name] == sequential[name] for name in layer_1)
    assert any(tokens[name] != floating[name] for name in layer_1)


def test_export_uses_the_checkpoints_per_expert_names(qwen3_moe: Path, tmp_path: Path) -> None:
    _quantize(qwen3_moe, tmp_path / "out", _config("layer_wise", 2.0))
    export = read_ascend_export(tmp_path / "out")
    with safe_open(str(qwen3_moe / "model.safetensors"), framework="pt") as handle:
        original = set(handle.keys())
    quantized = set(export.quantized_modules())
    weights = {n for n in export.tensors if not n.endswith(("weight_scale", "weight_offset"))}
    assert weights == original  # every tensor under the name the checkpoint (and vLLM) uses
    assert "model.layers.1.mlp.experts.7.down_proj" in quantized
    assert export.description["model.layers.1.mlp.experts.7.down_proj.weight"] == "W8A16"
    assert export.description["model.layers.1.mlp.gate.weight"] == "FLOAT"  # the router


def test_streamed_moe_run_equals_the_whole_model_run(qwen3_moe: Path, tmp_path: Path) -> None:
    _quantize(qwen3_moe, tmp_path / "streamed", _config("layer_wise", 2.0))
    _quantize(qwen3_moe, tmp_path / "whole", _config("model_wise", 2.0))
    for name in ("quant_model_weights.safetensors", "quant_model_description.json"):
        streamed = sorted((tmp_path / "streamed").glob(name.replace(".", "*.", 1)))
        whole = sorted((tmp_path / "whole").glob(name.replace(".", "*.", 1)))
        assert [p.name for p in streamed] == [p.name for p in whole] and streamed
        for a, b in zip(streamed, whole, strict=True):
            assert a.read_bytes() == b.read_bytes(), a.name


def _int4_experts(**fields: Any) -> dict[str, Any]:
    weight = {
        "scope": "per_group",
        "dtype": "int4",
        "symmetric": True,
        "method": "minmax",
        "ext": {"group_size": 32},
    }
    entry = {"type": "linear_quant", "qconfig": {"weight": weight}, **fields}
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": [entry], "save": [{"type": "gptq_saver"}]},
    }


def test_expert_groups_gather_every_projection_of_every_expert() -> None:
    names = [
        *(
            f"model.layers.0.mlp.experts.{e}.{p}"
            for e in (0, 1, 10)
            for p in ("gate_proj", "down_proj")
        ),
        *(f"model.layers.1.block_sparse_moe.experts.{e}.w1" for e in (0, 1)),
        "model.layers.0.mlp.shared_experts.gate_proj",  # DeepSeek's shared expert: not routed
        "model.layers.2.mlp.experts.0.up_proj",  # a single expert is no group
        "model.layers.0.self_attn.q_proj",
    ]
    groups = {
        group.fused_name: group.members for group in msquant.plugin.model.expert_groups(names)
    }
    assert set(groups) == {"model.layers.0.mlp.experts", "model.layers.1.block_sparse_moe.experts"}
    assert len(groups["model.layers.0.mlp.experts"]) == 6
    schemes = {name: "int4" for name in names}
    assert msquant.plugin.model.expert_group_problems(schemes) == []
    schemes["model.layers.0.mlp.experts.10.down_proj"] = "FLOAT"
    [problem] = msquant.plugin.model.expert_group_problems(
        schemes, {"model.layers.0.mlp.experts.10.down_proj": "not quantized"}
    )
    assert problem.startswith(
        "model.layers.0.mlp.experts (6 expert linear layers) is loaded as one FusedMoE layer"
    )
    assert (
        "int4: model.layers.0.mlp.experts.0.down_proj, model.layers.0.mlp.experts.0.gate_proj, "
        "model.layers.0.mlp.experts.1.down_proj and 2 more; not quantized: "
        "model.layers.0.mlp.experts.10.down_proj)"
    ) in problem


def test_rules_splitting_the_experts_of_a_layer_are_refused_before_weights_load(
    qwen3_moe: Path, tmp_path: Path
) -> None:
    """vLLM loads all experts of a layer as one FusedMoE layer with one scheme, looked up by the
    experts module's name: an expert-specific rule cannot reach it."""
    one_expert = _int4_experts(dynamic={r".*\.experts\.3\..*": {"bits": 8}})
    result = msquant.plugin.planning.build_plan(qwen3_moe, one_expert)
    assert len(result.errors) == 2  # one per layer
    assert result.errors[0].startswith(
        "linear_quant: model.layers.0.mlp.experts (24 expert linear layers) is loaded as one "
        "FusedMoE layer with a single quantization by vLLM / vLLM-Ascend, but its experts differ "
        "(int4 group 32 sym by qconfig: model.layers.0.mlp.experts.0.down_proj"
    )
    assert (
        'int8 group 32 sym by dynamic[".*\\.experts\\.3\\..*"]: '
        "model.layers.0.mlp.experts.3.down_proj, model.layers.0.mlp.experts.3.gate_proj, "
        "model.layers.0.mlp.experts.3.up_proj)" in result.errors[0]
    )
    with pytest.raises(msquant.QuantizationError, match="FusedMoE layer") as info:
        msquant.quantize(qwen3_moe, tmp_path / "out", one_expert, progress=False)
    assert not (tmp_path / "out").exists()
    assert "cannot be applied to this model" in str(info.value)
    # skipping one expert (a negative rule, or an exclude) splits the module too
    skipped = msquant.plugin.planning.build_plan(qwen3_moe, _int4_experts(exclude=["*experts.5.*"]))
    assert len(skipped.errors) == 2
    assert "model.layers.1.mlp.experts (24 expert linear layers)" in skipped.errors[1]
    assert "not quantized (spec.process[0] exclude *experts.5.*)" in skipped.errors[1]
    # a rule for every expert, or for one layer's experts, keeps each module whole
    whole = _int4_experts(
        dynamic={r".*\.1\.mlp\.experts\..*": {"bits": 8}, "-:.*0.mlp.experts.*": {}}
    )
    assert msquant.plugin.planning.build_plan(qwen3_moe, whole).errors == []


def _export_files(root: Path) -> dict[str, bytes]:
    """Every file of an export but the run report (it holds timings) and the copy of the
    config (it holds the option the compared runs differ in; its checksum is taken out of the
    marker too)."""
    files = {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != "quant_report.json" and path.suffix != ".yaml"
    }
    for name in [n for n in files if n.endswith("msquant_export.json")]:
        marker = json.loads(files[name])
        marker["files"] = {k: v for k, v in marker["files"].items() if not k.endswith(".yaml")}
        files[name] = json.dumps(marker).encode()
    return files


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_experts_per_pass_bounds_the_live_hessians_and_changes_nothing(
    qwen3_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: str
) -> None:
    """``ext.experts_per_pass: 3`` over 8 experts: three calibration passes per layer, each
    gathering and solving the Hessians of at most three experts; the export is the one-pass
    run's, byte for byte, and so are the report's module entries."""
    from msquant.processors.linear_quant import processor as linear_quant

    solve = linear_quant.solve_modules
    live: list[set[str]] = []

    def recording(*args: Any) -> Any:
        collector = args[4]  # (ctx, layer, modules, method, collector, report_of)
        live.append(set(collector.quantizers))
        return solve(*args)

    monkeypatch.setattr(linear_quant, "solve_modules", recording)
    single = _quantize(qwen3_moe, tmp_path / "single", _config(runner, 2.0))
    assert len(live) == 2 and all(len(names) == 4 + 8 * 3 for names in live)  # per layer
    live.clear()
    config = _config(runner, 2.0)
    config["spec"]["process"][0]["qconfig"]["weight"]["ext"]["experts_per_pass"] = 3
    chunked = _quantize(qwen3_moe, tmp_path / "chunked", config)

    assert len(live) == 2 * 3  # three passes per layer
    experts_seen = [sorted({n.split(".")[5] for n in names if ".experts." in n}) for names in live]
    assert experts_seen[:3] == [["0", "1", "2"], ["3", "4", "5"], ["6", "7"]]
    assert experts_seen[3:] == experts_seen[:3]
    assert [len(names) for names in live[:3]] == [4 + 9, 9, 6]  # attention in pass 0
    assert _export_files(tmp_path / "chunked") == _export_files(tmp_path / "single")

    def entries(result: Any) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in vars(m).items() if not k.endswith("seconds")}
            for m in result.report.modules
        ]

    assert entries(chunked) == entries(single)


def test_two_processes_share_the_expert_passes(
    qwen3_moe: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    """dp_layer_wise with ``experts_per_pass``: each pass's Hessians are summed over the
    processes and its solves shared out; the export is the single-process one-pass run's."""
    _quantize(qwen3_moe, tmp_path / "single", _config("layer_wise", 2.0))
    config = _config("dp_layer_wise", 2.0)
    config["spec"]["process"][0]["qconfig"]["weight"]["ext"]["experts_per_pass"] = 3
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli(
        "quant", "--model_path", qwen3_moe, "--save_path", tmp_path / "dp",
        "--config_path", path, "--calib_path", CALIB_TXT,
        "--max_calib_tokens", str(MAX_TOKENS), "--no_progress", "--nproc", "2",
    )  # fmt: skip
    assert result.code == 0, result.err
    assert _export_files(tmp_path / "dp") == _export_files(tmp_path / "single")


class _ToyExpert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(8, 4), torch.nn.Linear(4, 8)


class _ToyMoE(torch.nn.Module):
    """transformers 4's layout: the router a Linear beside a ModuleList of per-expert MLPs."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 3)
        self.experts = torch.nn.ModuleList(_ToyExpert() for _ in range(3))
        self.shared_expert = torch.nn.Module()
        self.shared_expert.gate_proj = torch.nn.Linear(8, 4)
        self.shared_expert_gate = torch.nn.Linear(8, 1)


def test_routers_and_already_split_experts_are_recognised() -> None:
    """Routers (Linears beside the experts) are found for every layout; experts held as a
    ModuleList (transformers 4) count as experts without being touched."""
    from msquant.plugin.model import moe_routers

    layer = torch.nn.Module()
    layer.block_sparse_moe = _ToyMoE()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.gate = torch.nn.Linear(8, 8)  # a "gate" outside an MoE block is no router
    assert moe_routers(layer, "model.layers.0") == {
        "model.layers.0.block_sparse_moe.gate",
        "model.layers.0.block_sparse_moe.shared_expert_gate",
    }
    info = unfuse_experts(layer)
    assert not info  # nothing was fused, nothing renamed
    assert info.split == ("block_sparse_moe.experts",)
    assert info.expert_of("block_sparse_moe.experts.2.w2") == "block_sparse_moe.experts.2"
    assert info.expert_of("block_sparse_moe.shared_expert.gate_proj") is None
    assert info.expert_of("block_sparse_moe.gate") is None
    assert isinstance(layer.block_sparse_moe.experts[0].w1, torch.nn.Linear)


def test_routers_stay_float_in_the_plan(tiny_model_factory: Callable[..., Path]) -> None:
    """Qwen2-MoE's shared_expert_gate is an nn.Linear that vLLM builds unquantized; the plan
    keeps it float with the reason, and the shared expert itself is quantized."""
    model_dir = tiny_model_factory("qwen2_moe", num_layers=1)
    rows = {row.module: row for row in msquant.plan(model_dir, _int4_experts())}
    gate = rows["model.layers.0.mlp.shared_expert_gate"]
    assert gate.skipped and gate.decided_by.startswith("spec.process[0] MoE router: kept float")
    assert not rows["model.layers.0.mlp.shared_expert.gate_proj"].skipped


def test_rules_on_the_experts_module_name_apply_to_every_expert(qwen3_moe: Path) -> None:
    """vLLM looks the FusedMoE layer's scheme up by the experts module's name: a rule written for
    that name (and none of the experts' own names) applies to all of the module's experts."""
    cfg = _int4_experts(dynamic={r"-:model\.layers\.0\.mlp\.experts$": {}})
    result = msquant.plugin.planning.build_plan(qwen3_moe, cfg)
    assert result.errors == [] and result.warnings == []
    rows = {row.module: row for row in result.rows}
    layer0 = [row for name, row in rows.items() if name.startswith("model.layers.0.mlp.experts.")]
    layer1 = [row for name, row in rows.items() if name.startswith("model.layers.1.mlp.experts.")]
    assert len(layer0) == len(layer1) == 24
    assert all(row.skipped for row in layer0)
    assert not any(row.skipped for row in layer1)
    assert not rows["model.layers.0.self_attn.q_proj"].skipped
