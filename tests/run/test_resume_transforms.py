"""``--resume`` of runs whose processors transform float weights (smoothing, rotation).

A finished layer of such a run holds more than its quantized linears: norms divided by smoothing
scales or set to ones by a rotation, the biases of quantized linears (v_proj's after an ``ov``
fold), a norm bias ``smooth_quant`` added; quarot's setup rotated the embedding and the head; the
run's probe carries the hidden states entering the next layer; ``ctx.transforms`` holds the
fingerprints ``msquant verify`` checks. A run killed after layer k and resumed must end with the
uninterrupted run's export, byte for byte (``msquant_export.json`` included), and the same report
(the in-memory model's perplexity included, in a run that keeps the model in memory).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CALIB_TXT, CliResult
from rotation_helpers import randomize_norms
from run.test_dp_resume import _args, _run_group
from run.test_resume import _export, _killed_after
from safetensors.torch import load_file
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

import msquant
from msquant.run.checkpoint.layout import PROGRESS_FILE, partial_path

DYNAMIC = {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"}
STATIC = {"dtype": "int8", "scope": "per_tensor", "symmetric": False, "method": "minmax"}
WEIGHT = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
#: the transform and the activation scheme of each config (msModelSlim's practices)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "iter_smooth-W8A8_DYNAMIC": ({"type": "iter_smooth"}, DYNAMIC),
    "flex_smooth_quant-W8A8": ({"type": "flex_smooth_quant"}, STATIC),
    "smooth_quant-W8A8": ({"type": "smooth_quant"}, STATIC),
    "flex_awq_ssz-W8A8_DYNAMIC": (
        {"type": "flex_awq_ssz", "qconfig": {"act": DYNAMIC, "weight": WEIGHT}},
        DYNAMIC,
    ),
    "quarot-W8A8_DYNAMIC": ({"type": "quarot"}, DYNAMIC),
}
EVALUATION = {"eval_data": CALIB_TXT, "eval_seqlen": 16, "eval_max_samples": 2}


def _config(name: str, runner: str) -> dict[str, Any]:
    transform, act = CONFIGS[name]
    quant = {"type": "linear_quant", "qconfig": {"act": act, "weight": WEIGHT}}
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [transform, quant],
            "save": [{"type": "ascendv1_saver"}, {"type": "compressed_tensors"}],
        },
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Llama whose norms are not ones (folding and smoothing them matter)."""
    folder = build_tiny_model(tmp_path_factory.mktemp("norms_llama"), "llama", num_layers=3)
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    randomize_norms(loaded)
    loaded.save_pretrained(str(folder))
    return folder


def _quantize(model: Path, save: Path, config: Any, **kwargs: Any) -> msquant.QuantizeResult:
    options = {"calib_path": CALIB_TXT, "max_calib_tokens": 64, "progress": False, **kwargs}
    return msquant.quantize(model, save, config, **options)


