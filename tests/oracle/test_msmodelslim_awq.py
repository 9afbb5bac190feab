"""msModelSlim 26.1.0 as the oracle of ``flex_awq_ssz`` (issue 25; opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same YAML (``flex_awq_ssz`` with the W4A8 best practices'
``qconfig``, then ``linear_quant``, then ``ascendv1_saver``) on the same tiny float32 Qwen3 model,
through msModelSlim's Qwen3 adapter (``--model_type Qwen3-8B``: norm-linear, ov and up-down
subgraphs) and the same calibration file (:mod:`msmodelslim_run`). The exports must hold the
same tensors under the same names with the same description, every tensor bit-identical: the
smoothed norms (float), the int4 / int8 codes and scales of the smoothed linears. A searched
``alpha`` that differed from msModelSlim's in any subgraph would change them.

The cases: ``alpha`` searched on every subgraph type, ``alpha`` given, the shipped practices'
entry (up-down only, a layer excluded), and int8 ``minmax`` weights in the search.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
ARCH = "qwen3_adapter"
CASES = [
    "flex_awq_ssz-w4a8_dynamic_ssz",
    "flex_awq_ssz_fixed-w4a8_dynamic_ssz",
    "flex_awq_ssz_updown-w4a8_dynamic_ssz",
    "flex_awq_minmax-w8a8_dynamic",
]


def _export(scheme: str, save: Path) -> None:
    oracle.msquant_export(CACHE, ARCH, scheme, save)


@pytest.mark.parametrize("scheme", CASES)
def test_flex_awq_ssz_export_equals_msmodelslim(scheme: str, tmp_path: Path) -> None:
    venv = oracle.require_venv(VENV)
    theirs, their_description = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, scheme)
    )
    _export(scheme, tmp_path / "out")
    ours, our_description = oracle.load_ascend_export(tmp_path / "out")
    assert our_description == their_description
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    differing = [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]
    assert differing == []


def test_smoothing_happened() -> None:
    """The searched entry changes the model (some searched ``alpha`` is above 0): its export
    differs from the plain W4A8_DYNAMIC ssz one in the smoothed norms and linears."""
    venv = oracle.require_venv(VENV)
    smoothed, _ = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, "flex_awq_ssz-w4a8_dynamic_ssz")
    )
    plain, _ = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, "w4a8_dynamic_ssz")
    )
    changed = {name for name in plain if not torch.equal(smoothed[name], plain[name])}
    assert "model.layers.0.input_layernorm.weight" in changed
    assert any(name.endswith("down_proj.weight") for name in changed)


def test_updown_entry_leaves_the_rest_alone() -> None:
    """The shipped practices' entry (up-down only, ``model.layers.0.*`` excluded) changes no norm,
    no attention weight and nothing of layer 0."""
    venv = oracle.require_venv(VENV)
    smoothed, _ = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, "flex_awq_ssz_updown-w4a8_dynamic_ssz")
    )
    plain, _ = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, "w4a8_dynamic_ssz")
    )
    original = load_file(str(CACHE / "models" / ARCH / "model.safetensors"))
    changed = {name for name in plain if not torch.equal(smoothed[name], plain[name])}
    assert all(".mlp.up_proj." in n or ".mlp.down_proj." in n for n in changed), changed
    assert not any(n.startswith("model.layers.0.") for n in changed), changed
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert torch.equal(smoothed[norm].float(), original[norm].float())
