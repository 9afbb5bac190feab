"""Image calibration of a vision-language model (msModelSlim's ``calibImages`` + ``default_text``):
the decoder's inputs captured through the vision tower reproduce transformers' whole-model
forward, the vision tower's static W8A8 ranges are those of the images' forward, and msModelSlim's
Qwen3-VL practices run unchanged, export and verify."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import build_tiny_vlm_with_processor, write_calibration_images

import msquant
from msquant.load import image_calibration
from msquant.plugin import adapter_for
from msquant.plugin.devices import get_backend
from msquant.run.capture import capture_layer_inputs

image_samples = image_calibration.image_samples
load_processor = image_calibration.load_processor
read_image_folder = image_calibration.read_image_folder

pytest.importorskip("PIL")

TEXT = "Describe this image in detail."
W8A8 = {
    "act": {"scope": "per_tensor", "dtype": "int8", "symmetric": False, "method": "minmax"},
    "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
}
#: msModelSlim 26.1.0's qwen3_vl/qwen3_vl_4b_w8a8.yaml, as shipped (comments dropped): static
#: W8A8 on everything but the text MLP's down_proj, the mergers and the vision MLP's linear_fc2.
QWEN3_VL_4B_W8A8 = """\
apiversion: multimodal_vlm_modelslim_v1
metadata:
  config_id: qwen3_vl_4b_w8a8
spec:
  process:
    - type: "iter_smooth"
      alpha: 0.9
      scale_min: 1e-5
      symmetric: True
      enable_subgraph_type: ['norm-linear', 'linear-linear', 'ov', 'up-down']
      include: ["*"]
    - type: "linear_quant"
      qconfig:
        act: {scope: "per_tensor", dtype: "int8", symmetric: False, method: "minmax"}
        weight: {scope: "per_channel", dtype: "int8", symmetric: True, method: "minmax"}
      include: ["*"]
      exclude: ["model.language_model.layers.*.mlp.down_proj", "*linear_fc2", "*merger*"]
  save:
    - type: "ascendv1_saver"
      part_file_size: 4
  dataset: "calibImages"
  default_text: "Describe this image in detail."
"""


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL with its processor: 3 text layers, deepstack features of both vision
    blocks added after text layers 0 and 1."""
    return build_tiny_vlm_with_processor(
        tmp_path_factory.mktemp("qwen3_vl"),
        text={"num_hidden_layers": 3},
        vision={"deepstack_visual_indexes": [0, 1]},
    )


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_calibration_images(tmp_path_factory.mktemp("data") / "calibImages")


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe", "internvl", "glm4v_moe"])
def test_layer_wise_run_on_images_computes_the_whole_models_logits(
    arch: str, qwen3_vl: Path, images: Path, tmp_path: Path
) -> None:
    """In float64, the decoder's inputs captured through the vision tower, pushed through the
    layers one at a time (Qwen3-VL's deepstack features added back between them), give
    transformers' logits of the image + text forward (the MoE models in float32: their experts'
    grouped matrix product takes no float64, so the same operations in float32, to 1e-6)."""
    from transformers import AutoModelForImageTextToText

    folder = qwen3_vl if arch == "qwen3_vl" else build_tiny_vlm_with_processor(tmp_path, arch)
    moe = arch in ("glm4v_moe", "qwen3_vl_moe")
    dtype, tolerance = (torch.float32, 1e-6) if moe else (torch.float64, 1e-12)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype).eval()
    samples = image_samples(read_image_folder(images), TEXT, load_processor(folder))
    assert len(samples.input_ids) == 2 and "pixel_values" in samples.inputs[0]
    layers = adapter_for(model).decoder_layers(model)
    backend = get_backend("cpu")
    activations = capture_layer_inputs(model, layers, samples.input_ids, media=samples.inputs)
    plain = capture_layer_inputs(model, layers, samples.input_ids, media=samples.inputs)
    if arch == "qwen3_vl":
        assert sorted(activations.between[0]) == [0, 1]  # deepstack after layers 0 and 1
        plain.between = []  # the same run without the deepstack additions
    elif arch == "qwen3_vl_moe":
        assert sorted(activations.between[0]) == [0]  # its one deepstack feature
        plain.between = []  # the same run without the deepstack additions
    else:
        assert activations.between == []  # InternVL and GLM-4.xV add nothing between layers
    inputs_of = [
        {**inputs, "pixel_values": inputs["pixel_values"].to(dtype)} for inputs in samples.inputs
    ]
    with torch.no_grad():
        for layer in layers:
            activations.advance(layer, backend)
            plain.advance(layer, backend)
        body = model.model.language_model
        for number, (ids, inputs) in enumerate(zip(samples.input_ids, inputs_of, strict=True)):
            expected = model(input_ids=ids, **inputs).logits
            logits = model.lm_head(body.norm(activations.hidden[number]))
            torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
            if arch.startswith("qwen3_vl"):
                without = model.lm_head(body.norm(plain.hidden[number]))
                assert (without - expected).abs().max() > 1e-3  # the deepstack additions matter
            text_only = model(input_ids=ids, attention_mask=inputs["attention_mask"]).logits
            assert (text_only - expected).abs().max() > 1e-3  # the image reaches the logits