@pytest.mark.parametrize(
    ("name", "runner", "after"),
    [
        ("iter_smooth-W8A8_DYNAMIC", "layer_wise", 0),
        ("iter_smooth-W8A8_DYNAMIC", "model_wise", 1),
        ("flex_smooth_quant-W8A8", "model_wise", 0),
        ("flex_smooth_quant-W8A8", "layer_wise", 1),
        ("smooth_quant-W8A8", "model_wise", 0),
        ("flex_awq_ssz-W8A8_DYNAMIC", "layer_wise", 1),
        ("quarot-W8A8_DYNAMIC", "layer_wise", 1),
        ("quarot-W8A8_DYNAMIC", "model_wise", 0),
        ("quarot-W8A8_DYNAMIC", "model_wise", None),
        ("iter_smooth-W8A8_DYNAMIC", "model_wise", None),
    ],
)
def test_transformed_run_resumes_to_the_uninterrupted_export(
    name: str,
    runner: str,
    after: int | None,
    model: Path,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    config = _config(name, runner)
    # in memory, the resumed run evaluates its own model: its restored float tensors must be
    # the transformed ones for the perplexity in the report to be the uninterrupted run's
    evaluation = EVALUATION if runner == "model_wise" else {}
    _quantize(model, tmp_path / "reference", config, **evaluation)
    save = tmp_path / "out"
    with _killed_after(after):
        _quantize(model, save, config, **evaluation)
    progress = json.loads((partial_path(save) / PROGRESS_FILE).read_text())
    assert progress["stage"] == ("finished" if after is None else "layers")

    _quantize(model, save, config, resume=True, **evaluation)

    expected, got = _export(tmp_path / "reference"), _export(save)
    assert sorted(got) == sorted(expected)
    for file, data in expected.items():
        assert got[file] == data, f"{file} differs from the uninterrupted run's"
    marker = json.loads((save / "msquant_export.json").read_text())
    layer_norms = [t for t in marker["transforms"]["tensors"] if t.startswith("model.layers.")]
    assert {t.split(".")[2] for t in layer_norms} == {"0", "1", "2"}  # every layer's, kept
    if runner == "model_wise":
        assert json.loads((save / "quant_report.json").read_text())["evaluation"]["ppl"] > 0
    verified = run_cli("verify", save, "--model_path", model)
    assert verified.code == 0, verified.err
    assert not partial_path(save).exists()


def test_the_checkpoint_keeps_the_transformed_float_tensors(model: Path, tmp_path: Path) -> None:
    """The layer store of a smoothed run that keeps the model in memory holds the layer's
    smoothed norms (and smooth_quant's added norm bias) beside its quantized linears, as the
    export stores them; a streamed run's holds its quantized linears alone (its finished layers
    are released, their tensors in the export files already)."""
    streamed = tmp_path / "streamed"
    with _killed_after(0):
        _quantize(model, streamed, _config("smooth_quant-W8A8", "layer_wise"))
    stored = load_file(partial_path(streamed) / "layers" / "00000.safetensors")
    assert not [name for name in stored if "layernorm" in name]
    config = _config("smooth_quant-W8A8", "model_wise")
    save = tmp_path / "out"
    with _killed_after(0):
        _quantize(model, save, config)
    stored = load_file(partial_path(save) / "layers" / "00000.safetensors")
    norm = "model.layers.0.input_layernorm"
    assert {f"{norm}.weight", f"{norm}.bias"} <= set(stored)
    original = load_file(model / "model.safetensors")[f"{norm}.weight"]
    assert not torch.equal(stored[f"{norm}.weight"], original)  # divided by the scales
    _quantize(model, save, config, resume=True)
    exported = load_file(save / "ascendv1_saver" / "quant_model_weights-00001-of-00001.safetensors")
    assert torch.equal(exported[f"{norm}.weight"], stored[f"{norm}.weight"])


def test_resume_refuses_a_setup_that_derives_another_transform(model: Path, tmp_path: Path) -> None:
    """quarot's rotated embedding and head are not checkpointed: the resumed run's setup derives
    them again, and must derive what the interrupted run's did (its fingerprints are compared
    with the checkpoint's; here the checkpoint's is changed, as another rotation would)."""
    config = _config("quarot-W8A8_DYNAMIC", "model_wise")
    save = tmp_path / "out"
    with _killed_after(0):
        _quantize(model, save, config)
    path = partial_path(save) / PROGRESS_FILE
    progress = json.loads(path.read_text())
    recorded = progress["transforms"]["tensors"]["model.embed_tokens.weight"]
    assert recorded["by"] == "quarot"
    recorded["sha256"] = "0" * 64
    path.write_text(json.dumps(progress))
    with pytest.raises(msquant.ResumeError, match=r"did not derive again .*\(model\.embed_tokens"):
        _quantize(model, save, config, resume=True)
    assert path.is_file()  # refused: the work is kept


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_rotated_group_of_two_processes_resumes(model: Path, tmp_path: Path) -> None:
    """quarot in a ``dp_layer_wise`` group (``--nproc 2``, here forked as torchrun starts it):
    both processes killed after layer 0's checkpoint, the group resumes to the uninterrupted
    group's export; every process takes up its own probe (each runs the rotation's checks)."""
    config = _config("quarot-W8A8_DYNAMIC", "dp_layer_wise")
    config_path = tmp_path / "config.json"  # JSON is valid YAML
    config_path.write_text(json.dumps(config))
    uninterrupted, save = tmp_path / "uninterrupted" / "out", tmp_path / "resumed" / "out"
    assert _run_group(_args(model, uninterrupted, config_path)) == [0, 0]
    assert _run_group(_args(model, save, config_path), die_after={0: 0, 1: 0}) == [9, 9]
    progress = json.loads((partial_path(save) / PROGRESS_FILE).read_text())
    assert [entry["hidden"]["probe"] for entry in progress["ranks"]] == [True, True]

    assert _run_group(_args(model, save, config_path, "--resume")) == [0, 0]

    expected, got = _export(uninterrupted), _export(save)
    assert sorted(got) == sorted(expected)
    for file, data in expected.items():
        assert got[file] == data, f"{file} differs from the uninterrupted group's"
    assert not partial_path(save).exists()
