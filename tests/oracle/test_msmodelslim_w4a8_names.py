"""msModelSlim 26.1.0 as the oracle of W4A8_DYNAMIC ``scale_bias`` on linears of every name
(issue 25; opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same YAML (W4A8_DYNAMIC, int4 ``ssz`` weights, on the attention
linears, then on every linear) on the tiny DeepSeek-V3 (MLA: ``q_a_proj``, ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; routed experts through the test adapter of
``moe_adapter/``) and the tiny Qwen3 (``q_proj`` ... ``o_proj``).

Every int4 code, ``weight_scale`` and ``weight_offset`` is bit-identical, and so is every
``scale_bias`` but those of DeepSeek's four MLA projections. There msModelSlim's saver does not
write ``scale_bias`` at all: it decides by substrings of the module's name (``up_proj``,
``gate_proj``, ``q_proj``, ``k_proj``, ``v_proj``: 8 times the row sums, ``[out, 1]``;
``down_proj``, ``o_proj``: 16 slices, ``[out, 16]``), and any other name gets the dequantized
weight itself, ``[out, in]``, neither summed nor multiplied by 8. msquant writes the ``[out, 1]``
tensor the W4A8 kernels' int4 offset correction needs (a column-parallel layer's, the shape
vLLM-Ascend creates for it), which is exactly ``8 * theirs.sum(dim=1)``, bit for bit. The
test asserts that relation, so a change on either side shows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

from msquant.quant.w8a8_params import unpack_int4_rows  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
#: The linears whose names msModelSlim's ``scale_bias`` rule does not know (DeepSeek's MLA).
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
#: What msquant writes and msModelSlim's saver leaves out (transformers' router buffer).
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"
CASES = [
    (arch, scheme) for arch in ("deepseek_v3_moe", "qwen3") for scheme in oracle.W4A8_NAME_SCHEMES
]


@pytest.mark.parametrize(("arch", "scheme"), CASES)
def test_w4a8_scale_bias_by_name(arch: str, scheme: str, tmp_path: Path) -> None:
    venv = oracle.require_venv(VENV)
    theirs, their_description = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, arch, scheme)
    )
    oracle.msquant_export(CACHE, arch, scheme, tmp_path / "out")
    ours, our_description = oracle.load_ascend_export(tmp_path / "out")

    extra = {name for name in ours if name.endswith(ROUTER_BIAS)}
    assert set(ours) - extra == set(theirs)
    assert {k: v for k, v in our_description.items() if k not in extra} == their_description
    differing = sorted(
        name
        for name in theirs
        if ours[name].shape != theirs[name].shape or not torch.equal(ours[name], theirs[name])
    )
    expected = sorted(
        name for name in theirs if name.endswith(".scale_bias") and name.split(".")[-2] in MLA
    )
    assert differing == expected
    assert bool(expected) == (arch == "deepseek_v3_moe")
    for name in expected:
        prefix = name.removesuffix(".scale_bias")
        codes = unpack_int4_rows(ours[f"{prefix}.weight"]).to(torch.float32)
        dequantized = codes * ours[f"{prefix}.weight_scale"]
        assert torch.equal(theirs[name], dequantized), name  # [out, in]: the weight itself
        assert ours[name].shape == (codes.shape[0], 1)
        assert torch.equal(ours[name], 8.0 * theirs[name].sum(dim=1, keepdim=True)), name
