"""msModelSlim 26.1.0 as the oracle of ``dynamic_cache`` (C8) and ``pd_mix`` (W8A8_MIX), issue 25
(opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same reduced YAMLs (W8A8_DYNAMIC + ``dynamic_cache``; ``pd_mix``;
both) on the tiny float32 Qwen3 through msModelSlim's Qwen3 adapter. Established here:

* the description is identical, and so are the tensor names, dtypes and shapes (``C8`` tensors
  float32 ``[kv_heads * head_dim]``; ``W8A8_MIX`` layers with W8A8's tensors plus
  ``weight_scale`` / ``weight_offset``); every tensor that depends only on the weights is
  bit-identical;
* what depends on calibration activations differs, for two reasons stated in
  ``processors/dynamic_cache.py``: msModelSlim keeps the last sample's KV range only (its
  per-channel observer restarts every forward), and its fake-quantized W8A8_DYNAMIC / W8A8_MIX
  linears round each input *column* over the sample's tokens, where msquant (and the deployed
  kernels) round each token. With one calibration sample the KV scales agree within 1 %; with
  twelve, msModelSlim's equal the ones it computes on the last sample alone (bit for bit), while
  msquant's cover every sample (never smaller).
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
ARCH = "qwen3_adapter"
#: Tensors computed from calibration activations (the rest depends on the weights alone).
CALIBRATED = ("kv_cache_scale", "input_scale", "input_offset", "deq_scale", "quant_bias")


def _both(scheme: str, save: Path) -> tuple[dict, dict, dict, dict]:
    venv = oracle.require_venv(VENV)
    theirs, their_description = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, scheme)
    )
    ours, our_description = oracle.load_ascend_export(
        oracle.msquant_export(CACHE, ARCH, scheme, save)
    )
    return theirs, their_description, ours, our_description


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / a.double().abs().max())


@pytest.mark.parametrize("scheme", ["w8a8_dynamic_c8_last", "pd_mix", "pd_mix_c8"])
def test_export_layout_equals_msmodelslim(scheme: str, tmp_path: Path) -> None:
    theirs, their_description, ours, our_description = _both(scheme, tmp_path / "out")
    assert our_description == their_description
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    differing = {k for k in theirs if not torch.equal(ours[k], theirs[k])}
    assert all(k.rpartition(".")[2] in CALIBRATED for k in differing), differing
    # the first linears of layer 0 see the same (float) inputs in both
    for name in ("q_proj", "k_proj", "v_proj"):
        assert not any(
            k.startswith(f"model.layers.0.self_attn.{name}.") and "kv_cache" not in k
            for k in differing
        )
    for key in differing:
        if key.endswith(("kv_cache_scale", "input_scale", "deq_scale")):
            assert _relative(theirs[key], ours[key]) < 0.02, key
    kv = [k for k in ours if "kv_cache" in k]
    assert len(kv) == (8 if scheme != "pd_mix" else 0)
    assert all(not ours[k].any() for k in kv if k.endswith("offset"))


def test_msmodelslim_keeps_the_last_samples_kv_range(tmp_path: Path) -> None:
    """Calibrated on twelve samples, msModelSlim's KV scales are those of its run on the last
    sample alone; msquant's take every sample (so they are never smaller than its own on the
    last sample)."""
    venv = oracle.require_venv(VENV)
    all_samples, _ = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, "w8a8_dynamic_c8")
    )
    last, _ = oracle.load_ascend_export(
        oracle.ensure_export(CACHE, venv, ARCH, "w8a8_dynamic_c8_last")
    )
    kv = [k for k in all_samples if k.endswith("kv_cache_scale")]
    assert len(kv) == 4 and all(torch.equal(all_samples[k], last[k]) for k in kv)
    _, _, ours_all, _ = _both("w8a8_dynamic_c8", tmp_path / "all")
    _, _, ours_last, _ = _both("w8a8_dynamic_c8_last", tmp_path / "last")
    assert all(bool((ours_all[k] >= ours_last[k]).all()) for k in kv)
    assert any(not torch.equal(ours_all[k], ours_last[k]) for k in kv)
