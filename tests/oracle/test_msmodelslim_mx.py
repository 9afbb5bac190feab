"""msModelSlim 26.1.0 as the oracle of the MX schemes (issue 26; opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same ``linear_quant`` entries (``per_block`` ``mxfp8`` /
``mxfp4`` weights and activations, ``ext.axes: -1``, as the shipped MXFP practices write them;
:data:`msmodelslim_run.MX_SCHEMES`) with the ``ascendv1_saver`` on the tiny float32 Qwen3 and the
tiny bfloat16 Llama; the exports are compared tensor by tensor (bit-identical, float8 compared by
its bytes) and the descriptions are equal. msModelSlim's MX path runs on CPU (no NPU op).
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
    *(("qwen3", scheme) for scheme in oracle.MX_SCHEMES),
    ("llama_bf16", "w8a8_mxfp8"),
    ("llama_bf16", "w4a4_mxfp4"),
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize(("arch", "scheme"), CASES)
def test_mx_export_equals_msmodelslim(arch: str, scheme: str, tmp_path: Path) -> None:
    venv = oracle.require_venv(VENV)
    theirs, their_description = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, arch, scheme)
    )
    ours, our_description = oracle.load_ascend_export(
        oracle.msquant_export(CACHE, arch, scheme, tmp_path / "out")
    )
    assert our_description == their_description
    assert their_description["model_quant_type"] == oracle.MX_SCHEMES[scheme].quant_type
    assert their_description["group_size"] == 32
    assert sorted(ours) == sorted(theirs)
    typed = [name for name, kind in their_description.items() if kind in oracle.MX_QUANT_TYPES]
    assert typed
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(_bits(ours[name]), _bits(tensor)), name
