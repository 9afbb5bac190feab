"""The run report ``quant_report.json``: numerics, hashes, contents and determinism."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT
from torch import nn

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.report.document import strip_timings
from msquant.report.hashes import calibration_sha256, config_sha256
from msquant.report.run_report import REPORT_FILE

MAX_TOKENS = 32


def _config(method: str) -> dict[str, Any]:
    # msModelSlim's GPTQ numerics: every layer calibrated on the float model's activations (the
    # report's errors are measured on the activations a module was calibrated on, recomputed below
    # from the float model) and plain min/max scales (as the round-to-nearest error below)
    gptq_ext = {"group_size": 32, "percdamp": 0.01, "numerics": "msmodelslim"}
    ext = {"group_size": 32} if method == "minmax" else gptq_ext
    weight = {"dtype": "int4", "scope": "per_group", "symmetric": False, "method": method}
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"weight": {**weight, "ext": ext}}},
            ],
            "save": [{"type": "ascendv1_saver"}],
        },
    }


def _run(model: Path, save: Path, method: str) -> msquant.QuantizeResult:
    return msquant.quantize(
        model, save, _config(method), calib_path=CALIB_TXT, max_calib_tokens=MAX_TOKENS,
        progress=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gptq_runs(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[msquant.QuantizeResult, msquant.QuantizeResult]:
    """The same GPTQ run twice, into two save paths."""
    root = tmp_path_factory.mktemp("report")
    return _run(tiny_llama, root / "a", "gptq"), _run(tiny_llama, root / "b", "gptq")


def _load(save: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((save / REPORT_FILE).read_text(encoding="utf-8"))
    return data


# -- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_output_error_equals_direct_computation(dtype: torch.dtype, rtol: float) -> None:
    """sqrt(tr(D S D^T) / tr(W S W^T)) == ||X W^T - X W_hat^T|| / ||X W^T|| (float64 reference)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 48, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, 48)
    weight = torch.randn(24, 48, generator=gen, dtype=torch.float64)
    noisy = [weight + 0.05 * torch.randn(24, 48, generator=gen, dtype=torch.float64) for _ in "ab"]
    rtn = msquant.plugin.numerics.quantize_weight_minmax(weight.float(), 4, False, 16).dequantize()
    candidates = [*noisy, rtn]
    hessian = (x.T @ x).to(dtype)
    got = msquant.plugin.numerics.relative_output_errors(weight, candidates, hessian, dtype=dtype)
    reference = x @ weight.T
    expected = [float((x @ w.double().T - reference).norm() / reference.norm()) for w in candidates]
    assert got == pytest.approx(expected, rel=rtol)
    # any positive multiple of X^T X (the Hessian (2/n) X^T X itself) gives the same ratios
    scaled = msquant.plugin.numerics.relative_output_errors(
        weight, candidates, hessian * (2 / 300), dtype=dtype
    )
    assert scaled == pytest.approx(expected, rel=rtol)


def test_output_error_edge_cases() -> None:
    weight = torch.ones(2, 3)
    zero_input = torch.zeros(3, 3)
    assert msquant.plugin.numerics.relative_output_errors(
        weight, [weight, weight * 2], zero_input
    ) == [
        0.0,
        0.0,
    ]
    assert msquant.plugin.numerics.relative_output_errors(weight, [weight], torch.eye(3)) == [0.0]
    with pytest.raises(ValueError, match=r"hessian has shape \(2, 2\), expected \(3, 3\)"):
        msquant.plugin.numerics.relative_output_errors(weight, [weight], torch.eye(2))
    with pytest.raises(ValueError, match=r"quantized weight has shape \(3, 2\), expected \(2, 3\)"):
        msquant.plugin.numerics.relative_output_errors(weight, [weight.T], torch.eye(3))


def test_calibration_hash_covers_ids_and_sample_boundaries() -> None:
    one = [torch.tensor([[1, 2]]), torch.tensor([[3]])]
    digest = calibration_sha256(one)
    assert digest == calibration_sha256([t.clone() for t in one])
    assert digest != calibration_sha256([torch.tensor([[1]]), torch.tensor([[2, 3]])])
    assert digest != calibration_sha256([torch.tensor([[1, 2]]), torch.tensor([[4]])])
    expected = hashlib.sha256()
    for ids in ([1, 2], [3]):
        expected.update(len(ids).to_bytes(8, "little"))
        expected.update(b"".join(i.to_bytes(8, "little", signed=True) for i in ids))
    assert digest == expected.hexdigest()
    assert calibration_sha256(None) is None
    assert calibration_sha256([]) is None


def test_config_hash_ignores_key_order() -> None:
    assert config_sha256({"a": 1, "b": [1, 2]}) == config_sha256({"b": [1, 2], "a": 1})
    assert config_sha256({"a": 1}) != config_sha256({"a": 2})


def test_non_finite_values_become_null() -> None:
    report = msquant.RunReport()
    report.add_module(
        msquant.plugin.ModuleReport("m", "gptq", 4, None, True, output_error=float("inf"))
    )
    assert json.loads(report.to_json())["modules"][0]["output_error"] is None


# -- a real run ----------------------------------------------------------------------------------


