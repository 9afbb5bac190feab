"""Qwen2.5-Omni and Qwen3-Omni (the thinker is quantized, as msModelSlim does) and GLM-4.xV-MoE
under msModelSlim's ``multimodal_vlm_modelslim_v1`` practices, on tiny models of the whole
checkpoints.

msModelSlim 26.1.0's Omni adapters load only the thinker (``Qwen2_5OmniThinkerForConditional
Generation`` / ``Qwen3OmniMoeThinkerForConditionalGeneration`` from ``thinker_config``) and write
only its tensors, under the checkpoint's ``thinker.`` names; the talker and the speech decoder
are not in the export. msquant does the same, says so in its log and in ``verify``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run.test_vision_language import W8A8_DYNAMIC, assert_w8a8_dynamic, exported, vlm_config
from safetensors.torch import load_file
from tiny_models import CORPUS, build_tiny_vlm

import msquant

W8A8_STATIC = {
    "act": {"scope": "per_tensor", "dtype": "int8", "symmetric": False, "method": "minmax"},
    "weight": W8A8_DYNAMIC["weight"],
}


@pytest.fixture(scope="module")
def omni25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("omni25"), "qwen2_5_omni")


@pytest.fixture(scope="module")
def omni3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("omni3"), "qwen3_omni_moe")


def test_qwen2_5_omni_practice(omni25: Path, tmp_path: Path) -> None:
    """msModelSlim's ``qwen2_5_omni_thinker_w8a8`` (``*`` but ``*audio_tower*``, ``*visual*``,
    W8A8_DYNAMIC): the thinker's text linears quantized (float64 reference), its audio and
    vision towers byte-identical and FLOAT, every tensor under the checkpoint's ``thinker.``
    name, no talker / token2wav tensor; verify against the original passes, with a warning
    naming the parts left out."""
    process = [
        {
            "type": "linear_quant",
            "qconfig": W8A8_DYNAMIC,
            "include": ["*"],
            "exclude": ["*audio_tower*", "*visual*"],
        }
    ]
    save = tmp_path / "export"
    msquant.quantize(
        omni25, save, vlm_config(process), calib_path=CORPUS, max_calib_tokens=16, progress=False
    )
    source, out = load_file(str(omni25 / "model.safetensors")), exported(save)
    description = json.loads((save / "quant_model_description.json").read_text())
    thinker = {n for n in source if n.startswith("thinker.")}
    assert thinker and len(thinker) < len(source)  # the tiny checkpoint has a talker too
    assert thinker <= set(out)
    assert not [n for n in out if not n.startswith("thinker.")]
    linears = [
        n.removesuffix(".weight")
        for n in thinker
        if n.startswith("thinker.model.layers.") and n.endswith("_proj.weight")
    ]
    assert len(linears) == 14  # 2 layers x q, k, v, o, gate, up, down
    for name in linears:
        assert_w8a8_dynamic(name, out, source, description)
    towers = [n for n in thinker if n.startswith(("thinker.audio_tower.", "thinker.visual."))]
    assert towers
    for name in towers:
        assert out[name].dtype == source[name].dtype and torch.equal(out[name], source[name])
        assert description[name] == "FLOAT", name
    assert description["thinker.lm_head.weight"] == "FLOAT"
    report = msquant.verify_export(save, model_path=omni25)
    assert report.ok, report.errors
    assert report.forward is not None and report.forward.ok
    left_out = len(source) - len(thinker)
    assert any(
        f"{left_out} tensor(s) of the original model's talker, token2wav are not in the export" in w
        for w in report.warnings
    ), report.warnings


def test_qwen3_omni_practice(omni3: Path, tmp_path: Path) -> None:
    """msModelSlim's ``qwen3-omni-moe-w8a8`` (``*`` but ``*audio_tower*``, W8A8_DYNAMIC): the
    thinker's attention and per-expert linears and, data-free, the vision tower's linears and
    mergers quantized; the audio tower and the routers FLOAT; verify passes."""
    process = [
        {
            "type": "linear_quant",
            "qconfig": W8A8_DYNAMIC,
            "include": ["*"],
            "exclude": ["*audio_tower*"],
        }
    ]
    save = tmp_path / "export"
    msquant.quantize(
        omni3, save, vlm_config(process), calib_path=CORPUS, max_calib_tokens=16, progress=False
    )
    source, out = load_file(str(omni3 / "model.safetensors")), exported(save)
    description = json.loads((save / "quant_model_description.json").read_text())
    assert not [n for n in out if not n.startswith("thinker.")]
    quantized = [
        n.removesuffix(".weight")
        for n in source
        if n.startswith(("thinker.model.layers.", "thinker.visual."))
        and n.endswith(".weight")
        and source[n].dim() == 2
        and not n.endswith("mlp.gate.weight")
        and "patch_embed" not in n
        and "pos_embed" not in n
    ]
    assert any(".experts.3.down_proj" in n for n in quantized)
    assert any("visual.merger_list.0.mlp.2" in n for n in quantized)
    for name in quantized:
        assert_w8a8_dynamic(name, out, source, description)
    for name in [n for n in source if n.startswith("thinker.audio_tower.")]:
        assert torch.equal(out[name], source[name]) and description[name] == "FLOAT"
    assert description["thinker.model.layers.0.mlp.gate.weight"] == "FLOAT"
    report = msquant.verify_export(save, model_path=omni3)
    assert report.ok, report.errors
    assert report.forward is not None and report.forward.ok


GLM4_6V = [  # msModelSlim's glm4_6v_w8a8, less its iter_smooth
    {
        "type": "linear_quant",
        "qconfig": W8A8_STATIC,
        "include": ["*"],
        "exclude": [
            "*experts*",
            "*merger*",
            "*mlp.gate",
            "*visual.blocks.*.mlp.down_proj",
            "*language_model.layers.0.self_attn*",
        ],
    },
    {
        "type": "linear_quant",
        "qconfig": W8A8_DYNAMIC,
        "include": ["*experts*"],
        "exclude": ["*merger*", "*mlp.gate", "*visual.blocks.*.mlp.down_proj"],
    },
]


def test_glm4v_moe_practice_needs_image_calibration(tmp_path: Path) -> None:
    """GLM-4.6V's practice quantizes the vision blocks' attention and gate / up projections
    with static W8A8, which msModelSlim calibrates with images: refused, naming them; with the
    vision tower excluded the text decoder exports and verifies."""
    model = build_tiny_vlm(tmp_path / "model", "glm4v_moe")
    with pytest.raises(msquant.QuantizationError) as err:
        msquant.quantize(model, tmp_path / "x", vlm_config(GLM4_6V), calib_path=CORPUS)
    message = str(err.value)
    assert "spec.process[0] selects 8 linear layer(s) outside the text decoder" in message
    assert "model.visual.blocks.0.attn.qkv, model.visual.blocks.0.attn.proj" in message
    assert not (tmp_path / "x").exists()
    text_only = json.loads(json.dumps(GLM4_6V))
    text_only[0]["exclude"].append("*visual*")
    save = tmp_path / "export"
    msquant.quantize(
        model, save, vlm_config(text_only), calib_path=CORPUS, max_calib_tokens=16, progress=False
    )
    description = json.loads((save / "quant_model_description.json").read_text())
    assert description["model.language_model.layers.1.self_attn.q_proj.weight"] == "W8A8"
    assert description["model.language_model.layers.0.self_attn.q_proj.weight"] == "FLOAT"
    assert description["model.language_model.layers.1.mlp.experts.0.up_proj.weight"] == (
        "W8A8_DYNAMIC"
    )
    assert all(v == "FLOAT" for k, v in description.items() if k.startswith("model.visual."))
    report = msquant.verify_export(save, model_path=model)
    assert report.ok, report.errors


def test_static_scheme_on_the_audio_tower_is_refused(omni25: Path, tmp_path: Path) -> None:
    """The audio tower (2 layers x 6 linears and its output ``proj``) is handled like the vision
    tower: msModelSlim calibrates it with audio, msquant calibrates on text only, so a static
    scheme there is refused, naming its layers."""
    process = [{"type": "linear_quant", "qconfig": W8A8_STATIC, "include": ["*audio_tower*"]}]
    with pytest.raises(msquant.QuantizationError) as err:
        msquant.quantize(omni25, tmp_path / "x", vlm_config(process), calib_path=CORPUS)
    message = str(err.value)
    assert "spec.process[0] selects 13 linear layer(s) outside the text decoder" in message
    assert "model.audio_tower.layers.0.self_attn.q_proj" in message
    assert not (tmp_path / "x").exists()
