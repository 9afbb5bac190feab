"""Same YAML, same meaning as msModelSlim 26.1.0 (issue 23; opt-in: ``pytest -m msmodelslim``).

msModelSlim runs each YAML through its CLI (:mod:`msmodelslim_run`, ``--model_type`` of the tiny
model's arch); msquant runs the same file with ``model_type`` set to the same name:

* ``spec.prior``: msModelSlim reloads the weights after a prior stage, so an ``iter_smooth``
  there changes nothing; msquant does not run the stage: both exports are the plain W8A8_DYNAMIC
  one.
* ``group``: smoothing processors alone in a group smooth (bit-identical); beside
  ``linear_quant`` msModelSlim skips the smoothing, and msquant refuses the group.
* ``--model_type``: the subgraph types smoothed are those msModelSlim's adapter gives the
  processor (``default``: norm-linear only, though the YAML enables every type; QwQ's adapter:
  norm-linear and up-down for ``iter_smooth``, norm-linear for ``flex_smooth_quant``).
* bf16: a searched ``flex_smooth_quant`` smooths bit-identically (the same alpha / beta); the
  int8 weights then differ as bf16 ``linear_quant`` exports do (msModelSlim's scales computed in
  bf16, msquant's in float32).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
#: (arch, scheme) whose msquant export must equal msModelSlim's bit for bit.
IDENTICAL = [
    ("qwen3_adapter", "prior_iter_smooth-w8a8_dynamic"),
    ("qwen3_adapter", "group_iter_smooth-w8a8_dynamic"),
    ("qwen3_adapter", "group_iter_flex-w8a8_dynamic"),
    ("llama", "iter_smooth-w8a8_dynamic"),
    ("llama", "flex_smooth-w8a8_dynamic"),
    ("qwen2", "iter_smooth-w8a8_asym"),
    ("qwen2_qwq", "iter_smooth-w8a8_dynamic"),
    ("qwen2_qwq", "flex_smooth-w8a8_dynamic"),
]


def _venv() -> Path:
    return oracle.require_venv(VENV)


def _load(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return oracle.load_ascend_export(folder)


def _model_type(arch: str) -> str:
    return str(oracle.ARCHS[arch].get("model_type", "default"))


def _ours(arch: str, scheme: str, save: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import msquant

    msquant.quantize(
        CACHE / "models" / arch,
        save,
        CACHE / "configs" / f"{scheme}.yaml",
        progress=False,
        model_type=_model_type(arch),
    )
    return _load(save)


def _differing(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    return [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]


@pytest.mark.parametrize(("arch", "scheme"), IDENTICAL)
def test_export_equals_msmodelslim(arch: str, scheme: str, tmp_path: Path) -> None:
    theirs, their_description = _load(oracle.ensure_export(CACHE, _venv(), arch, scheme))
    ours, our_description = _ours(arch, scheme, tmp_path / "out")
    assert our_description == their_description
    assert _differing(ours, theirs) == []


def test_a_prior_stage_changes_nothing_in_either_export(tmp_path: Path) -> None:
    arch = "qwen3_adapter"
    prior, _ = _load(oracle.ensure_export(CACHE, _venv(), arch, "prior_iter_smooth-w8a8_dynamic"))
    plain, _ = _load(oracle.ensure_export(CACHE, _venv(), arch, "w8a8_dynamic"))
    assert _differing(prior, plain) == []  # msModelSlim discarded the prior stage's smoothing


@pytest.mark.parametrize("arch", ["qwen3_adapter", "llama"])
def test_smoothing_beside_linear_quant_in_a_group(arch: str, tmp_path: Path) -> None:
    """msModelSlim exports the unsmoothed model; msquant refuses the group, naming why."""
    import msquant

    scheme = "group_iter_smooth_linear_quant-w8a8_dynamic"
    grouped, _ = _load(oracle.ensure_export(CACHE, _venv(), arch, scheme))
    plain, _ = _load(oracle.ensure_export(CACHE, _venv(), arch, "w8a8_dynamic"))
    assert _differing(grouped, plain) == []
    with pytest.raises(msquant.QuantizationError, match="msModelSlim 26.1.0 smooths nothing"):
        _ours(arch, scheme, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_model_type_decides_the_subgraph_types(tmp_path: Path) -> None:
    """The same YAML (every type enabled) smooths up-down under QwQ's adapter and not under
    ``default``; both exports are the ones msModelSlim writes (test_export_equals_msmodelslim)."""
    down = "model.layers.0.mlp.down_proj.weight"
    qwq, _ = _load(oracle.ensure_export(CACHE, _venv(), "qwen2_qwq", "iter_smooth-w8a8_dynamic"))
    qwq_plain, _ = _load(oracle.ensure_export(CACHE, _venv(), "qwen2_qwq", "w8a8_dynamic"))
    assert not torch.equal(qwq[down], qwq_plain[down])
    default, _ = _load(oracle.ensure_export(CACHE, _venv(), "llama", "iter_smooth-w8a8_dynamic"))
    default_plain, _ = _load(oracle.ensure_export(CACHE, _venv(), "llama", "w8a8_dynamic"))
    assert torch.equal(default[down], default_plain[down])
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(default[norm], default_plain[norm])


@pytest.mark.parametrize("arch", ["qwen3_bf16_adapter", "llama_bf16"])
def test_bf16_searched_flex_smooth_quant(arch: str, tmp_path: Path) -> None:
    """bf16: the smoothed norms, embeddings and head are bit-identical (the search picks
    msModelSlim's alpha / beta); the int8 weights differ as a bf16 linear_quant export does:
    at least 85 % of each tensor's codes equal, the others one step apart, weight scales within
    one bf16 rounding (2^-8)."""
    scheme = "flex_smooth-w8a8_dynamic"
    theirs, their_description = _load(oracle.ensure_export(CACHE, _venv(), arch, scheme))
    ours, our_description = _ours(arch, scheme, tmp_path / "out")
    assert our_description == their_description
    differing = _differing(ours, theirs)
    assert differing
    assert [n for n in differing if not n.endswith((".weight", ".weight_scale"))] == []
    for name in differing:
        mine, reference = ours[name], theirs[name]
        if mine.dtype == torch.int8:
            assert (mine == reference).float().mean() >= 0.85, name
            assert (mine.int() - reference.int()).abs().max() <= 1, name
        elif name.endswith(".weight_scale"):
            relative = ((mine - reference).abs() / reference.abs()).max()
            assert relative <= 2**-8, name
        else:
            pytest.fail(f"{name} ({mine.dtype}) differs: the smoothing itself differs")
