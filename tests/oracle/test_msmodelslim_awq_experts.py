"""msModelSlim 26.1.0 as the oracle of ``flex_awq_ssz`` on routed MoE experts (issue 25; opt-in:
``pytest -m msmodelslim``).

msModelSlim's DeepSeek-V3.2 and GLM-5 / 5.1 W4A8 practices smooth each routed expert's
``up_proj -> down_proj`` pair. Their adapters (``deepseek_v3_2``, ``glm_5``) build the model from
msModelSlim's own modeling code and cannot run on tiny transformers models on a CPU, and under
transformers 5.x no msModelSlim adapter splits these families' fused experts. So msModelSlim runs
with the test adapter of ``moe_adapter/`` (its default adapter, the experts split one MLP per
expert, each getting its routed tokens in token order, and the up-down subgraphs the
``deepseek_v3_2`` / ``glm_5`` adapters name); msquant runs the same YAML on the same tiny float32
model (3 layers, the first dense, 8 routed experts and a shared one) under the ``--model_type``
those practices are made for (``DeepSeek-V3.2``, ``GLM-5``).

The exports hold the same tensors, bit-identical (every smoothed expert's int4 codes, scales and
``scale_bias``; the W8A8_DYNAMIC rest), and the same description, except the routers'
``e_score_correction_bias``: a buffer of transformers' router, which msModelSlim's saver does not
write and msquant writes (float), as the checkpoint holds it.
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
ARCHS = ["deepseek_v3_moe", "glm4_moe_moe"]
CASES = [
    "moe_w4a8",
    "flex_awq_ssz_experts-moe_w4a8",
    "flex_awq_ssz_updown-moe_w4a8",
    "flex_awq_ssz_experts_fixed-moe_w4a8",
]
#: What msquant writes and msModelSlim's saver leaves out (transformers' router buffer).
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


def _theirs(arch: str, scheme: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    venv = oracle.require_venv(VENV)
    return oracle.load_ascend_export(oracle.ensure_export(CACHE, venv, arch, scheme))


@pytest.mark.parametrize("scheme", CASES)
@pytest.mark.parametrize("arch", ARCHS)
def test_experts_export_equals_msmodelslim(arch: str, scheme: str, tmp_path: Path) -> None:
    theirs, their_description = _theirs(arch, scheme)
    oracle.msquant_export(CACHE, arch, scheme, tmp_path / "out")
    ours, our_description = oracle.load_ascend_export(tmp_path / "out")
    extra = {name for name in ours if name.endswith(ROUTER_BIAS)}
    assert extra and {our_description[name] for name in extra} == {"FLOAT"}
    assert {k: v for k, v in our_description.items() if k not in extra} == their_description
    assert {k: (t.dtype, t.shape) for k, t in ours.items() if k not in extra} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    differing = [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]
    assert differing == []


@pytest.mark.parametrize("arch", ARCHS)
def test_the_routed_experts_were_smoothed(arch: str) -> None:
    """The practices' entry changes the routed experts of the MoE layers and nothing else (the
    up-down entry's searched alpha may be 0 on the shared experts: GLM-4-MoE's are unchanged)."""
    plain, _ = _theirs(arch, "moe_w4a8")
    experts, _ = _theirs(arch, "flex_awq_ssz_experts-moe_w4a8")
    changed = {name for name in plain if not torch.equal(experts[name], plain[name])}
    assert changed and all(".mlp.experts." in name for name in changed)
    assert {name.split(".")[2] for name in changed} == {"1", "2"}