def exported(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def first_linear_range(model_dir: Path, images: Path, name: str) -> tuple[float, float]:
    """The float64 min and max of linear ``name``'s input over the images' forward (the model
    in float64, all float)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float64)
    samples = image_samples(read_image_folder(images), TEXT, load_processor(model_dir))
    seen: list[torch.Tensor] = []
    hook = model.get_submodule(name).register_forward_pre_hook(
        lambda _, args: seen.append(args[0].detach())
    )
    with torch.no_grad():
        for ids, inputs in zip(samples.input_ids, samples.inputs, strict=True):
            model(input_ids=ids, **{**inputs, "pixel_values": inputs["pixel_values"].double()})
    hook.remove()
    assert len(seen) == 2
    return min(float(x.min()) for x in seen), max(float(x.max()) for x in seen)


@pytest.mark.parametrize("practice", ["qwen3_vl_4b_w8a8", "qwen3_vl_w8a8"])
def test_msmodelslim_qwen3_vl_practices_run_on_images(
    practice: str, qwen3_vl: Path, images: Path, tmp_path: Path
) -> None:
    """The practice (``dataset: calibImages`` found beside the YAML) quantizes the vision
    blocks' qkv / proj / fc1 with static W8A8 calibrated on the images, exports and verifies;
    the first of them (whose input no quantized linear computes) has the asymmetric range of the
    float64 forward: scale (max - min) / 255."""
    text = QWEN3_VL_4B_W8A8
    if practice == "qwen3_vl_w8a8":  # the same with quarot (block_size 32) first
        text = text.replace(
            "  process:\n", '  process:\n    - type: "quarot"\n      block_size: 32\n'
        )
    config = tmp_path / f"{practice}.yaml"
    config.write_text(text.replace("qwen3_vl_4b_w8a8", practice), encoding="utf-8")
    shutil.copytree(images, tmp_path / "calibImages")
    save = tmp_path / "out"
    result = msquant.quantize(qwen3_vl, save, config, progress=False)
    vision = [n for n in result.quantized_modules if n.startswith("model.visual.")]
    assert vision == [
        f"model.visual.blocks.{b}.{m}"
        for b in (0, 1)
        for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1")
    ]
    assert result.calibration_samples == 2
    out = exported(save)
    for name in vision:
        assert out[f"{name}.weight"].dtype == torch.int8
        assert out[f"{name}.input_scale"].shape == (1,)
    assert "model.visual.merger.linear_fc2.input_scale" not in out
    if practice == "qwen3_vl_4b_w8a8":  # no rotation: the first qkv sees the float forward
        low, high = first_linear_range(qwen3_vl, images, "model.visual.blocks.0.attn.qkv")
        expected = (max(high, 0.0) - min(low, 0.0)) / 255
        scale = float(out["model.visual.blocks.0.attn.qkv.input_scale"])
        assert scale == pytest.approx(expected, rel=1e-6)
        assert (
            float(out["model.visual.blocks.0.attn.qkv.input_offset"]) == round(-low / scale) - 128
        )
    report = msquant.verify_export(save, model_path=qwen3_vl)
    assert report.ok, report.errors


def test_image_calibration_needs_the_processor(images: Path, tmp_path: Path) -> None:
    model = build_tiny_vlm_with_processor(tmp_path / "model")
    for name in ("processor_config.json", "preprocessor_config.json"):
        (model / name).unlink()
    config = tmp_path / "c.yaml"
    config.write_text(QWEN3_VL_4B_W8A8, encoding="utf-8")
    shutil.copytree(images, tmp_path / "calibImages")
    with pytest.raises(
        msquant.CalibrationDataError, match="image calibration needs the model's processor"
    ):
        msquant.quantize(model, tmp_path / "x", config, progress=False)
    assert not (tmp_path / "x").exists()


def test_image_folder_with_an_index_is_refused(tmp_path: Path) -> None:
    folder = write_calibration_images(tmp_path / "imgs", count=1)
    (folder / "index.jsonl").write_text('{"image": "img0.png", "text": "hi"}\n')
    with pytest.raises(msquant.CalibrationDataError, match="index.jsonl: an index pairing"):
        read_image_folder(folder)
    with pytest.raises(msquant.CalibrationDataError, match="holds no image"):
        read_image_folder(tmp_path)


def test_calib_images_without_a_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(image_calibration, "msmodelslim_lab_calib", lambda: None)
    with pytest.raises(msquant.CalibrationDataError, match="put a folder of that name"):
        image_calibration.image_folder("calibImages", tmp_path)
    assert image_calibration.image_folder("calib.jsonl", tmp_path) is None
