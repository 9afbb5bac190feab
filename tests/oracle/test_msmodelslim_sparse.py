"""msModelSlim 26.1.0 as the oracle of ``float_sparse`` (W16A16S), issue 25 (opt-in:
``pytest -m msmodelslim``).

msModelSlim and msquant run ``qwen3-32b-dense-w16a16s.yaml``'s entry (``float_sparse``,
``sparse_ratio: 0.4``, ``include: ["*"]``) with the ``ascendv1_saver`` on the tiny Qwen3
(float32 and bfloat16, through msModelSlim's Qwen3 adapter) and the tiny Qwen2 (q/k/v biases,
typed W16A16S too; msModelSlim's default adapter); the exports are compared tensor by tensor.
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
SCHEME = "float_sparse"


@pytest.mark.parametrize("arch", ["qwen3_adapter", "qwen3_bf16_adapter", "qwen2"])
def test_w16a16s_export_equals_msmodelslim(arch: str, tmp_path: Path) -> None:
    venv = oracle.require_venv(VENV)
    theirs, their_description = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, arch, SCHEME)
    )
    ours, our_description = oracle.load_ascend_export(
        oracle.msquant_export(CACHE, arch, SCHEME, tmp_path / "out")
    )
    assert our_description == their_description
    assert their_description["model_quant_type"] == "W16A16S"
    assert sorted(ours) == sorted(theirs)
    sparse = [k for k, kind in their_description.items() if kind == "W16A16S"]
    assert sparse
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name
