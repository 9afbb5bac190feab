"""Qwen3-VL-MoE: a checkpoint that stores its routed experts fused on disk.

transformers 5.25 holds ``Qwen3VLMoeTextExperts`` as ``gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]`` and saves them so (``save_pretrained``); the released checkpoints store
them transposed (``[E, H, 2I]`` / ``[E, I, H]``), which transformers transposes while it loads
(``conversion_mapping``: ``Transpose(1, 2, check_dims=True)``). msquant splits them into one
Linear per expert and exports ``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``
``[out, in]``, the names and orientation msModelSlim's Qwen3-VL-MoE adapter writes
(``gate_proj = gate_up[e][:, :I].T`` of the released layout) and vLLM-Ascend loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEEDS_MOE_TRANSFORMERS
from safetensors.torch import load_file
from tiny_models import (
    CORPUS,
    VL_MOE_EXPERTS,
    build_tiny_vl_moe,
    build_tiny_vlm,
    fuse_experts_on_disk,
    vl_moe_expert_weights,
)

import msquant

pytestmark = NEEDS_MOE_TRANSFORMERS

W8 = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
SCHEMES: dict[str, dict[str, Any]] = {
    "W8A16": {"weight": W8},
    "W8A8_DYNAMIC": {
        "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": W8,
    },
}


def text_only(qconfig: dict[str, Any], runner: str | None = None) -> dict[str, Any]:
    """The text decoder (attention and experts), vision tower and routers kept float."""
    spec: dict[str, Any] = {
        "process": [
            {
                "type": "linear_quant",
                "qconfig": qconfig,
                "include": ["*self_attn*", "*mlp*"],
                "exclude": ["*visual*", "*mlp.gate"],
            }
        ],
        "save": [{"type": "ascendv1_saver", "part_file_size": 4}],
        "dataset": "calibImages",
        "default_text": "Describe this image in detail.",
    }
    if runner:
        spec["runner"] = runner
    return {"apiversion": "multimodal_vlm_modelslim_v1", "spec": spec}


@pytest.fixture(scope="module", params=["saved", "released"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_moe(
        tmp_path_factory.mktemp(f"qwen3_vl_moe_{request.param}"), request.param
    )


def exported(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_text_only_export_verifies(checkpoint: Path, scheme: str, tmp_path: Path) -> None:
    """Every expert exported under ``experts.<e>.<role>`` with int8 codes of msModelSlim's
    ``[out, in]`` slice; no fused tensor written; ``verify --model_path`` (forward check
    included) passes against the fused original, whichever layout it stores."""
    save = tmp_path / "export"
    msquant.quantize(
        checkpoint,
        save,
        text_only(SCHEMES[scheme]),
        calib_path=CORPUS,
        max_calib_tokens=16,
        progress=False,
    )
    out = exported(save)
    description = json.loads((save / "quant_model_description.json").read_text())
    assert not [n for n in out if n.endswith(("gate_up_proj", "experts.down_proj"))]
    for name, weight in vl_moe_expert_weights(checkpoint).items():
        assert description[f"{name}.weight"] == scheme, name
        codes, scale = out[f"{name}.weight"], out[f"{name}.weight_scale"]
        assert codes.dtype == torch.int8 and tuple(codes.shape) == tuple(weight.shape)
        step = weight.double().abs().amax(dim=1, keepdim=True) / 127
        torch.testing.assert_close(scale.double().reshape(-1, 1), step, rtol=1e-6, atol=0)
        assert ((codes.double() * step - weight.double()).abs() <= step * (0.5 + 1e-6)).all()
    report = msquant.verify_export(save, model_path=checkpoint)
    assert report.ok, report.errors
    assert not report.warnings, report.warnings
    assert report.forward is not None
    assert len(report.layers) == 2 * (4 + 3 * VL_MOE_EXPERTS)


def test_streamed_and_whole_model_runs_write_the_same_export(tmp_path: Path) -> None:
    """The streamed runner cuts each expert out of the fused tensor transformers loaded."""
    checkpoint = build_tiny_vl_moe(tmp_path / "model", "released")
    for runner in ("layer_wise", "model_wise"):
        msquant.quantize(
            checkpoint,
            tmp_path / runner,
            text_only(SCHEMES["W8A8_DYNAMIC"], runner),
            calib_path=CORPUS,
            max_calib_tokens=16,
            progress=False,
        )
    streamed, whole = exported(tmp_path / "layer_wise"), exported(tmp_path / "model_wise")
    assert streamed.keys() == whole.keys()
    for name in streamed:
        assert torch.equal(streamed[name], whole[name]), name


def test_fused_on_disk_experts_of_a_per_expert_family(tmp_path: Path) -> None:
    """Qwen3.5-MoE, whose checkpoints transformers saves one tensor per expert, from a
    checkpoint holding its experts fused (transformers loads both): the streamed run cuts the
    experts out of the fused tensors, exports them per expert, and verify compares them with
    their slices of the original."""
    checkpoint = build_tiny_vlm(tmp_path / "model", "qwen3_5_moe")
    per_expert = exported(checkpoint)
    fuse_experts_on_disk(checkpoint)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in exported(checkpoint)
    save = tmp_path / "export"
    config = text_only(SCHEMES["W8A8_DYNAMIC"], "layer_wise")
    config["spec"]["process"][0]["include"].append("*linear_attn*")
    config["spec"]["process"][0]["exclude"].append("*shared_expert_gate")
    msquant.quantize(
        checkpoint, save, config, calib_path=CORPUS, max_calib_tokens=16, progress=False
    )
    out = exported(save)
    experts = [n for n in per_expert if ".mlp.experts." in n]
    assert len(experts) == 2 * 3 * 4
    for name in experts:  # the per-expert names, int8 codes of the original expert weight
        step = per_expert[name].double().abs().amax(dim=1, keepdim=True) / 127
        codes = out[name].double()
        assert ((codes * step - per_expert[name].double()).abs() <= step * (0.5 + 1e-6)).all()
    report = msquant.verify_export(save, model_path=checkpoint)
    assert report.ok, report.errors
    assert report.forward is not None
