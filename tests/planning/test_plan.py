"""``msquant plan`` / ``msquant.plan``: the per-module table, the cross-entry checks, the warnings,
all on the meta model (no weight is read)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
import yaml
from safetensors.torch import save_file

import msquant
import msquant.plugin
import msquant.plugin.planning
from msquant.config.processors import build_processors
from msquant.config.resolve import resolve_config
from msquant.load.model_folder import build_meta_model, load_model_config
from msquant.model.layers import find_decoder_layers
from msquant.planning.render import render_plan

INT4_G32 = {
    "dtype": "int4",
    "scope": "per_group",
    "symmetric": True,
    "method": "minmax",
    "ext": {"group_size": 32},
}
INT8_CH = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}


def entry(weight: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"type": "linear_quant", "qconfig": {"weight": weight}, **fields}


def config(*entries: dict[str, Any], save: str = "gptq_saver") -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": list(entries), "save": [{"type": save}]},
    }


@pytest.fixture(scope="module")
def weightless_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config with a dummy weights file: planning must not need the weights."""
    folder = tmp_path_factory.mktemp("weightless")
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    save_file({"unrelated": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


def rows_by_name(rows: list[msquant.PlanRow]) -> dict[str, msquant.PlanRow]:
    return {row.module: row for row in rows}


def test_plan_table_names_the_deciding_entry_and_rule(weightless_llama: Path) -> None:
    cfg = config(
        entry(
            INT4_G32,
            exclude=["*o_proj"],
            dynamic={"-:.*down.*": {}, r".*\.1\..*": {"bits": 8, "group_size": -1, "sym": False}},
        )
    )
    rows = msquant.plan(weightless_llama, cfg)
    assert [r.module for r in rows][:7] == [
        f"model.layers.0.{m}"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]  # fmt: skip
    by_name = rows_by_name(rows)
    q0 = by_name["model.layers.0.self_attn.q_proj"]
    assert (q0.bits, q0.group_size, q0.sym, q0.method, q0.skipped) == (4, 32, True, "minmax", False)
    assert (q0.decided_by, q0.entry) == ("spec.process[0]", 0)
    q1 = by_name["model.layers.1.self_attn.q_proj"]
    assert (q1.bits, q1.group_size, q1.sym) == (8, -1, False)
    assert q1.decided_by == r'spec.process[0].dynamic[".*\.1\..*"]'
    down = by_name["model.layers.1.mlp.down_proj"]  # the negative rule wins over ".*\.1\..*"
    assert down.skipped and down.bits is None and down.method is None
    assert down.decided_by == 'spec.process[0].dynamic["-:.*down.*"]'
    o_proj = by_name["model.layers.0.self_attn.o_proj"]
    assert o_proj.skipped and o_proj.decided_by == "spec.process[0] exclude *o_proj"
    assert o_proj.entry is None


def test_modules_of_no_entry_and_several_entries(weightless_llama: Path) -> None:
    cfg = config(
        entry(INT4_G32, include=["*self_attn*"]),
        entry(INT8_CH, include=["*mlp*"], dynamic={".*gate.*|.*up.*": {"bits": 4}}),
    )
    by_name = rows_by_name(msquant.plan(weightless_llama, cfg))
    assert by_name["model.layers.0.self_attn.k_proj"].decided_by == "spec.process[0]"
    gate = by_name["model.layers.1.mlp.gate_proj"]
    assert (gate.bits, gate.group_size, gate.entry) == (4, -1, 1)
    assert gate.decided_by == 'spec.process[1].dynamic[".*gate.*|.*up.*"]'
    assert by_name["model.layers.1.mlp.down_proj"].decided_by == "spec.process[1]"
    only_attn = config(entry(INT4_G32, include=["*self_attn*"]))
    down = rows_by_name(msquant.plan(weightless_llama, only_attn))["model.layers.0.mlp.down_proj"]
    assert down.skipped and down.decided_by == "not selected by any quantizing entry"


def test_a_module_selected_by_two_entries_is_refused(weightless_llama: Path) -> None:
    cfg = config(entry(INT4_G32, exclude=["*q_proj"]), entry(INT8_CH, include=["*down_proj"]))
    with pytest.raises(msquant.QuantizationError) as info:
        msquant.plan(weightless_llama, cfg)
    message = str(info.value)
    assert (
        "spec.process[0] and spec.process[1] both select model.layers.0.mlp.down_proj, " in message
    )
    assert "model.layers.1.mlp.down_proj" in message
    assert "one linear_quant entry only" in message
    # a negative rule does not release the module: both entries still claim it
    negative = config(
        entry(INT4_G32, dynamic={"-:.*down_proj": {}}), entry(INT8_CH, include=["*down_proj"])
    )
    result = msquant.plugin.planning.build_plan(weightless_llama, negative)
    assert not result.ok and "both select model.layers.0.mlp.down_proj" in result.errors[0]


def test_fused_shards_split_between_entries_are_refused(weightless_llama: Path) -> None:
    split = config(
        entry(INT4_G32, include=["*q_proj", "*k_proj"]), entry(INT8_CH, include=["*v_proj"])
    )
    result = msquant.plugin.planning.build_plan(weightless_llama, split)
    assert len(result.errors) == 2  # one per layer
    first = result.errors[0]
    assert first.startswith("model.layers.0.self_attn.qkv_proj is loaded as one fused matrix")
    assert "model.layers.0.self_attn.q_proj: int4 group 32 sym by spec.process[0]" in first
    assert "model.layers.0.self_attn.v_proj: int8 per-channel sym by spec.process[1]" in first
    # the same scheme from two entries is consistent
    same = config(
        entry(INT8_CH, include=["*q_proj", "*k_proj"]), entry(INT8_CH, include=["*v_proj"])
    )
    assert msquant.plugin.planning.build_plan(weightless_llama, same).errors == []


def test_a_fused_shard_left_out_is_refused_with_the_reason(weightless_llama: Path) -> None:
    result = msquant.plugin.planning.build_plan(
        weightless_llama, config(entry(INT4_G32, exclude=["*up_proj"]))
    )
    assert len(result.errors) == 2
    assert "model.layers.1.mlp.gate_up_proj is loaded as one fused matrix" in result.errors[1]
    assert (
        "model.layers.1.mlp.up_proj: not quantized (spec.process[0] exclude *up_proj)"
        in result.errors[1]
    )


def test_rules_splitting_fused_shards_inside_one_entry_are_refused(weightless_llama: Path) -> None:
    cfg = config(entry(INT4_G32, dynamic={r".*\.1\..*k_proj": {"bits": 8}, "-:.*0.*up_proj": {}}))
    result = msquant.plugin.planning.build_plan(weightless_llama, cfg)
    assert len(result.errors) == 2
    assert result.errors[0].startswith("linear_quant: model.layers.0.mlp.gate_up_proj")
    assert (
        'model.layers.0.mlp.up_proj: not quantized by dynamic["-:.*0.*up_proj"]' in result.errors[0]
    )
    assert result.errors[1].startswith("linear_quant: model.layers.1.self_attn.qkv_proj")
    assert (
        'model.layers.1.self_attn.k_proj: int8 group 32 sym by dynamic[".*\\.1\\..*k_proj"]'
        in result.errors[1]
    )
    assert "model.layers.1.self_attn.q_proj: int4 group 32 sym by qconfig" in result.errors[1]


def test_group_size_from_a_rule_must_divide_and_the_rule_is_named(weightless_llama: Path) -> None:
    cfg = config(entry(INT8_CH, dynamic={".*down_proj": {"group_size": 48}}))
    result = msquant.plugin.planning.build_plan(weightless_llama, cfg)
    assert result.errors == [
        f"model.layers.{i}.mlp.down_proj: group_size 48 does not divide in_features 128 "
        '(weight [64, 128], group_size set by dynamic[".*down_proj"]); valid group sizes: '
        "1, 2, 4, 8, 16, 32, 64, 128 - or exclude this layer"
        for i in (0, 1)
    ]
    # a rule that sets other keys is not blamed for the base group size
    g128 = {**INT4_G32, "ext": {"group_size": 128}}
    errors = msquant.plugin.planning.build_plan(
        weightless_llama, config(entry(g128, include=["*q_proj"], dynamic={".*": {"bits": 8}}))
    ).errors
    assert errors[0] == (
        "model.layers.0.self_attn.q_proj: group_size 128 does not divide in_features 64 "
        "(weight [64, 64]); valid group sizes: 1, 2, 4, 8, 16, 32, 64 - or exclude this layer"
    )
    # a rule's group size that divides (and per-channel overrides) pass
    fine = config(
        entry(
            INT4_G32, dynamic={".*down_proj": {"group_size": 128}, ".*o_proj": {"group_size": -1}}
        )
    )
    assert msquant.plugin.planning.build_plan(weightless_llama, fine).ok


def test_warnings_name_the_entry(weightless_llama: Path) -> None:
    cfg = config(
        entry(
            INT4_G32,
            include=["*self_attn*", "*nothing*"],
            dynamic={"q_proj": {"bits": 8}, ".*v_proj": {"bits": 4}},
        ),
        entry(INT8_CH, include=["*mlp*", "*typo_proj"]),
    )
    result = msquant.plugin.planning.build_plan(weightless_llama, cfg)
    assert result.ok
    warnings = result.warnings
    assert (
        "spec.process[0]: linear_quant include pattern(s) matched no decoder linear layer: ['*nothing*']"
        in warnings[0]
    )
    assert any(
        w.startswith('spec.process[0].dynamic["q_proj"] matches none of the 8 module(s)')
        for w in warnings
    )
    vllm = [w for w in warnings if w.startswith('spec.process[0].dynamic[".*v_proj"]')]
    assert len(vllm) == 1
    assert (
        "matches model.layers.0.self_attn.qkv_proj, the fused name vLLM and SGLang match rules "
        "against, but only v_proj of its shards q_proj, k_proj, v_proj here (and in 1 more layer(s))"
    ) in vllm[0]
    assert "(?:q_proj|k_proj|v_proj|qkv_proj)" in vllm[0]
    assert any(
        w.startswith("spec.process[1]: linear_quant include pattern(s)") and "'*typo_proj'" in w
        for w in warnings
    )


def test_plan_reads_no_weight(weightless_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning builds the model on the meta device: loading weights would fail here."""
    from transformers import AutoModelForCausalLM

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    rows = msquant.plan(weightless_llama, config(entry(INT8_CH)))
    assert len(rows) == 14 and all(row.bits == 8 for row in rows)


def test_plan_logs_warnings(weightless_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="msquant"):
        msquant.plan(weightless_llama, config(entry(INT8_CH, include=["*nothing*", "*"])))
    assert "matched no decoder linear layer: ['*nothing*']" in caplog.text


def test_check_plan_is_the_run_check(
    weightless_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a run calls on the meta model after the processors' own check_model."""
    registry = msquant.plugin.default_registry()
    cfg = config(
        entry(INT4_G32, exclude=["*v_proj"]), entry(INT8_CH, include=["*down_proj", "*none*"])
    )
    processors = build_processors(resolve_config(cfg, registry).config, registry)
    meta = build_meta_model(load_model_config(weightless_llama))
    layers = find_decoder_layers(meta)
    with caplog.at_level(logging.WARNING, logger="msquant"):
        errors = msquant.plugin.planning.check_plan(processors, meta, layers)
    assert len(errors) == 3  # the overlap on down_proj, then the qkv split in each layer
    assert errors[0].startswith(
        "spec.process[0] and spec.process[1] both select model.layers.0.mlp.down_proj"
    )
    assert all("qkv_proj" in e for e in errors[1:3])
    assert (
        "spec.process[1]: linear_quant include pattern(s) matched no decoder linear layer: ['*none*']"
        in caplog.text
    )


# -- the command line -----------------------------------------------------------------------


def write_yaml(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_cli_plan_table(
    weightless_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    cfg = config(entry(INT4_G32, dynamic={"-:.*down.*": {}, r".*\.1\..*": {"bits": 8}}))
    result = run_cli(
        "plan", "--model_path", weightless_llama, "--config_path", write_yaml(tmp_path, cfg)
    )
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].split() == [
        "module",
        "bits",
        "group",
        "sym",
        "method",
        "skipped",
        "decided",
        "by",
    ]
    assert lines[1].split() == [
        "model.layers.0.self_attn.q_proj",
        "4",
        "32",
        "yes",
        "minmax",
        "no",
        "spec.process[0]",
    ]
    assert lines[7].split() == [
        "model.layers.0.mlp.down_proj",
        "-",
        "-",
        "-",
        "-",
        "yes",
        'spec.process[0].dynamic["-:.*down.*"]',
    ]
    assert lines[8].split()[:2] == ["model.layers.1.self_attn.q_proj", "8"]
    assert "llama: 14 linear layer(s), 12 quantized, 2 left in float" in result.out
    assert lines[-1] == "OK"


def test_cli_plan_json_and_preset(weightless_llama: Path, run_cli: Callable[..., Any]) -> None:
    result = run_cli("plan", "--model_path", weightless_llama, "--quant_type", "w8a16", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["ok"] and data["errors"] == [] and data["model_type"] == "llama"
    assert data["rows"][0] == {
        "module": "model.layers.0.self_attn.q_proj",
        "bits": 8,
        "group_size": -1,
        "sym": True,
        "desc_act": False,
        "method": "minmax",
        "skipped": False,
        "decided_by": "spec.process[0]",
        "entry": 0,
        "act": None,
        "value_type": "int8",
    }


def test_cli_plan_exit_codes(
    weightless_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    overlap = config(entry(INT8_CH), entry(INT8_CH, include=["*o_proj"]))
    result = run_cli(
        "plan",
        "--model_path",
        weightless_llama,
        "--config_path",
        write_yaml(tmp_path, overlap),
        "--json",
    )
    assert result.code == 2
    data = json.loads(result.out)
    assert not data["ok"] and "both select model.layers.0.self_attn.o_proj" in data["errors"][0]
    assert "cannot be applied to this model (1 problem(s)" in result.err
    bad = config(entry(INT8_CH, dynamic={".*": {"bitz": 8}}))
    result = run_cli(
        "plan", "--model_path", weightless_llama, "--config_path", write_yaml(tmp_path, bad)
    )
    assert result.code == 2 and result.out == ""
    assert 'spec.process[0].dynamic[".*"].bitz: unknown dynamic override' in result.err
    missing = run_cli("plan", "--model_path", tmp_path / "nope", "--quant_type", "w8a16")
    assert missing.code == 2 and "does not exist" in missing.err
    with pytest.raises(SystemExit) as usage:
        run_cli("plan", "--model_path", weightless_llama)
    assert usage.value.code == 2


# -- rules written against the names vLLM and SGLang load modules under ----------------------------


@pytest.mark.parametrize(
    ("rule", "overrides", "fused", "shards"),
    [
        (r".*qkv_proj", {"bits": 8}, "self_attn", ("q_proj", "k_proj", "v_proj")),
        (r".*self_attn\.qkv_proj.*", {"bits": 8}, "self_attn", ("q_proj", "k_proj", "v_proj")),
        (r"-:.*gate_up_proj$", {}, "mlp", ("gate_proj", "up_proj")),
    ],
    ids=["qkv", "qkv_dotstar", "gate_up_negative"],
)
def test_rules_on_vllm_fused_names_apply_to_every_shard(
    weightless_llama: Path,
    rule: str,
    overrides: dict[str, Any],
    fused: str,
    shards: tuple[str, ...],
) -> None:
    """vLLM reads a rule against ``qkv_proj`` / ``gate_up_proj``; msquant applies it to the shards
    (it used to match none of them, and the run quantized them with the base scheme)."""
    result = msquant.plugin.planning.build_plan(
        weightless_llama, config(entry(INT4_G32, dynamic={rule: overrides}))
    )
    assert result.ok, result.errors
    assert result.warnings == []  # neither "matches nothing" nor a fused-name mismatch
    rows = rows_by_name(result.rows)
    for layer in (0, 1):
        for shard in shards:
            row = rows[f"model.layers.{layer}.{fused}.{shard}"]
            assert row.decided_by == f'spec.process[0].dynamic["{rule}"]'
            if overrides:
                assert (row.bits, row.group_size) == (8, 32)
            else:
                assert row.skipped
        assert rows[f"model.layers.{layer}.self_attn.o_proj"].bits == 4


def test_rule_matching_a_fused_name_and_some_shards_is_still_a_split(
    weightless_llama: Path,
) -> None:
    """``.*v_proj`` matches ``qkv_proj`` for vLLM and only ``v_proj`` for GPTQModel: ambiguous, so
    it applies to ``v_proj`` alone and the split is refused, as before."""
    result = msquant.plugin.planning.build_plan(
        weightless_llama, config(entry(INT4_G32, dynamic={".*v_proj": {"bits": 8}}))
    )
    assert len(result.errors) == 2 and "qkv_proj is loaded as one fused matrix" in result.errors[0]


def test_rules_on_vllm_fused_names_reach_the_quantized_model(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """End to end: the export quantizes q/k/v with the rule's bits, and its own dynamic rule for
    them matches the fused name vLLM looks up."""
    cfg = config(entry(INT4_G32, dynamic={r".*qkv_proj": {"bits": 8}}))
    result = msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)
    assert result.quantized_modules
    written = json.loads((tmp_path / "out" / "quantize_config.json").read_text())
    assert written["bits"] == 4
    rules = written["dynamic"]
    assert len(rules) == 1
    (pattern,) = rules
    assert rules[pattern] == {"bits": 8}
    for layer in (0, 1):
        assert re.match(pattern.removeprefix("+:"), f"model.layers.{layer}.self_attn.qkv_proj")
        for shard in ("q_proj", "k_proj", "v_proj"):
            assert re.match(pattern.removeprefix("+:"), f"model.layers.{layer}.self_attn.{shard}")
        assert not re.match(pattern.removeprefix("+:"), f"model.layers.{layer}.self_attn.o_proj")


# -- a config that quantizes nothing ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([entry(INT8_CH, include=["*nothing_here*"])], "14 not selected by any quantizing entry"),
        ([entry(INT8_CH, exclude=["*"])], "14 spec.process[0] exclude *"),
        ([entry(INT8_CH, dynamic={"-:.*": {}})], '14 spec.process[0].dynamic["-:.*"]'),
    ],
    ids=["include", "exclude", "negative_rule"],
)
def test_config_quantizing_nothing_is_refused_before_weights_load(
    weightless_llama: Path, entries: list[dict[str, Any]], reason: str
) -> None:
    """Refused on the meta model (the weights file holds nothing loadable), with what decided."""
    with pytest.raises(msquant.QuantizationError) as info:
        msquant.plan(weightless_llama, config(*entries))
    message = str(info.value)
    assert "the config quantizes none of the model's 14 linear layer(s)" in message
    assert reason in message
    assert "msquant plan lists every module" in message


def test_config_without_a_quantizing_entry_is_refused(weightless_llama: Path) -> None:
    result = msquant.plugin.planning.build_plan(weightless_llama, config())
    assert result.errors == [
        "spec.process has no entry that quantizes linear layers, so the export would be the "
        "float model; add a linear_quant entry; to write the float model on purpose, pass "
        "--allow_float_export (Python: allow_float_export=True)"
    ]
    assert msquant.plugin.planning.build_plan(
        weightless_llama, config(), allow_float_export=True
    ).ok


def test_cli_refuses_a_config_quantizing_nothing_before_loading(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    """It used to run the whole calibration and exit 0 with an Ascend export of the float model."""
    cfg = tmp_path / "none.yaml"
    cfg.write_text(
        yaml.safe_dump(config(entry(INT8_CH, include=["*nothing_here*"]), save="ascendv1_saver"))
    )
    result = run_cli(
        "quant", "--model_path", str(tiny_llama), "--save_path", str(tmp_path / "out"),
        "--config_path", str(cfg),
    )  # fmt: skip
    assert result.code == 2
    assert "the config quantizes none of the model's 14 linear layer(s)" in result.err
    assert not (tmp_path / "out").exists()


class _ReviewerConfig(msquant.plugin.ProcessorConfig):
    type: Literal["plan_reviewer"] = "plan_reviewer"


class _Reviewer(msquant.plugin.Processor):
    """A saver that refuses plans quantizing down_proj and warns about every quantized layer."""

    type_name: ClassVar[str] = "plan_reviewer"
    config_class = _ReviewerConfig
    stage = "save"

    def review_plan(
        self, plan: msquant.plugin.planning.ModelPlan, model: torch.nn.Module
    ) -> msquant.plugin.planning.PlanReview:
        quantized = [row.module for row in plan.rows if not row.skipped]
        return msquant.plugin.planning.PlanReview(
            errors=[f"plan_reviewer: {m} refused" for m in quantized if m.endswith("down_proj")],
            warnings=[f"plan_reviewer: {len(quantized)} quantized, model {type(model).__name__}"],
        )


def test_savers_review_the_plan_before_weights_load(weightless_llama: Path, tmp_path: Path) -> None:
    """A processor with ``review_plan`` sees the finished plan (every row) on the weightless
    model; its warnings join the plan's, its errors refuse the run before weights load."""
    registry = msquant.plugin.default_registry()
    registry.register(_Reviewer)
    cfg = {
        "apiversion": "modelslim_v1",
        "spec": {"process": [entry(INT8_CH)], "save": [{"type": "plan_reviewer"}]},
    }
    plan = msquant.plugin.planning.build_plan(weightless_llama, cfg, registry=registry)
    assert plan.warnings == ["plan_reviewer: 14 quantized, model LlamaForCausalLM"]
    assert plan.errors == [f"plan_reviewer: model.layers.{i}.mlp.down_proj refused" for i in (0, 1)]
    with pytest.raises(msquant.QuantizationError, match="down_proj refused"):
        msquant.quantize(weightless_llama, tmp_path / "out", cfg, registry=registry, progress=False)
    assert not (tmp_path / "out").exists()
    cfg["spec"]["process"][0]["exclude"] = ["*down_proj"]
    assert msquant.plugin.planning.build_plan(weightless_llama, cfg, registry=registry).ok


def test_kv_cache_lines_count_and_name_the_float_attentions() -> None:
    """The plan's text says, per KV-cache entry, the scheme, how many attentions get it and
    which stay in float."""
    caches = [
        msquant.plugin.planning.KVCachePlan("model.layers.0.self_attn", "C8", "spec.process[1]"),
        msquant.plugin.planning.KVCachePlan("model.layers.1.self_attn", None, "spec.process[1]"),
        msquant.plugin.planning.KVCachePlan("model.layers.2.self_attn", "C8", "spec.process[1]"),
    ]
    lines = render_plan(msquant.plugin.planning.ModelPlan([], model_type="qwen3", kv_caches=caches))
    assert lines.splitlines()[2:] == [
        "KV cache (spec.process[1]): C8 on 2 of 3 attention(s); left in float: "
        "model.layers.1.self_attn",
        "OK",
    ]
    plain = render_plan(msquant.plugin.planning.ModelPlan([], model_type="qwen3"))
    assert "KV cache" not in plain
