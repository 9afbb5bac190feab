"""Vision-language models under ``apiversion: multimodal_vlm_modelslim_v1``: the text decoder is
quantized, the vision tower and projector are exported unchanged with their checkpoint names,
and what msquant cannot do as msModelSlim does (scopes reaching the vision tower without image
calibration, a rotation of an unlisted family) is refused with what to change (image calibration
itself: tests/run/test_image_calibration.py).
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


def assert_w8a8_dynamic(
    name: str,
    out: dict[str, torch.Tensor],
    source: dict[str, torch.Tensor],
    description: dict[str, str],
) -> None:
    """``name`` is exported W8A8_DYNAMIC: int8 codes and per-channel symmetric scales of the
    float weight, checked in float64."""
    assert description[f"{name}.weight"] == "W8A8_DYNAMIC", name
    codes, scale = out[f"{name}.weight"], out[f"{name}.weight_scale"]
    assert codes.dtype == torch.int8
    weight = source[f"{name}.weight"].double()
    expected = weight.abs().amax(dim=1, keepdim=True) / 127
    torch.testing.assert_close(scale.double().reshape(-1, 1), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        codes.double(), torch.round(weight / expected).clamp(-128, 127), rtol=0, atol=1
    )
    assert ((codes.double() * expected - weight).abs() <= expected * (0.5 + 1e-6)).all()


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
        assert_w8a8_dynamic(name, out, source, description)
    assert set(source) <= set(out)  # every checkpoint name kept (vLLM-Ascend loads by them)


W8A8_STATIC = {
    "act": {"scope": "per_tensor", "dtype": "int8", "symmetric": True, "method": "minmax"},
    "weight": W8A8_DYNAMIC["weight"],
}


def test_static_scopes_reaching_the_vision_tower_are_refused(
    qwen3_vl: Path, tmp_path: Path
) -> None:
    """Qwen3-VL's practice selects ``*`` but the mergers with static W8A8: msModelSlim
    calibrates the vision blocks' linears with images; msquant cannot, and names them and the
    exclude that keeps them float."""
    config = vlm_config(
        [
            {
                "type": "linear_quant",
                "qconfig": W8A8_STATIC,
                "include": ["*"],
                "exclude": ["*linear_fc2", "*merger*"],
            }
        ]
    )
    with pytest.raises(msquant.QuantizationError) as err:
        msquant.quantize(qwen3_vl, tmp_path / "x", config, calib_path=CORPUS, progress=False)
    message = str(err.value)
    assert "spec.process[0] selects 6 linear layer(s) outside the text decoder" in message
    assert "with a scheme that needs calibration data" in message
    assert "model.visual.blocks.0.attn.qkv" in message
    assert "model.visual.blocks.1.attn.qkv and 2 more" in message
    assert "'model.visual.*'" in message
    assert not (tmp_path / "x").exists()


def test_calibrated_method_on_the_vision_tower_is_refused(qwen3_vl: Path, tmp_path: Path) -> None:
    """GPTQ learns from calibration data, which never reaches the vision tower."""
    gptq = {"act": W8A8_DYNAMIC["act"], "weight": dict(W8A8_DYNAMIC["weight"], method="gptq")}
    config = vlm_config([{"type": "linear_quant", "qconfig": gptq, "include": ["*visual.blocks*"]}])
    with pytest.raises(msquant.QuantizationError, match="needs calibration data"):
        msquant.quantize(qwen3_vl, tmp_path / "x", config, calib_path=CORPUS, progress=False)
    assert not (tmp_path / "x").exists()


#: Per architecture: a practice's data-free entries selecting vision linears (Qwen3.6 dense:
#: ``*visual.blocks*`` but ``*linear_fc2*``; Kimi-K2.5: ``*mlp*`` reaches the vision MLPs), the
#: exclude keeping the vision parts float, and which checkpoint names of the vision tower the
#: practice quantizes.
DATA_FREE_PRACTICES: dict[str, tuple[list[dict[str, Any]], list[str], Any]] = {
    "qwen3_5": (
        [
            {
                "type": "linear_quant",
                "qconfig": W8A8_DYNAMIC,
                "include": ["*self_attn*", "*mlp*", "*visual.blocks*"],
                "exclude": ["*linear_fc2*"],
            }
        ],
        ["*visual*"],
        lambda n: n.startswith("model.visual.blocks.") and "linear_fc2" not in n,
    ),
    "kimi_k25": (
        [
            {
                "type": "group",
                "configs": [
                    {"type": "linear_quant", "qconfig": W8A8_DYNAMIC, "include": ["*self_attn*"]},
                    {
                        "type": "linear_quant",
                        "qconfig": W8A8_DYNAMIC,
                        "include": ["*mlp*"],
                        "exclude": ["*mlp.experts.*"],
                    },
                ],
            }
        ],
        ["*vision_tower*"],
        lambda n: n.startswith("vision_tower.") and ".mlp." in n,
    ),
}


@pytest.mark.parametrize("arch", sorted(DATA_FREE_PRACTICES))
def test_data_free_vision_linears_are_quantized(arch: str, tmp_path: Path) -> None:
    """Vision linears selected with a data-free scheme (W8A8_DYNAMIC minmax) are quantized
    from their weights and exported under the checkpoint's names; the other vision tensors
    stay byte-identical and FLOAT; the text decoder comes out as with the vision excluded."""
    process, vision_exclude, quantized = DATA_FREE_PRACTICES[arch]
    model = build_tiny_vlm(tmp_path / "model", arch)
    save = tmp_path / "export"
    msquant.quantize(
        model, save, vlm_config(process), calib_path=CORPUS, max_calib_tokens=16, progress=False
    )
    excluded = json.loads(json.dumps(process))
    for entry in excluded[0].get("configs", excluded):
        entry["exclude"] = [*entry.get("exclude", []), *vision_exclude]
    text_only = tmp_path / "text_only"
    msquant.quantize(
        model,
        text_only,
        vlm_config(excluded),
        calib_path=CORPUS,
        max_calib_tokens=16,
        progress=False,
    )
    source = load_file(str(model / "model.safetensors"))
    out, reference = exported(save), exported(text_only)
    description = json.loads((save / "quant_model_description.json").read_text())
    vision = [n for n in source if "language_model." not in n and not n.startswith("lm_head")]
    chosen = [
        n[: -len(".weight")]
        for n in vision
        if n.endswith(".weight") and source[n].dim() == 2 and quantized(n)
    ]
    assert len(chosen) >= 2, "the practice selects vision linears of the tiny model"
    for name in chosen:  # int8 codes and per-channel scales of the float weight (float64)
        assert_w8a8_dynamic(name, out, source, description)
    chosen_tensors = {n for n in out if n.startswith(tuple(f"{c}." for c in chosen))}
    assert set(out) == set(reference) | chosen_tensors
    reference_description = json.loads((text_only / "quant_model_description.json").read_text())
    kept = [n for n in vision if n in out and n not in chosen_tensors]
    assert kept
    for name in kept:  # byte for byte, described FLOAT
        assert out[name].dtype == source[name].dtype and torch.equal(out[name], source[name])
        assert description[name] == "FLOAT", name
    others = [n for n in reference if n not in chosen_tensors]
    for name in others:  # the text decoder (and the rest) as in the run excluding the vision
        assert torch.equal(out[name], reference[name]), name
        assert description[name] == reference_description[name], name
    assert any(reference_description[n] == "W8A8_DYNAMIC" for n in others)


def test_tensors_transformers_converts_are_exported_in_the_checkpoints_form(
    tmp_path: Path,
) -> None:
    """Kimi-K2.5's MoonViT stores each block's q/k/v as one ``wqkv``, which transformers splits
    into ``q_proj`` / ``k_proj`` / ``v_proj`` on load: the export holds the checkpoint's
    ``wqkv`` byte for byte (not the split names, which vLLM-Ascend would not load), and
    ``verify --model_path`` rebuilds the model from it (the forward check passes)."""
    process = DATA_FREE_PRACTICES["kimi_k25"][0]
    model = build_tiny_vlm(tmp_path / "model", "kimi_k25")
    save = tmp_path / "export"
    msquant.quantize(
        model, save, vlm_config(process), calib_path=CORPUS, max_calib_tokens=16, progress=False
    )
    source, out = load_file(str(model / "model.safetensors")), exported(save)
    description = json.loads((save / "quant_model_description.json").read_text())
    fused = [n for n in source if ".wqkv." in n]
    assert len(fused) == 4  # 2 blocks x weight, bias
    for name in fused:
        assert out[name].dtype == source[name].dtype and torch.equal(out[name], source[name])
        assert description[name] == "FLOAT"
    assert not [n for n in out if n.startswith("vision_tower.") and "_proj." in n]
    assert set(source) <= set(out)
    report = msquant.verify_export(save, model_path=model)
    assert report.ok, report.errors
    assert report.forward is not None and report.forward.ok


def test_quantizing_a_tensor_transformers_converts_is_refused(tmp_path: Path) -> None:
    """MoonViT's q/k/v have no name of their own in the checkpoint (``wqkv``): quantizing them
    would write tensors no engine can name, so the run stops before writing anything."""
    model = build_tiny_vlm(tmp_path / "model", "kimi_k25")
    process = [
        {
            "type": "linear_quant",
            "qconfig": W8A8_DYNAMIC,
            "include": ["*self_attn*", "*vision_tower*"],  # the vision q/k/v among them
        }
    ]
    with pytest.raises(
        msquant.QuantizationError, match=r"through a weight conversion.*\(exclude it\)"
    ):
        msquant.quantize(
            model, tmp_path / "x", vlm_config(process), calib_path=CORPUS, progress=False
        )
    assert not (tmp_path / "x").exists()


def test_rotation_of_a_vision_language_model_runs(qwen3_vl: Path, tmp_path: Path) -> None:
    """quarot rotates the text decoder's stream and the mergers feeding it
    (tests/processors/test_quarot_vlm.py proves the function on images); with the text decoder
    quantized the export verifies against the original."""
    config = vlm_config([{"type": "quarot", "block_size": 16}, *TEXT_ONLY["spec"]["process"]])
    save = tmp_path / "export"
    msquant.quantize(qwen3_vl, save, config, calib_path=CORPUS, max_calib_tokens=16, progress=False)
    description = json.loads((save / "quant_model_description.json").read_text())
    assert description["model.language_model.layers.0.self_attn.q_proj.weight"] == "W8A8_DYNAMIC"
    assert description["model.visual.merger.linear_fc2.weight"] == "FLOAT"
    source, out = load_file(str(qwen3_vl / "model.safetensors")), exported(save)
    rotated = "model.visual.merger.linear_fc2.weight"
    assert not torch.equal(out[rotated], source[rotated])
    assert torch.equal(
        out["model.visual.blocks.0.attn.qkv.weight"],
        source["model.visual.blocks.0.attn.qkv.weight"],
    )
    report = msquant.verify_export(save, model_path=qwen3_vl)
    assert report.ok, report.errors


def test_image_calibration_samples_are_refused(qwen3_vl: Path, tmp_path: Path) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text(json.dumps({"image": "cat.jpg", "text": "What is this?"}) + "\n")
    with pytest.raises(msquant.CalibrationDataError, match="a multimodal sample \\(its 'image'"):
        msquant.quantize(qwen3_vl, tmp_path / "x", TEXT_ONLY, calib_path=data, progress=False)


def test_image_dataset_name_without_its_folder_is_refused(
    qwen3_vl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``calibImages`` (every practice's dataset) is read from a folder of that name beside the
    YAML or from an installed msModelSlim; with neither, it is refused saying where to put it."""
    monkeypatch.setattr("msquant.load.image_calibration.msmodelslim_lab_calib", lambda: None)
    with pytest.raises(msquant.CalibrationDataError, match="put a folder of that name"):
        msquant.quantize(qwen3_vl, tmp_path / "x", TEXT_ONLY, progress=False)
