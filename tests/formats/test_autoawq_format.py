"""``autoawq_saver`` and the ``autoawq`` format, added through the format extension point: the
packing against the layout's definition (a known word, a float64 dequantization written here bit
by bit), the run's read-back check, ``msquant verify`` and ``eval`` reading it, what one AWQ
config cannot describe refused before weights load, and the former type ``awq_saver`` still
accepted with a deprecation warning, writing the same export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant import verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.plugin import QuantizedLinear, QuantizedWeight, default_formats
from msquant.processors.formats.autoawq.packer import awq_module_tensors

#: Output ``8j + ORDER[k]`` sits in nibble ``k`` of word ``j`` (AutoAWQ's GEMM layout).
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _linear(codes: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor, group: int) -> Any:
    """A QuantizedLinear from signed codes ``[out, in]`` and signed zero points ``[out, G]``."""
    weight = QuantizedWeight(codes.to(torch.int8), scale, zeros.float(), 4, False, group)
    return QuantizedLinear(weight, None, "minmax")


def _unpack_by_hand(words: torch.Tensor, out_features: int) -> torch.Tensor:
    """``[rows, out]`` unsigned values, one nibble at a time, from the layout's definition."""
    rows = words.shape[0]
    values = torch.zeros(rows, out_features, dtype=torch.int64)
    for r in range(rows):
        for j in range(words.shape[1]):
            word = int(words[r, j]) & 0xFFFFFFFF
            for k in range(8):
                values[r, 8 * j + ORDER[k]] = (word >> (4 * k)) & 0xF
    return values


def test_a_known_word() -> None:
    """Unsigned codes 0..7 of one input column: nibbles hold outputs 0, 2, 4, 6, 1, 3, 5, 7."""
    signed = (torch.arange(8) - 8).reshape(8, 1).repeat(1, 4)  # outputs o get code o (unsigned)
    module = _linear(signed, torch.zeros(8, 1), torch.ones(8, 1), 4)
    tensors = awq_module_tensors("p", module)
    assert tensors["p.qweight"].shape == (4, 1) and tensors["p.qweight"].dtype == torch.int32
    assert int(tensors["p.qweight"][0, 0]) & 0xFFFFFFFF == 0x75316420
    assert int(tensors["p.qzeros"][0, 0]) & 0xFFFFFFFF == 0x88888888  # signed 0 -> unsigned 8
    assert tensors["p.scales"].dtype == torch.float16 and tensors["p.scales"].shape == (1, 8)


def test_packing_dequantizes_to_the_weight_in_float64() -> None:
    torch.manual_seed(0)
    weight = torch.randn(16, 64, dtype=torch.float32)
    qweight = msquant.plugin.numerics.quantize_weight_minmax(weight, 4, False, 32)
    module = QuantizedLinear(qweight, torch.randn(16), "minmax")
    tensors = awq_module_tensors("p", module)
    codes = _unpack_by_hand(tensors["p.qweight"], 16).double()  # [in, out]
    zeros = _unpack_by_hand(tensors["p.qzeros"], 16).double()  # [G, out]
    scales = tensors["p.scales"].double()  # [G, out]
    group = torch.arange(64) // 32
    dequantized = ((codes - zeros[group]) * scales[group]).t()
    reference = (qweight.codes.double() - qweight.offset.double()[:, group]) * qweight.scale.to(
        torch.float16
    ).double()[:, group]
    assert torch.equal(dequantized, reference)
    assert torch.equal(tensors["p.bias"], module.bias.to(torch.float16))


def _config(saver: str = "autoawq_saver", **weight: Any) -> dict[str, Any]:
    spec = {"scope": "per_group", "dtype": "int4", "symmetric": False, "method": "minmax"}
    spec.update(weight)
    return {
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"weight": spec}, "exclude": ["*down_proj"]}
            ],
            "save": [{"type": saver}],
        }
    }


