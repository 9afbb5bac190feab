"""Vision-language models under ``apiversion: multimodal_vlm_modelslim_v1``: the text decoder is
quantized, the vision tower and projector are exported unchanged with their checkpoint names,
and what msquant cannot do as msModelSlim does (scopes reaching the vision tower, a rotation of
the residual stream, image calibration data) is refused with what to change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import CORPUS, build_tiny_vlm

import msquant

W8A8_DYNAMIC = {
    "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
    "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
}


def vlm_config(process: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``multimodal_vlm_modelslim_v1`` config as msModelSlim's practices write it."""
    return {
        "apiversion": "multimodal_vlm_modelslim_v1",
        "spec": {
            "process": process,
            "save": [{"type": "ascendv1_saver", "part_file_size": 4}],
            "dataset": "calibImages",
            "default_text": "Describe this image in detail.",
        },
    }


#: Qwen3.5's dense practice: attention and MLP of the text decoder, the vision tower excluded.
TEXT_ONLY = vlm_config(
    [
        {
            "type": "linear_quant",
            "qconfig": W8A8_DYNAMIC,
            "include": ["*self_attn*", "*mlp*", "*linear_attn*"],
            "exclude": ["*visual*", "*vision_tower*", "*projector*"],
        }
    ]
)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")


def exported(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5", "internvl"])
def test_text_decoder_quantized_vision_exported_unchanged(arch: str, tmp_path: Path) -> None:
    model = build_tiny_vlm(tmp_path / "model", arch)
    save = tmp_path / "export"
    msquant.quantize(model, save, TEXT_ONLY, calib_path=CORPUS, max_calib_tokens=16, progress=False)
    source = load_file(str(model / "model.safetensors"))
    out = exported(save)
    description = json.loads((save / "quant_model_description.json").read_text())
    # the checkpoint's names: model.language_model.* (Qwen), language_model.model.* (InternVL)
    vision = [n for n in source if "language_model." not in n and not n.startswith("lm_head")]
    assert vision, "the tiny model has a vision tower"
    for name in vision:  # byte for byte, under the checkpoint's own names, described FLOAT
        assert out[name].dtype == source[name].dtype and torch.equal(out[name], source[name])
        assert description[name] == "FLOAT", name
    linears = [
        n[: -len(".weight")]
        for n in source
        if "language_model." in n
        and ".layers." in n
        and n.endswith("_proj.weight")
        and source[n].dim() == 2
        and not n.endswith(("in_proj_a.weight", "in_proj_b.weight"))
    ]
    assert linears
    for name in linears:  # every text linear W8A8_DYNAMIC: int8 codes of the float weight
        assert description[f"{name}.weight"] == "W8A8_DYNAMIC", name
        codes, scale = out[f"{name}.weight"], out[f"{name}.weight_scale"]
        assert codes.dtype == torch.int8
        weight = source[f"{name}.weight"].double()
        expected = weight.abs().amax(dim=1, keepdim=True) / 127
        torch.testing.assert_close(scale.double().reshape(-1, 1), expected, rtol=1e-6, atol=0)
        assert ((codes.double() * expected - weight).abs() <= expected * (0.5 + 1e-6)).all()
    assert set(source) <= set(out)  # every checkpoint name kept (vLLM-Ascend loads by them)


def test_scopes_reaching_the_vision_tower_are_refused(qwen3_vl: Path, tmp_path: Path) -> None:
    """Qwen3-VL's practice selects ``*`` but the mergers: msModelSlim quantizes the vision
    blocks' linears (with images); msquant names them and the exclude that keeps them float."""
    config = vlm_config(
        [
            {
                "type": "linear_quant",
                "qconfig": W8A8_DYNAMIC,
                "include": ["*"],
                "exclude": ["*linear_fc2", "*merger*"],
            }
        ]
    )
    with pytest.raises(msquant.QuantizationError) as err:
        msquant.quantize(qwen3_vl, tmp_path / "x", config, calib_path=CORPUS, progress=False)
    message = str(err.value)
    assert "spec.process[0] selects 6 linear layer(s) outside the text decoder" in message
    assert "model.visual.blocks.0.attn.qkv" in message
    assert "model.visual.blocks.1.attn.qkv and 2 more" in message
    assert "'model.visual.*'" in message
    assert not (tmp_path / "x").exists()


def test_rotation_of_a_vision_language_model_is_refused(qwen3_vl: Path, tmp_path: Path) -> None:
    config = vlm_config([{"type": "quarot", "block_size": 16}, *TEXT_ONLY["spec"]["process"]])
    with pytest.raises(
        msquant.MsquantInputError, match=r"vision-language model: its model\.visual"
    ):
        msquant.quantize(qwen3_vl, tmp_path / "x", config, calib_path=CORPUS, progress=False)


def test_image_calibration_samples_are_refused(qwen3_vl: Path, tmp_path: Path) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text(json.dumps({"image": "cat.jpg", "text": "What is this?"}) + "\n")
    with pytest.raises(msquant.CalibrationDataError, match="a multimodal sample \\(its 'image'"):
        msquant.quantize(qwen3_vl, tmp_path / "x", TEXT_ONLY, calib_path=data, progress=False)


def test_image_dataset_name_is_refused(qwen3_vl: Path, tmp_path: Path) -> None:
    """``calibImages`` (every practice's dataset) is refused, installed msModelSlim or not."""
    with pytest.raises(msquant.CalibrationDataError, match="calibrates on text only"):
        msquant.quantize(qwen3_vl, tmp_path / "x", TEXT_ONLY, progress=False)
