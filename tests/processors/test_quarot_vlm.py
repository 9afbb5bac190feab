"""``quarot`` on vision-language models: the text decoder's residual stream is rotated as for a
text model, and the projector linears whose output joins it (the image features replacing the
image tokens' embeddings, Qwen3-VL's deepstack features added after the first layers) are
rotated on their output, as msModelSlim 26.1.0 does (its Qwen3-VL / InternVL3.5 adapters'
``get_rotate_map``); the vision tower is otherwise unchanged. Proven on float64 tiny models:
the logits on text and on text + image inputs stay the original's."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rotation_helpers import TOKENS, norms_in_float64, randomize_norms, read_back, rotate_in_memory
from tiny_models import CORPUS, VLM_ARCHS, VOCAB_SIZE, build_tiny_vlm
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText

import msquant
from msquant.plugin import adapter_for

#: image / vision-start / vision-end token ids inside the tiny vocabulary
QWEN_IDS = dict(
    image_token_id=VOCAB_SIZE - 9,
    video_token_id=VOCAB_SIZE - 8,
    vision_start_token_id=VOCAB_SIZE - 7,
    vision_end_token_id=VOCAB_SIZE - 6,
)
IDS: dict[str, dict[str, Any]] = {
    "qwen3_vl": QWEN_IDS,
    "qwen3_vl_moe": QWEN_IDS,
    "qwen3_5": QWEN_IDS,
    "internvl": dict(image_token_id=VOCAB_SIZE - 9, image_seq_length=1),
}
#: what each family's rotation turns on the vision side (the rest of it stays as it was)
FEEDERS = {
    "qwen3_vl": [
        "model.visual.merger.linear_fc2",
        "model.visual.deepstack_merger_list.0.linear_fc2",
    ],
    "qwen3_vl_moe": [
        "model.visual.merger.linear_fc2",
        "model.visual.deepstack_merger_list.0.linear_fc2",
    ],
    "qwen3_5": ["model.visual.merger.linear_fc2"],
    "internvl": ["model.multi_modal_projector.linear_2"],
}


def image_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Token ids holding one image's tokens between text, and the image (random pixels)."""
    config = model.config
    generator = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    if config.model_type == "internvl":  # one 28x28 image, one token after pixel shuffle
        pixels = torch.randn(1, 3, 28, 28, generator=generator, dtype=dtype)
        ids = torch.tensor([[5, 17, config.image_token_id, 42, 99, 3, 250]])
        return dict(input_ids=ids, pixel_values=pixels)
    vision = config.vision_config
    grid = (1, 4, 4)  # 16 patches, merged 2x2 into 4 image tokens
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(16, width, generator=generator, dtype=dtype)
    image = [config.image_token_id] * (16 // vision.spatial_merge_size**2)
    start, end = config.vision_start_token_id, config.vision_end_token_id
    ids = torch.tensor([[5, 17, start, *image, end, 42, 99, 3, 250]])
    return dict(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=torch.tensor([grid]),
        mm_token_type_ids=(ids == config.image_token_id).int(),
    )


def float64_vlm(arch: str) -> nn.Module:
    config = AutoConfig.for_model(arch, **{**VLM_ARCHS[arch], **IDS[arch]})
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float64).eval()
    randomize_norms(model)
    norms_in_float64(model)
    adapter_for(model).unfuse_experts(model)  # transformers' fused experts have no float64
    with torch.no_grad():  # biases on the rotated projector outputs, so their rotation shows
        for name in FEEDERS[arch]:
            model.get_submodule(name).bias.normal_(generator=torch.Generator().manual_seed(2))
    return model


@pytest.mark.parametrize("arch", sorted(FEEDERS))
def test_rotated_vlm_computes_the_original_logits(arch: str, tmp_path: Path) -> None:
    model = float64_vlm(arch)
    inputs = image_inputs(model)
    original = copy.deepcopy(model)
    with torch.no_grad():
        before, text_before = model(**inputs).logits, model(TOKENS).logits
    rotate_in_memory(model, tmp_path, block_size=-1)
    with torch.no_grad():
        after, text_after = model(**inputs).logits, model(TOKENS).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)
    torch.testing.assert_close(text_after, text_before, rtol=0, atol=1e-12)
    kept = dict(original.named_parameters())
    vision = [n for n in kept if not n.startswith(("model.language_model.", "lm_head."))]
    changed = sorted(
        n for n in vision if not torch.equal(dict(model.named_parameters())[n], kept[n])
    )
    assert changed == sorted(f"{f}.{t}" for f in FEEDERS[arch] for t in ("weight", "bias"))
    # the image reaches the logits: left unrotated, the projector outputs change them
    with torch.no_grad():
        for name in FEEDERS[arch]:
            model.get_submodule(name).load_state_dict(original.get_submodule(name).state_dict())
        unrotated = model(**inputs).logits
    assert (unrotated - before).abs().max() > 1e-3


W8A8_DYNAMIC = {
    "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
    "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
}


def test_rotated_vlm_export_reads_back_with_the_original_image_logits(tmp_path: Path) -> None:
    """A run of quarot alone on a tiny Qwen3-VL (float export): the export, read back, computes
    the original's logits on text + image inputs (the rotated mergers are written); ``verify
    --model_path`` passes (the forward check on text)."""
    model = build_tiny_vlm(tmp_path / "model", "qwen3_vl", **QWEN_IDS)
    config = {
        "apiversion": "multimodal_vlm_modelslim_v1",
        "spec": {
            "process": [{"type": "quarot"}],
            "save": [{"type": "ascendv1_saver"}],
        },
    }
    save = tmp_path / "export"
    msquant.quantize(
        model, save, config, calib_path=CORPUS, max_calib_tokens=16, progress=False,
        allow_float_export=True,
    )  # fmt: skip
    original = AutoModelForImageTextToText.from_pretrained(str(model)).eval()
    exported = read_back(save)
    inputs = image_inputs(original)
    with torch.no_grad():
        torch.testing.assert_close(
            exported(**inputs).logits, original(**inputs).logits, rtol=0, atol=1e-4
        )
    description = json.loads((save / "quant_model_description.json").read_text())
    assert description["model.visual.merger.linear_fc2.weight"] == "FLOAT"
    report = msquant.verify_export(save, model_path=model)
    assert report.ok, report.errors


def test_rotation_of_an_unlisted_vlm_family_is_refused(tmp_path: Path) -> None:
    model = build_tiny_vlm(tmp_path / "model", "glm4v_moe")
    config = {
        "apiversion": "multimodal_vlm_modelslim_v1",
        "spec": {
            "process": [
                {"type": "quarot"},
                {"type": "linear_quant", "qconfig": W8A8_DYNAMIC, "include": ["*self_attn*"]},
            ],
            "save": [{"type": "ascendv1_saver"}],
        },
    }
    with pytest.raises(msquant.MsquantInputError) as err:
        msquant.quantize(model, tmp_path / "x", config, calib_path=CORPUS, progress=False)
    message = str(err.value)
    assert "vision-language model (glm4v_moe): its model.visual output joins" in message
    assert "msquant knows them for internvl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe only" in (
        message
    )
    assert not (tmp_path / "x").exists()
