"""msModelSlim 26.1.0 as the oracle of ``fa3_quant`` (issue 25; opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same YAML (``fa3_quant``, then a W8A8_DYNAMIC ``linear_quant`` of
the attention, then ``ascendv1_saver``: a reduced copy of the DeepSeek-V3 ``w4a8c8`` practices) on
the same tiny float32 DeepSeek-V3 model and calibration file. msModelSlim's own ``deepseek_v3``
adapter needs an NPU and DeepSeek's remote code, so msModelSlim runs with the test adapter of
``fa3_adapter/`` (its default adapter plus the FA3 placeholders at the ``deepseek_v3`` adapter's
points, registered through msModelSlim's adapter entry points). The exports must hold the same
tensors with the same description, every tensor bit-identical: the ``FAQuant`` scales (recall
window, per-head int8 scale, float32 ``[heads, 1]``) and offsets, the attention's int8 linears.

``fa3_quant`` comes first in these YAMLs: msModelSlim runs each entry with its own forward, so an
``fa3_quant`` after a calibrating ``linear_quant`` observes fake-quantized linears there, while
msquant observes the pass the entries share (processors/fa3/processor.py).
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
CASES: dict[str, list[dict[str, Any]]] = {
    # the practices' entry: default qconfig (int8 per_head, static)
    "per_head": [{"type": "fa3_quant", "include": ["*"]}, ATTENTION],
    # a layer excluded: its attention keeps no FA3 record
    "per_head_exclude": [{"type": "fa3_quant", "exclude": ["model.layers.0.*"]}, ATTENTION],
    # the glm_5_1 practices' qconfig: dynamic, no tensor
    "per_token": [{"type": "fa3_quant", "qconfig": PER_TOKEN}, ATTENTION],
}


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


@pytest.mark.parametrize("case", list(CASES))
def test_fa3_export_equals_msmodelslim(case: str, tmp_path: Path) -> None:
    import msquant

    theirs_dir = _theirs(case)
    msquant.quantize(_model(), tmp_path / "out", _config(case), progress=False)
    theirs = load_file(theirs_dir / "quant_model_weights.safetensors")
    ours = load_file(tmp_path / "out" / "quant_model_weights.safetensors")
    their_description = json.loads((theirs_dir / "quant_model_description.json").read_text())
    our_description = json.loads((tmp_path / "out" / "quant_model_description.json").read_text())

    assert sorted(ours) == sorted(theirs)
    fa = sorted(name for name in theirs if ".fa_" in name)
    if case == "per_token":
        assert fa == []
    else:  # fa_q / fa_k / fa_v scale and offset of each selected layer
        assert len(fa) == 6 * (2 if case == "per_head" else 1)
    different = [
        name
        for name in sorted(theirs)
        if theirs[name].dtype != ours[name].dtype
        or theirs[name].shape != ours[name].shape
        or not torch.equal(theirs[name], ours[name])
    ]
    assert different == []
    assert our_description == their_description
