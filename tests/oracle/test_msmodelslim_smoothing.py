"""msModelSlim 26.1.0 as the oracle of the smoothing processors (opt-in: ``pytest -m msmodelslim``).

msModelSlim and msquant run the same YAML (a smoothing processor, then ``linear_quant`` with
W8A8_DYNAMIC or W8A8 static asymmetric activations, then ``ascendv1_saver``) on the same tiny
float32 model and calibration file (:mod:`msmodelslim_run`); the two exports must hold the same
tensors under the same names with the same description, every tensor bit-identical (the smoothed
norms and linears, the int8 weight codes and scales, the static activation ranges, ``deq_scale``
and ``quant_bias``).

Which subgraphs are smoothed depends on msModelSlim's model adapter: its Qwen3 adapter
(``--model_type Qwen3-8B``, arch ``qwen3_adapter``) names all of norm -> q/k/v, norm -> gate/up,
v -> o and up -> down, as msquant's default adapter does; its default adapter (Llama, Qwen2 here)
finds the norm -> linears subgraphs only. msquant runs with the same ``model_type``, which
restricts it the same way; these cases also write ``enable_subgraph_type: [norm-linear]`` (the
``*_norm`` smoothings) or use ``smooth_quant``, and tests/oracle/test_msmodelslim_semantics.py
runs YAMLs that enable every type under ``default``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))
CASES = [
    *(
        ("qwen3_adapter", f"{smoothing}-w8a8_dynamic")
        for smoothing in ("iter_smooth", "flex_smooth", "flex_smooth_fixed", "smooth_quant")
    ),
    ("qwen3_adapter", "iter_smooth-w8a8_asym"),
    ("qwen3_adapter", "flex_smooth-w8a8_asym"),
    *(
        (arch, scheme)
        for arch in ("llama", "qwen2")
        for scheme in (
            "iter_smooth_norm-w8a8_dynamic",
            "flex_smooth_norm-w8a8_dynamic",
            "iter_smooth_norm-w8a8_asym",
            "smooth_quant-w8a8_asym",
        )
    ),
    ("llama", "smooth_quant-w8a8_dynamic"),
]


def _venv() -> Path:
    return oracle.require_venv(VENV)


def _load(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return oracle.load_ascend_export(folder)


@pytest.mark.parametrize(("arch", "scheme"), CASES)
def test_smoothed_export_equals_msmodelslim(arch: str, scheme: str, tmp_path: Path) -> None:
    import msquant

    theirs, their_description = _load(oracle.ensure_export(CACHE, _venv(), arch, scheme))
    save = tmp_path / "out"
    msquant.quantize(
        CACHE / "models" / arch,
        save,
        CACHE / "configs" / f"{scheme}.yaml",
        progress=False,
        model_type=str(oracle.ARCHS[arch].get("model_type", "default")),
    )
    ours, our_description = _load(save)
    assert our_description == their_description
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    differing = [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]
    assert differing == []
    # the smoothing did happen: the norms differ from the float model's
    original = load_file(str(CACHE / "models" / arch / "model.safetensors"))
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(ours[norm], original[norm])
