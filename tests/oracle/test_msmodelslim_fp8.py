"""msModelSlim 26.1.0 as the oracle of W8A8 fp8 (issue 26; opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same ``linear_quant`` entries (``fp8_e4m3`` ``per_channel``
weights, ``fp8_e4m3`` ``per_token`` activations, :data:`msmodelslim_run.FP8_SCHEMES`) with the
``ascendv1_saver`` on the tiny float32 Qwen3 and the tiny bfloat16 Llama; the exports are compared
tensor by tensor (bit-identical, float8 compared by its bytes) and the descriptions are equal
(type ``WFP8AFP8_DYNAMIC``). msModelSlim's FP8 path is plain torch and runs on CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
CASES = [
    *(("qwen3", scheme) for scheme in oracle.FP8_SCHEMES),
    ("llama_bf16", "w8a8_fp8"),
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize(("arch", "scheme"), CASES)
def test_fp8_export_equals_msmodelslim(arch: str, scheme: str, tmp_path: Path) -> None:
    venv = oracle.require_venv(VENV)
    theirs, their_description = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, arch, scheme)
    )
    ours, our_description = oracle.load_ascend_export(
        oracle.msquant_export(CACHE, arch, scheme, tmp_path / "out")
    )
    assert our_description == their_description
    assert their_description["model_quant_type"] == "WFP8AFP8_DYNAMIC"
    assert sorted(ours) == sorted(theirs)
    typed = [name for name, kind in their_description.items() if kind == "WFP8AFP8_DYNAMIC"]
    assert typed
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(_bits(ours[name]), _bits(tensor)), name
