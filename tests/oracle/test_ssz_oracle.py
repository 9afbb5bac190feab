"""msModelSlim 26.1.0 as the oracle of ``method: ssz`` (opt-in: ``pytest -m msmodelslim``).

* msModelSlim's own ``ssz`` quantizer (run by ``msmodelslim_ssz_probe.py`` in its interpreter) on
  random, heavy-tailed and edge-case weights (a zero row, an outlier, a tiny row; default and
  explicit ``step``): the same codes and scales as msquant's, bit for bit;
* whole runs, ``msmodelslim quant`` and ``msquant.quantize`` with the same YAML on the tiny float32
  Llama / Qwen2 / Qwen3 models (W8A16, W8A8_DYNAMIC and W4A8_DYNAMIC with ``method: ssz``): every
  tensor of the two Ascend exports bit-identical and the description files equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import msmodelslim_run as oracle  # noqa: E402

from msquant.processors.methods.ssz_search import ssz_codes, ssz_scales  # noqa: E402

pytestmark = pytest.mark.msmodelslim

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))


def _venv() -> Path:
    if not (VENV / "bin" / "python").is_file():
        pytest.skip(f"no msModelSlim environment at {VENV} (scripts/msmodelslim_env.sh)")
    return VENV


def _probe_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    edge = torch.randn(8, 32, generator=g)
    edge[0] = 0.0
    edge[1, 3] = 25.0
    edge[2] *= 1e-3
    heavy = torch.distributions.StudentT(2.0).sample((12, 48))
    return {
        "int8_0_gauss": torch.randn(32, 64, generator=g),
        "int4_0_gauss": torch.randn(32, 64, generator=g),
        "int4_10_gauss": torch.randn(32, 64, generator=g),
        "int8_0_edge": edge,
        "int4_0_edge": edge.clone(),
        "int4_3_heavy": heavy,
        "int8_1_heavy": heavy.clone(),
    }


def test_ssz_quantizer_equals_msmodelslims(tmp_path: Path) -> None:
    weights = _probe_weights()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "in.safetensors"))
    subprocess.run(
        [str(_venv() / "bin" / "python"), str(HERE / "msmodelslim_ssz_probe.py"),
         str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")],
        check=True, capture_output=True, timeout=600, env={**os.environ, **oracle.THREAD_ENV},
    )  # fmt: skip
    theirs = load_file(str(tmp_path / "out.safetensors"))
    for name, weight in weights.items():
        bits = int(name.split("_")[0][3:])
        steps = int(name.split("_")[1]) or 50
        scale = ssz_scales(weight, bits, steps)
        codes = ssz_codes(weight.t(), scale, bits).t().to(torch.int8)
        assert torch.equal(scale, theirs[f"{name}.scale"]), name
        assert torch.equal(codes, theirs[f"{name}.codes"]), name
        assert not theirs[f"{name}.offset"].any(), name


def _up_down_only(scheme: str) -> bool:
    """Whether the scheme's flex_awq_ssz entry smooths up-down subgraphs only."""
    entry = oracle.AWQ_SMOOTHINGS.get(scheme.split("-")[0])
    return entry is not None and entry.get("enable_subgraph_type") == ["up-down"]


#: Every ssz scheme, and the flex_awq_ssz ones, on the three dense archs (msModelSlim's default
#: adapter). The up-down-only flex_awq_ssz entries are left out here: under the default adapter
#: msModelSlim smooths nothing with them and msquant refuses them saying so
#: (tests/processors/test_smoothing_model_type.py); tests/oracle/test_msmodelslim_awq.py runs the
#: dense one through msModelSlim's Qwen3 adapter, which smooths up-down, and
#: tests/oracle/test_msmodelslim_awq_experts.py the routed experts' one on MoE models.
CASES = [
    (arch, scheme)
    for arch in ("llama", "qwen2", "qwen3")
    for scheme in oracle.SSZ_SCHEMES
    if not _up_down_only(scheme)
]


@pytest.mark.parametrize(("arch", "scheme"), CASES)
def test_ssz_export_equals_msmodelslims(arch: str, scheme: str, tmp_path: Path) -> None:
    theirs_dir = oracle.ensure_export(CACHE, _venv(), arch, scheme)
    save = oracle.msquant_export(CACHE, arch, scheme, tmp_path / "out")
    ours = load_file(str(save / "quant_model_weights.safetensors"))
    theirs = load_file(str(theirs_dir / "quant_model_weights.safetensors"))
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {
        k: (t.dtype, t.shape) for k, t in theirs.items()
    }
    assert [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])] == []
    description = json.loads((save / "quant_model_description.json").read_text())
    assert description == json.loads((theirs_dir / "quant_model_description.json").read_text())
    quant_type = oracle.SSZ_SCHEMES[scheme].quant_type
    # msModelSlim types a W4A8_DYNAMIC export of a dense model FLOAT (its MoE-only scheme)
    assert description["model_quant_type"] == (
        "FLOAT" if quant_type == "W4A8_DYNAMIC" else quant_type
    )