def test_two_identical_runs_give_identical_exports_and_reports(
    gptq_runs: tuple[msquant.QuantizeResult, msquant.QuantizeResult],
) -> None:
    first, second = (run.save_path for run in gptq_runs)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    assert Path(REPORT_FILE) in files
    for name in files:
        if name != Path(REPORT_FILE):
            assert (first / name).read_bytes() == (second / name).read_bytes(), name
    report_a, report_b = _load(first), _load(second)
    assert strip_timings(report_a) == strip_timings(report_b)
    timing_keys = {k for k in report_a if k.endswith("seconds")}
    assert timing_keys == {"capture_seconds", "total_seconds"}
    assert "seconds" in report_a["layers"][0] and "solve_seconds" in report_a["modules"][0]


def test_report_contents(
    gptq_runs: tuple[msquant.QuantizeResult, msquant.QuantizeResult], tiny_llama: Path
) -> None:
    result = gptq_runs[0]
    report = _load(result.save_path)
    assert report == json.loads(json.dumps(result.report.to_dict()))
    assert report["msquant_version"] == msquant.__version__
    assert report["torch_version"] == torch.__version__
    import transformers

    assert report["transformers_version"] == transformers.__version__
    assert report["python_version"].count(".") == 2
    validated = msquant.validate_config(_config("gptq"), msquant.plugin.default_registry())
    canonical = json.dumps(validated.model_dump(mode="json"), sort_keys=True)
    assert report["config_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
    samples = tokenize_samples(
        read_calibration_texts(CALIB_TXT), load_tokenizer(tiny_llama), MAX_TOKENS
    )
    assert report["calibration_sha256"] == calibration_sha256(samples)
    assert report["calibration_samples"] == len(samples) == result.calibration_samples
    assert report["calibration_tokens"] == sum(s.numel() for s in samples)
    assert report["model_path"] == str(tiny_llama.absolute())
    assert (report["model_type"], report["device"]) == ("llama", "cpu")

    layers = report["layers"]
    assert [(row["index"], row["name"]) for row in layers] == [
        (0, "model.layers.0"),
        (1, "model.layers.1"),
    ]
    assert report["total_seconds"] >= sum(row["seconds"] for row in layers) > 0

    modules = {row["name"]: row for row in report["modules"]}
    assert sorted(modules) == sorted(result.quantized_modules)
    assert len(modules) == 14
    for row in modules.values():
        assert (row["method"], row["bits"], row["group_size"], row["symmetric"]) == (
            "gptq", 4, 32, False,
        )  # fmt: skip
        assert row["percdamp"] == pytest.approx(0.01) and row["damp_retries"] == 0
        assert row["dead_columns"] == 0 and row["gptq_loss"] > 0 and row["solve_seconds"] >= 0

    # the errors equal the direct computation on the float model's activations and export
    export = read_ascend_export(result.save_path)
    inputs = _float_inputs(tiny_llama, samples)
    original = load_causal_lm(tiny_llama).state_dict()
    for name, row in modules.items():
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[name]]).double()
        weight = original[f"{name}.weight"].double()
        reference = x @ weight.T
        gptq = (x @ export.dequantized(name).double().T - reference).norm() / reference.norm()
        rtn_weight = msquant.plugin.numerics.quantize_weight_minmax(
            weight.float(), 4, False, 32
        ).dequantize()
        rtn = (x @ rtn_weight.double().T - reference).norm() / reference.norm()
        assert row["output_error"] == pytest.approx(float(gptq), rel=1e-3), name
        assert row["rtn_output_error"] == pytest.approx(float(rtn), rel=1e-3), name
        assert row["output_error"] <= row["rtn_output_error"] * 1.0001, name


def test_report_table_is_logged(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A round-to-nearest run: no calibration, so no hash, no errors and no GPTQ statistics."""
    with caplog.at_level(logging.INFO, logger="msquant"):
        result = msquant.quantize(tiny_llama, tmp_path / "out", _config("minmax"), progress=False)
    report = _load(result.save_path)
    assert report["calibration_sha256"] is None
    assert (report["calibration_samples"], report["calibration_tokens"]) == (0, 0)
    assert report["capture_seconds"] is None
    assert len(report["modules"]) == 14
    for row in report["modules"]:
        assert row["method"] == "minmax"
        for key in ("gptq_loss", "percdamp", "damp_retries", "dead_columns", "output_error",
                    "rtn_output_error", "solve_seconds"):  # fmt: skip
            assert row[key] is None, key
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    table = next(m for m in logged if m.startswith(f"run report ({REPORT_FILE})"))
    assert re.search(r"^model\.layers\.1\.mlp\.down_proj +minmax +4 +32 +no +- ", table, re.M)
    assert "14 module(s), 2 layer(s)" in table


def _float_inputs(model_dir: Path, samples: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Inputs of every decoder linear layer in a plain float forward, per calibration sample."""
    model = load_causal_lm(model_dir)
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in name:

            def record(
                _: nn.Module, args: tuple[torch.Tensor, ...], __: object, name: str = name
            ) -> None:
                inputs.setdefault(name, []).append(args[0].detach().clone())

            handles.append(module.register_forward_hook(record))
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return inputs
