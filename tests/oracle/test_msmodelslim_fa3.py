"""msModelSlim 26.1.0 as the oracle of ``fa3_quant`` (issue 25; opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same YAML (``fa3_quant``, then a W8A8_DYNAMIC ``linear_quant`` of
the attention, then ``ascendv1_saver``: a reduced copy of the DeepSeek-V3 ``w4a8c8`` practices) on
the same tiny float32 DeepSeek-V3 model and calibration file. msModelSlim's own ``deepseek_v3``
adapter needs an NPU and DeepSeek's remote code, so msModelSlim runs with the test adapter of
``fa3_adapter/`` (its default adapter plus the FA3 placeholders at the ``deepseek_v3`` adapter's
points, registered through msModelSlim's adapter entry points). The exports must hold the same
tensors with the same description, every tensor bit-identical: the ``FAQuant`` scales (recall
window, per-head int8 scale, float32 ``[heads, 1]``) and offsets, the attention's int8 linears.

The ``fp8_*`` cases are float8 e4m3 (``fp8_e4m3``): ``fp8_details`` is the entry of msModelSlim's
DeepSeek-V3.1-Terminus and Kimi-K2.6 ``c8`` practices (query per token, key and value per head),
``fp8_mx`` the whole ``deepseekv31_terminus_w8a8c8`` process (that entry, then MXFP8 linears);
their static scales are ``max |range| / 448`` with float32 zero offsets.

The shipped DeepSeek-V3 files put ``fa3_quant`` after the ``linear_quant`` entries: msModelSlim runs
each entry's forward after the entries before it finished the layer, so it observes the attention
through the fake-quantized linears; msquant does the same (``calibrates_after_previous``,
processors/fa3/processor.py). The ``after_*`` cases compare that order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402
from tiny_models import MLA_DEEPSEEK_V3  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
ADAPTER = Path(__file__).resolve().parent / "fa3_adapter"
MODEL_TYPE = "msquant-fa3-oracle"
#: The tiny DeepSeek-V3 (MLA with a query LoRA, dense MLPs in both layers).
MODEL: dict[str, object] = dict(arch="deepseek_v3", **MLA_DEEPSEEK_V3)
W8A8_DYNAMIC = {
    "act": {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"},
    "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"},
}
ATTENTION = {
    "type": "linear_quant",
    "qconfig": W8A8_DYNAMIC,
    "include": ["*self_attn*"],
    "exclude": ["*kv_b_proj"],
}
PER_TOKEN = {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"}
#: The shipped DeepSeek-V3 files' attention scheme: W8A8 static (asymmetric per-tensor activations).
ATTENTION_STATIC = {
    **ATTENTION,
    "qconfig": {
        "act": {"dtype": "int8", "scope": "per_tensor", "symmetric": False, "method": "minmax"},
        "weight": W8A8_DYNAMIC["weight"],
    },
}
FP8_PER_TOKEN = {**PER_TOKEN, "dtype": "fp8_e4m3"}
FP8_PER_HEAD = {**FP8_PER_TOKEN, "scope": "per_head"}
#: The DeepSeek-V3.1-Terminus / Kimi-K2.6 c8 practices' fa3_quant entry.
FP8_ENTRY = {
    "type": "fa3_quant",
    "details": {"fa_q": FP8_PER_TOKEN, "fa_k": FP8_PER_HEAD, "fa_v": FP8_PER_HEAD},
    "include": ["*"],
}
MXFP8 = {"scope": "per_block", "dtype": "mxfp8", "symmetric": True, "method": "minmax"}
#: deepseekv31_terminus_w8a8c8's linears: MXFP8 weights and activations, kv_b_proj float.
MX_LINEARS = {
    "type": "group",
    "configs": [
        {
            "type": "linear_quant",
            "qconfig": {"act": MXFP8, "weight": MXFP8},
            "include": ["*self_attn*", "*mlp*"],
            "exclude": ["*self_attn.kv_b_proj*"],
        }
    ],
}
CASES: dict[str, list[dict[str, Any]]] = {
    # the practices' entry: default qconfig (int8 per_head, static)
    "per_head": [{"type": "fa3_quant", "include": ["*"]}, ATTENTION],
    # a layer excluded: its attention keeps no FA3 record
    "per_head_exclude": [{"type": "fa3_quant", "exclude": ["model.layers.0.*"]}, ATTENTION],
    # the glm_5_1 practices' qconfig: dynamic, no tensor
    "per_token": [{"type": "fa3_quant", "qconfig": PER_TOKEN}, ATTENTION],
    # the shipped DeepSeek-V3 files' order: fa3_quant after the linear_quant of the attention
    "after_dynamic": [ATTENTION, {"type": "fa3_quant", "include": ["*"]}],
    "after_static": [ATTENTION_STATIC, {"type": "fa3_quant", "include": ["*"]}],
    # float8: every branch static, every branch dynamic, the practices' mix, the whole practice
    "fp8_per_head": [{"type": "fa3_quant", "qconfig": FP8_PER_HEAD}, ATTENTION],
    "fp8_per_token": [{"type": "fa3_quant", "qconfig": FP8_PER_TOKEN}, ATTENTION],
    "fp8_details": [FP8_ENTRY, ATTENTION],
    "fp8_mx": [FP8_ENTRY, MX_LINEARS],
}
#: FAQuant tensors per selected layer (scale and offset of each static branch).
STATIC_TENSORS = {"per_token": 0, "fp8_per_token": 0, "fp8_details": 4, "fp8_mx": 4}


def _model() -> Path:
    folder = CACHE / "models" / "deepseek_v3_fa3"
    if (folder / "config.json").is_file():
        return folder
    sys.path.insert(0, str(oracle.TESTS))
    from tiny_models import build_tiny_model

    params = dict(MODEL)
    return build_tiny_model(folder, params.pop("arch"), **params)


def _config(case: str) -> Path:
    dataset = oracle.write_calibration(CACHE / "calib-fa3.jsonl")
    config = {
        "apiversion": "modelslim_v1",
        "metadata": {"config_id": f"oracle-fa3-{case}"},
        "spec": {
            "process": CASES[case],
            "save": [{"type": "ascendv1_saver", "part_file_size": 0}],
            "dataset": str(dataset),
        },
    }
    path = CACHE / "configs" / f"fa3-{case}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _theirs(case: str) -> Path:
    venv = oracle.require_venv(VENV)
    save = CACHE / "exports" / f"deepseek_v3_fa3-{case}"
    if (save / "quant_model_description.json").is_file():
        return save
    save.mkdir(parents=True, exist_ok=True)
    log = save.parent / f"deepseek_v3_fa3-{case}.log"
    oracle.run_msmodelslim(venv, _model(), _config(case), save, log, MODEL_TYPE, ADAPTER)
    return save


def _compare(case: str, out: Path) -> list[str]:
    """Run msquant on ``case`` into ``out``; the names of the tensors that differ from
    msModelSlim's export (after checking that both hold the same names and descriptions)."""
    import msquant

    theirs_dir = _theirs(case)
    msquant.quantize(_model(), out, _config(case), progress=False)
    theirs = load_file(theirs_dir / "quant_model_weights.safetensors")
    ours = load_file(out / "quant_model_weights.safetensors")
    their_description = json.loads((theirs_dir / "quant_model_description.json").read_text())
    our_description = json.loads((out / "quant_model_description.json").read_text())

    assert sorted(ours) == sorted(theirs)
    assert our_description == their_description
    fa = sorted(name for name in theirs if ".fa_" in name)
    # fa_q / fa_k / fa_v scale and offset of each selected layer, those of the static branches
    assert len(fa) == STATIC_TENSORS.get(case, 6) * (1 if case == "per_head_exclude" else 2)
    return [
        name
        for name in sorted(theirs)
        if theirs[name].dtype != ours[name].dtype
        or theirs[name].shape != ours[name].shape
        or not torch.equal(theirs[name], ours[name])
    ]


