"""Output head (``lm_head``) quantization: opt-in with ``linear_quant``'s ``lm_head: true``.

The head runs as one more stage after the last decoder layer, calibrated (GPTQ) on the final norm
of the last layer's outputs. Checked here: the head's GPTQ result against GPTQ solved directly on a
Hessian built independently from the float model's own forward (a hook on its ``lm_head``); the
tied-embedding refusal before weights load; every export format with the head quantized (read
back by ``msquant verify``, the independent GPTQ and Ascend readers of the tests, and transformers
for compressed-tensors); the plan row; and that runs without ``lm_head`` are unchanged.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT, CliResult
from gptq_reader import read_gptq_export
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
import msquant.plugin
import msquant.plugin.devices
import msquant.plugin.numerics
import msquant.plugin.planning
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.model.head import OutputHeadStage, find_final_norm, find_output_head, output_head_stage
from msquant.model.layers import find_decoder_layers
from msquant.run.output_head import run_head_calibration

VOCAB, HIDDEN = 384, 64
IDS = torch.tensor([[1, 5, 17, 42, 99, 200, 301, 7, 64, 128, 3, 250]])
CALIB_TOKENS = 24
SAVERS = ("ascendv1_saver", "mindie_format_saver", "gptq_saver", "compressed_tensors")
#: The head overridden to int8 per-channel on an int4 group-32 base.
HEAD_RULE = {"lm_head": {"bits": 8, "group_size": -1}}


def _weight(bits: int, group_size: int | None, method: str = "minmax") -> dict[str, Any]:
    weight: dict[str, Any] = {
        "dtype": f"int{bits}",
        "scope": "per_channel" if group_size is None else "per_group",
        "symmetric": True,
        "method": method,
    }
    if group_size is not None:
        weight["ext"] = {"group_size": group_size}
    return weight


def _config(
    *entries: dict[str, Any], savers: tuple[str, ...] = ("ascendv1_saver",)
) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": list(entries), "save": [{"type": s} for s in savers]},
    }


def _entry(weight: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "linear_quant", "qconfig": {"weight": weight}, **extra}


def _original_head(model_dir: Path) -> torch.Tensor:
    state = load_file(str(model_dir / "model.safetensors"))
    return state["lm_head.weight"]


# --- GPTQ on the head: the calibration inputs are the float model's own head inputs -------------


def _float_head_inputs(model_dir: Path) -> torch.Tensor:
    """Every calibration token's input to ``lm_head`` in a plain forward of the float model."""
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(
        read_calibration_texts(CALIB_TXT), load_tokenizer(model_dir), CALIB_TOKENS
    )
    rows: list[torch.Tensor] = []

    def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

    handle = model.lm_head.register_forward_pre_hook(record)
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids)
    handle.remove()
    return torch.cat(rows)