GROUP32 = {"ext": {"group_size": 32}}


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_an_awq_export_is_read_back_verified_and_evaluated(
    tiny_llama: Path, tmp_path: Path, symmetric: bool, caplog: pytest.LogCaptureFixture
) -> None:
    assert "autoawq" in default_formats().names()
    save = tmp_path / "awq"
    with caplog.at_level("INFO", logger="msquant"):
        result = msquant.quantize(
            tiny_llama, save, _config(symmetric=symmetric, **GROUP32), progress=False
        )
    assert "verify: autoawq_saver export read back, 12 quantized layer(s) identical" in caplog.text
    config = json.loads((save / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "awq" and config["bits"] == 4 and config["group_size"] == 32
    assert config["zero_point"] is True and config["version"] == "gemm"
    assert config["modules_to_not_convert"] == [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
    ]
    report = verify_export(save, model_path=tiny_llama)
    assert report.ok, report.errors
    assert report.format == "autoawq" and len(report.layers) == len(result.quantized_modules) == 12
    assert all(layer.symmetric is symmetric for layer in report.layers)
    model, kind = load_model_for_eval(save)
    assert kind == "autoawq"
    stored = {}
    for shard in sorted(save.glob("model*.safetensors")):
        stored.update(load_file(str(shard)))
    name = "model.layers.0.self_attn.q_proj"
    out = stored[f"{name}.scales"].shape[1]
    codes = _unpack_by_hand(stored[f"{name}.qweight"], out).double()
    zeros = _unpack_by_hand(stored[f"{name}.qzeros"], out).double()
    group = torch.arange(codes.shape[0]) // 32
    expected = ((codes - zeros[group]) * stored[f"{name}.scales"].double()[group]).t()
    weight = model.get_submodule(name).weight.detach()
    assert torch.equal(weight, expected.to(weight.dtype))


@pytest.mark.parametrize(
    ("weight", "needle"),
    [
        ({"scope": "per_channel"}, "AWQ stores 4-bit per-group weights only"),
        ({"dtype": "int8", **GROUP32}, "AWQ stores 4-bit per-group weights only"),
    ],
    ids=["per_channel", "int8"],
)
def test_what_one_awq_config_cannot_describe_is_refused_before_weights_load(
    tiny_llama: Path, tmp_path: Path, run_cli: Any, weight: dict[str, Any], needle: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(_config(**weight)))
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out", "--config_path", path
    )
    assert result.code == 2
    assert "autoawq_saver: " + needle in result.err
    assert not (tmp_path / "out").exists()


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _record(data: bytes) -> Any:
    """msquant's JSON record with what changes from run to run (timings) and the config's hash
    left out, and the saver's type written in its former name."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: strip(v)
                for k, v in value.items()
                if not k.endswith("seconds") and k != "config_sha256"
            }
        return [strip(v) for v in value] if isinstance(value, list) else value

    return strip(json.loads(data.decode().replace('"autoawq_saver"', '"awq_saver"')))


def test_the_former_type_awq_saver_warns_and_writes_the_same_export(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config written before the rename (``type: awq_saver``) still runs: one warning names the
    new type, the export is byte for byte the one ``autoawq_saver`` writes, and it is detected
    (by its ``quant_method: awq``) and verified as ``autoawq``."""
    new, old = tmp_path / "new", tmp_path / "old"
    msquant.quantize(tiny_llama, new, _config(**GROUP32), progress=False)
    assert "deprecated" not in caplog.text
    with caplog.at_level("WARNING", logger="msquant"):
        msquant.quantize(tiny_llama, old, _config("awq_saver", **GROUP32), progress=False)
    warnings = [
        r.getMessage() for r in caplog.records if "awq_saver is deprecated" in r.getMessage()
    ]
    assert warnings == [
        "spec.save type awq_saver is deprecated: the AutoAWQ checkpoint format is now "
        "autoawq_saver (the name awq is kept for the AWQ algorithm); write type: autoawq_saver "
        "(the export is the same)"
    ]
    written = _files(old)
    assert written.keys() == _files(new).keys() and "config.json" in written
    differing = [name for name, data in _files(new).items() if written[name] != data]
    # the weights, config.json and every file a loader reads are equal; msquant's own records
    # differ in the saver's type name, the config's hash and timings only
    assert differing == ["msquant_export.json", "quant_report.json"]
    for name in differing:
        assert _record(written[name]) == _record(_files(new)[name])
    report = verify_export(old, model_path=tiny_llama)
    assert report.ok and report.format == "autoawq", report.errors
    caplog.clear()
    with caplog.at_level("WARNING", logger="msquant"):
        msquant.validate_config(_config("awq_saver", **GROUP32), msquant.plugin.default_registry())
    assert [r.getMessage() for r in caplog.records] == warnings