@pytest.mark.parametrize("case", [case for case in CASES if case != "after_dynamic"])
def test_fa3_export_equals_msmodelslim(case: str, tmp_path: Path) -> None:
    """Bit-identical, ``fa3_quant`` before or after the (static) ``linear_quant``: after it, both
    observe the attention through the quantized linears, and feed the next layer that forward's
    outputs (its static input scales match too)."""
    assert _compare(case, tmp_path / "out") == []


def _per_column(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """msModelSlim 26.1.0's fake quantization of W8A8_DYNAMIC activations (``ir/w8a8_dynamic.py``,
    read from its source): one symmetric scale per input column over the tokens of the forward."""
    from msquant.quant.int_quant import compute_qparams, qrange

    qmin, qmax = qrange(bits)
    flat = x.reshape(-1, x.shape[-1]).float()
    scale, _ = compute_qparams(flat.amin(dim=0), flat.amax(dim=0), bits, True)
    codes = torch.clamp(torch.round(flat / scale), qmin, qmax)
    return (codes * scale).reshape(x.shape).to(x.dtype)


def test_fa3_after_dynamic_linears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fa3_quant`` after a W8A8_DYNAMIC ``linear_quant``: the FA scales differ (msModelSlim's
    fake-quantized W8A8_DYNAMIC linears take one activation scale per input column over the
    sample's tokens; msquant's, as the deployed kernel, one per token), every other tensor is
    identical; with msModelSlim's per-column rounding put in, every tensor is identical, so that
    rounding is the whole difference."""
    fa_scales = [
        f"model.layers.{i}.self_attn.{b}.scale" for i in (0, 1) for b in ("fa_k", "fa_q", "fa_v")
    ]
    assert _compare("after_dynamic", tmp_path / "per_token") == fa_scales
    import msquant.quant.activation as activation

    monkeypatch.setattr(activation, "fake_quantize_per_token", _per_column)
    assert _compare("after_dynamic", tmp_path / "per_column") == []


@pytest.mark.parametrize("case", [case for case in CASES if case.startswith("fp8_")])
def test_fa3_fp8_layout_is_msmodelslims(case: str) -> None:
    """msModelSlim's float8 records themselves (what the bit-identical comparison compares):
    float32 scales and float32 zero offsets, the FP8 ``quant_type`` strings, the global key."""
    theirs_dir = _theirs(case)
    theirs = load_file(theirs_dir / "quant_model_weights.safetensors")
    description = json.loads((theirs_dir / "quant_model_description.json").read_text())
    expected = {
        "fp8_per_head": "FP8",
        "fp8_per_token": "FP8_DYNAMIC",
        "fp8_details": "Q_FP8_DYNAMIC_KV_FP8",
        "fp8_mx": "Q_FP8_DYNAMIC_KV_FP8",
    }[case]
    assert description["model.layers.1.self_attn.quant_type"] == expected
    assert description.get("fa_quant_type") == (None if case == "fp8_per_token" else "FAKQuant")
    for name, tensor in theirs.items():
        if ".fa_" in name:
            assert tensor.dtype == torch.float32 and tensor.shape[1] == 1
            if name.endswith(".offset"):
                assert not tensor.any()