def test_gptq_head_equals_direct_gptq_on_the_float_head_inputs(
    tiny_llama: Path, tmp_path: Path
) -> None:
    save = tmp_path / "out"
    weight = _weight(4, 32, "gptq")
    weight["ext"]["numerics"] = "msmodelslim"  # float head inputs, msModelSlim's GPTQ numerics
    config = _config(_entry(weight, lm_head=True))
    result = msquant.quantize(
        tiny_llama, save, config, calib_path=CALIB_TXT, max_calib_tokens=CALIB_TOKENS,
        progress=False,
    )  # fmt: skip
    assert "lm_head" in result.quantized_modules
    assert [t.name for t in result.report.layers][-1] == "lm_head"  # one stage after the layers
    head_report = next(m for m in result.report.modules if m.name == "lm_head")
    assert head_report.method == "gptq" and head_report.gptq_loss is not None

    x = _float_head_inputs(tiny_llama).double()
    hessian = (x.T @ x).float()  # GPTQ is invariant to the Hessian's scale
    weight = _original_head(tiny_llama)
    direct = msquant.plugin.numerics.gptq_quantize(
        weight, hessian, bits=4, symmetric=True, group_size=32
    )
    export = read_ascend_export(save)
    assert export.types["lm_head.weight"] == "W4A16"
    codes = export.codes("lm_head")  # int4 pairs unpacked by the test's own reader
    assert codes.shape == (VOCAB, HIDDEN)
    mismatched = int((codes != direct.quantized.codes).sum())
    assert mismatched <= max(2, codes.numel() // 5000), f"{mismatched} head codes differ"
    torch.testing.assert_close(
        export.tensors["lm_head.weight_scale"], direct.quantized.scale, rtol=1e-6, atol=0
    )
    # GPTQ beats round-to-nearest on the activations it was fitted to
    xf = x.float()
    rtn = msquant.plugin.numerics.quantize_weight_minmax(weight, 4, True, 32)
    reference = xf @ weight.T
    gptq_error = (xf @ export.dequantized("lm_head").T - reference).norm()
    rtn_error = (xf @ rtn.dequantize().T - reference).norm()
    assert gptq_error < rtn_error


def test_head_calibration_feeds_the_final_norm_in_bounded_chunks(tiny_llama: Path) -> None:
    """norm(last hidden) reaches the head in chunks of at most budget / vocab tokens."""
    model = load_causal_lm(tiny_llama)
    norm = find_final_norm(model, find_decoder_layers(model))
    assert norm is model.model.norm
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    last_hidden = torch.randn(1, 12, HIDDEN)
    backend = msquant.plugin.devices.get_backend("cpu")
    tokens = run_head_calibration(norm, model.lm_head, [last_hidden], backend, 5 * VOCAB)
    handle.remove()
    assert tokens == 12
    assert [t.shape[0] for t in seen] == [5, 5, 2]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(seen), norm(last_hidden)[0])


def test_final_norm_found_by_position_when_not_named_norm() -> None:
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.last_ln = nn.LayerNorm(4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()
            self.head = nn.Linear(4, 8, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    model = Model()
    layers = find_decoder_layers(model)
    assert find_final_norm(model, layers) is model.body.last_ln
    assert find_output_head(model) == ("head", model.head)
    stage = output_head_stage(model, layers)
    assert isinstance(stage, OutputHeadStage) and stage.index == 2
    assert stage.named_linears() == [("head", model.head)]


# --- refusals and plans -------------------------------------------------------------------------


def test_tied_head_is_refused_before_weights_load(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tied = tiny_model_factory("llama", tie_word_embeddings=True)

    def no_weights(*_: object, **__: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    config = _config(_entry(_weight(8, None), lm_head=True))
    with pytest.raises(msquant.QuantizationError) as raised:
        msquant.quantize(tied, tmp_path / "out", config, progress=False)
    message = str(raised.value)
    assert "spec.process[0] (lm_head: true) asks to quantize lm_head" in message
    assert f"LlamaForCausalLM (llama, {tied})" in message
    assert "tie_word_embeddings: true" in message
    assert "Keep the head in float (lm_head: false)" in message
    assert "tie_word_embeddings: false and its own lm_head.weight" in message
    assert not (tmp_path / "out").exists()
    # without lm_head the tied model quantizes as before
    monkeypatch.undo()
    result = msquant.quantize(tied, tmp_path / "plain", _config(_entry(_weight(8, None))),
                              progress=False)  # fmt: skip
    assert "lm_head" not in result.quantized_modules


def _rows(model: Path, config: dict[str, Any]) -> dict[str, msquant.PlanRow]:
    return {row.module: row for row in msquant.plugin.planning.build_plan(model, config).rows}


def test_plan_row_of_the_head(tiny_llama: Path) -> None:
    plain = msquant.plugin.planning.build_plan(tiny_llama, _config(_entry(_weight(4, 32))))
    assert "lm_head" not in {row.module for row in plain.rows}  # default plan unchanged
    rows = _rows(tiny_llama, _config(_entry(_weight(4, 32), lm_head=True)))
    head = rows["lm_head"]
    assert (head.bits, head.group_size, head.skipped, head.decided_by) == (
        4, 32, False, "spec.process[0]"
    )  # fmt: skip
    ruled = _rows(tiny_llama, _config(_entry(_weight(4, 32), lm_head=True, dynamic=HEAD_RULE)))
    head = ruled["lm_head"]
    assert (head.bits, head.group_size, head.method) == (8, -1, "minmax")
    assert head.decided_by == 'spec.process[0].dynamic["lm_head"]'
    skipped = _rows(
        tiny_llama, _config(_entry(_weight(4, 32), lm_head=True, dynamic={"-:lm_head": {}}))
    )
    assert skipped["lm_head"].skipped
    assert skipped["lm_head"].decided_by == 'spec.process[0].dynamic["-:lm_head"]'


def test_a_rule_matching_the_head_without_the_flag_warns_and_keeps_it_float(
    tiny_llama: Path,
) -> None:
    result = msquant.plugin.planning.build_plan(
        tiny_llama, _config(_entry(_weight(4, 32), dynamic=HEAD_RULE))
    )
    head = {row.module: row for row in result.rows}["lm_head"]
    assert head.skipped and head.decided_by == "spec.process[0] lm_head: false"
    assert result.ok
    assert [w for w in result.warnings if w.startswith("spec.process")] == [
        'spec.process[0]: dynamic["lm_head"] matches lm_head, but the output head is quantized '
        "only with lm_head: true (GPTQModel's rule), so lm_head stays in float; set lm_head: "
        "true to quantize it with this rule"
    ]


def test_globs_never_select_the_head(tiny_llama: Path) -> None:
    rows = _rows(tiny_llama, _config(_entry(_weight(4, 32), include=["*", "lm_head"])))
    assert "lm_head" not in rows
    result = msquant.plugin.planning.build_plan(
        tiny_llama, _config(_entry(_weight(4, 32), lm_head=True, exclude=["*head"]))
    )
    assert not {row.module: row for row in result.rows}["lm_head"].skipped
    assert any(
        "exclude *head matches lm_head, but globs do not apply" in w for w in result.warnings
    )


def test_two_entries_asking_for_the_head_are_refused(tiny_llama: Path) -> None:
    config = _config(
        _entry(_weight(4, 32), lm_head=True, include=["*_proj"], exclude=["*down_proj"]),
        _entry(_weight(8, None), lm_head=True, include=["*down_proj"]),
    )
    result = msquant.plugin.planning.build_plan(tiny_llama, config)
    assert result.errors == [
        "spec.process[0] and spec.process[1] both select lm_head: a module may be quantized by "
        "one linear_quant entry only; narrow their include / exclude patterns (or use one entry "
        "with dynamic rules)"
    ]


def test_head_group_size_must_divide_the_hidden_size(tiny_llama: Path) -> None:
    rule = {"lm_head": {"group_size": 48}}
    result = msquant.plugin.planning.build_plan(
        tiny_llama, _config(_entry(_weight(4, 32), lm_head=True, dynamic=rule))
    )
    assert result.errors == [
        "lm_head: group_size 48 does not divide in_features 64 (weight [384, 64], group_size set "
        'by dynamic["lm_head"]); valid group sizes: 1, 2, 4, 8, 16, 32, 64 - or set lm_head: '
        "false"
    ]


def test_cli_plan_shows_the_head_row(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    config = tmp_path / "head.yaml"
    config.write_text(json.dumps(_config(_entry(_weight(4, 32), lm_head=True, dynamic=HEAD_RULE))))
    result = run_cli("plan", "--model_path", tiny_llama, "--config_path", config, "--json")
    assert result.code == 0, result.err
    rows = {row["module"]: row for row in json.loads(result.out)["rows"]}
    assert rows["lm_head"]["bits"] == 8 and rows["lm_head"]["group_size"] == -1
    table = run_cli("plan", "--model_path", tiny_llama, "--config_path", config)
    head_line = next(line for line in table.out.splitlines() if line.startswith("lm_head "))
    assert head_line.split() == ["lm_head", "8", "channel", "yes", "minmax", "no",
                                 'spec.process[0].dynamic["lm_head"]']  # fmt: skip


# --- exports: every format, one run -------------------------------------------------------------


@pytest.fixture(scope="module")
def head_export(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """int4 group-32 decoder layers, the head int8 per-channel, written by every saver at once."""
    save = tmp_path_factory.mktemp("head_export") / "out"
    config = _config(_entry(_weight(4, 32), lm_head=True, dynamic=HEAD_RULE), savers=SAVERS)
    msquant.quantize(tiny_llama, save, config, progress=False)  # verifies every export itself
    return save


def _head_reference(model_dir: Path) -> msquant.plugin.QuantizedWeight:
    return msquant.plugin.numerics.quantize_weight_minmax(_original_head(model_dir), 8, True, None)


ASCEND_FILES = {
    "ascendv1_saver": ("quant_model_weights", "quant_model_description.json"),
    "mindie_format_saver": ("quant_model_weight_w4a16", "quant_model_description_w4a16.json"),
}


@pytest.mark.parametrize("saver", ASCEND_FILES)
def test_ascend_exports_carry_a_w8a16_head(saver: str, head_export: Path, tiny_llama: Path) -> None:
    export = read_ascend_export(head_export / saver, *ASCEND_FILES[saver])
    reference = _head_reference(tiny_llama)
    assert export.types["lm_head.weight"] == "W8A16"
    assert export.types["lm_head.weight_scale"] == export.types["lm_head.weight_offset"] == "W8A16"
    assert export.tensors["lm_head.weight"].dtype == torch.int8
    assert torch.equal(export.tensors["lm_head.weight"], reference.codes)
    assert export.tensors["lm_head.weight_scale"].shape == (VOCAB, 1)
    torch.testing.assert_close(export.tensors["lm_head.weight_scale"], reference.scale)
    assert export.types["model.layers.0.mlp.down_proj.weight"] == "W4A16"


def test_gptq_export_flags_and_stores_the_head(head_export: Path, tiny_llama: Path) -> None:
    export = read_gptq_export(head_export / "gptq_saver")
    qc = export.quantization_config
    assert qc["lm_head"] is True and export.quantize_config["lm_head"] is True
    assert (qc["bits"], qc["group_size"]) == (4, 32)
    assert qc["dynamic"] == {"+:lm_head$": {"bits": 8, "group_size": -1}}
    assert "lm_head.weight" not in export.tensors
    head = export.modules["lm_head"]
    assert (head.bits, head.group_size) == (8, -1)
    reference = _head_reference(tiny_llama)
    assert torch.equal(head.codes - 128, reference.codes.to(head.codes.dtype))
    torch.testing.assert_close(
        head.dequantize(), reference.dequantize(), rtol=2e-3, atol=1e-6
    )  # float16 scales
    assert export.modules["model.layers.0.mlp.down_proj"].bits == 4


def test_compressed_tensors_head_is_in_a_group_and_loads_in_transformers(
    head_export: Path, tiny_llama: Path
) -> None:
    save = head_export / "compressed_tensors"
    qc = json.loads((save / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == []
    groups = {tuple(g["targets"]): g["weights"] for g in qc["config_groups"].values()}
    assert groups[("lm_head",)]["num_bits"] == 8 and groups[("lm_head",)]["strategy"] == "channel"
    assert groups[("Linear",)]["num_bits"] == 4
    loaded = AutoModelForCausalLM.from_pretrained(str(save))
    with torch.no_grad():
        logits = loaded(IDS).logits.float()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()
    body_only = copy.deepcopy(reference)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                q = msquant.plugin.numerics.quantize_weight_minmax(module.weight, 4, True, 32)
                module.weight.copy_(q.dequantize())
                body_only.get_submodule(name).weight.copy_(q.dequantize())
        reference.lm_head.weight.copy_(_head_reference(tiny_llama).dequantize())
        expected, unquantized_head = reference(IDS).logits, body_only(IDS).logits
    scale = expected.abs().max()
    assert float((logits - expected).abs().max() / scale) <= 1e-3
    assert float((unquantized_head - expected).abs().max() / scale) > 1e-4  # the head matters


def test_msquant_verify_checks_the_head_in_every_export(
    head_export: Path, tiny_llama: Path, run_cli: Callable[..., CliResult]
) -> None:
    for saver in SAVERS:
        report = msquant.verify_export(head_export / saver, model_path=tiny_llama)
        assert report.ok, (saver, report.errors)
        head = next(layer for layer in report.layers if layer.name == "lm_head")
        assert (head.bits, head.group_size) == (8, None)
        assert head.relative_error is not None and head.relative_error < 0.031
    warnings = msquant.verify_export(head_export / "compressed_tensors").warnings
    assert not any("ParallelLMHead" in w for w in warnings)  # named in its group: vLLM loads it
    result = run_cli("verify", head_export, "--model_path", tiny_llama)
    assert result.code == 0, result.err
    assert "lm_head" in result.out


def test_saver_warnings_name_the_head_consumers(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(
        _entry(_weight(8, None), lm_head=True), savers=("ascendv1_saver", "compressed_tensors")
    )
    with caplog.at_level(logging.WARNING, logger="msquant"):
        msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False, verify=False)
    messages = [r.getMessage() for r in caplog.records]
    assert any("lm_head is written W8A16, which msModelSlim never does" in m for m in messages)
    assert not any("vLLM cannot load" in m for m in messages)  # vLLM loads a named CT head


# --- runs without lm_head are unchanged ---------------------------------------------------------


def test_default_run_keeps_the_head_float_and_runs_no_head_stage(
    tiny_llama: Path, tmp_path: Path
) -> None:
    config = _config(_entry(_weight(4, 32), include=["*"]), savers=("ascendv1_saver", "gptq_saver"))
    result = msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False)
    assert "lm_head" not in result.quantized_modules
    assert [t.name for t in result.report.layers] == ["model.layers.0", "model.layers.1"]
    ascend = read_ascend_export(tmp_path / "out" / "ascendv1_saver")
    assert ascend.types["lm_head.weight"] == "FLOAT"
    assert torch.equal(ascend.tensors["lm_head.weight"], _original_head(tiny_llama))
    gptq = read_gptq_export(tmp_path / "out" / "gptq_saver")
    assert (
        gptq.quantization_config["lm_head"] is False and "dynamic" not in gptq.quantization_config
    )
    assert torch.equal(gptq.tensors["lm_head.weight"], _original_head(tiny_llama))


def test_a_negative_rule_on_the_head_runs_no_head_stage(tiny_llama: Path, tmp_path: Path) -> None:
    config = _config(
        _entry(_weight(8, None), lm_head=True, dynamic={"-:lm_head": {}}), savers=("gptq_saver",)
    )
    result = msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False)
    assert "lm_head" not in result.quantized_modules
    assert "lm_head" not in [t.name for t in result.report.layers]
    export = read_gptq_export(tmp_path / "out")
    assert export.quantization_config["lm_head"] is False


def test_exports_reload_for_evaluation_with_the_quantized_head(
    head_export: Path, tiny_llama: Path
) -> None:
    """``msquant eval``'s loader rebuilds each export's head from the stored codes."""
    from msquant.evaluate.models import load_model_for_eval

    expected = _head_reference(tiny_llama).dequantize()
    for saver in SAVERS:
        model, kind = load_model_for_eval(head_export / saver)
        assert kind != "float", saver
        torch.testing.assert_close(
            model.get_submodule("lm_head").weight, expected, rtol=2e-3, atol=1e-6
        )  # float16 scales in GPTQ


def test_gptq_quantization_config_with_a_head_unit() -> None:
    from msquant.processors.formats.gptq.config import RuleUnit, build_quantization_config
    from msquant.processors.formats.gptq.scheme import GPTQScheme

    base = GPTQScheme(4, 32, True)
    layer = RuleUnit("model.layers.0", "mlp\\.down_proj", base, "model.layers.0.mlp.down_proj",
                     ("model.layers.0.mlp.down_proj",), 64, 128)  # fmt: skip
    float_layer = RuleUnit(
        "model.layers.0", "mlp\\.down_proj", None, layer.name, layer.members, 64, 128
    )
    same = RuleUnit("", "lm_head", base, "lm_head", ("lm_head",), VOCAB, HIDDEN)
    config = build_quantization_config([layer], "gptq", ["minmax"], same)
    assert config["lm_head"] is True and "dynamic" not in config
    assert build_quantization_config([layer], "gptq", ["minmax"])["lm_head"] is False
    head_only = RuleUnit("", "lm_head", GPTQScheme(8, -1, True), "lm_head", ("lm_head",), 1, 1)
    config = build_quantization_config([float_layer], "gptq", ["minmax"], head_only)
    assert (config["bits"], config["group_size"], config["lm_head"]) == (8, -1, True)
    assert config["dynamic"] == {"-:model\\.layers\\.0\\.mlp\\.down_proj$": {}}
