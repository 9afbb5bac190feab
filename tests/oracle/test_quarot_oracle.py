"""msModelSlim 26.1.0 as the oracle of ``quarot`` (opt-in: ``pytest -m msmodelslim``).

msModelSlim's exports of ``quarot`` + ``linear_quant`` (W8A8_DYNAMIC, W4A8_DYNAMIC) on tiny float32
Qwen3 models with random norm scales are made by ``quarot_run.py`` in ``$MSQUANT_ORACLE_CACHE``;
msquant runs the very same YAML on the same model and calibration file. The hidden size (64) and
head_dim (16) are powers of two, where msModelSlim's rotation is Sylvester's Hadamard matrix with
seeded random signs, which msquant reproduces. A tiny Qwen3-MoE is compared too, through a second
msModelSlim environment with transformers 4.57.6 (``$MSQUANT_MSMODELSLIM_TF4_VENV``), the only
one where msModelSlim's Qwen3-MoE rotation runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msmodelslim_run as oracle  # noqa: E402
import quarot_run  # noqa: E402

pytestmark = pytest.mark.msmodelslim

CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", oracle.DEFAULT_CACHE))
VENV = Path(os.environ.get("MSQUANT_MSMODELSLIM_VENV", oracle.DEFAULT_VENV))


def _venv() -> Path:
    if not (VENV / "bin" / "msmodelslim").is_file():
        pytest.fail(
            f"no msModelSlim environment at {VENV}: run scripts/msmodelslim_env.sh (or set "
            "MSQUANT_MSMODELSLIM_VENV)"
        )
    return VENV


def _their_export(name: str, scheme: str) -> Path:
    return quarot_run.ensure_export(CACHE, _venv(), name, scheme)


def _read(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = load_file(str(folder / "quant_model_weights.safetensors"))
    description = json.loads((folder / "quant_model_description.json").read_text("utf-8"))
    return tensors, description


def _our_export(name: str, scheme: str, save: Path) -> Path:
    import msquant

    _their_export(name, scheme)  # makes the model, the calibration file and the YAML too
    config = quarot_run.config_path(CACHE, scheme)
    msquant.quantize(CACHE / "models" / name, save, config, progress=False)
    return save


@pytest.mark.parametrize("scheme", quarot_run.SCHEMES)
def test_rotated_exports_are_bit_identical(scheme: str, tmp_path: Path) -> None:
    """Untied model: every tensor (rotated and quantized weights, scales, the embedding, the
    rotated head, the norms set to ones), the description (with its ``optional.quarot`` entry) and
    the shipped global rotation equal msModelSlim's bit for bit."""
    theirs_dir = _their_export("qwen3_rot", scheme)
    ours_dir = _our_export("qwen3_rot", scheme, tmp_path / "out")
    theirs, their_description = _read(theirs_dir)
    ours, our_description = _read(ours_dir)
    assert our_description == their_description
    assert sorted(ours) == sorted(theirs)
    differing = [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]
    assert differing == []
    rotation = "optional/quarot.safetensors"
    assert their_description["optional"]["quarot"]["rotation_map"]["global_rotation"] == rotation
    their_rotation = load_file(str(theirs_dir / rotation))["global_rotation"]
    assert torch.equal(load_file(str(ours_dir / rotation))["global_rotation"], their_rotation)


def test_tied_model_msmodelslim_cannot_save_msquant_unties(tmp_path: Path) -> None:
    """msModelSlim 26.1.0 (with transformers 5.24) cannot export a tied-embedding model, rotated or
    not: its saver refuses the head and the embedding sharing one tensor. msquant unties the head.
    The tied model equals the untied one but for the head, so msquant's export of it equals
    msModelSlim's export of the untied model in every tensor but the head, whose weight is the
    embedding with the final norm folded in, rotated (float32, as msModelSlim rotates a head)."""
    import msquant
    from msquant.quant.rotation import random_hadamard

    untied_dir = _their_export("qwen3_rot", "w8a8_dynamic")  # also writes the YAML
    config = quarot_run.config_path(CACHE, "w8a8_dynamic")
    model = quarot_run.build_model("qwen3_rot_tied", CACHE / "models" / "qwen3_rot_tied")
    with pytest.raises(RuntimeError, match="share memory"):
        oracle.run_msmodelslim(
            VENV, model, config, tmp_path / "theirs", tmp_path / "theirs.log", quarot_run.MODEL_TYPE
        )
    ours_dir = tmp_path / "ours"
    msquant.quantize(model, ours_dir, config, progress=False)
    theirs, _ = _read(untied_dir)
    ours, description = _read(ours_dir)
    assert sorted(ours) == sorted(theirs)
    differing = [name for name in sorted(theirs) if not torch.equal(ours[name], theirs[name])]
    assert differing == ["lm_head.weight"]
    assert description["lm_head.weight"] == "FLOAT"
    float_model = load_file(str(model / "model.safetensors"))
    embedding = float_model["model.embed_tokens.weight"]
    expected = torch.matmul(embedding * float_model["model.norm.weight"], random_hadamard(64))
    assert torch.equal(ours["lm_head.weight"], expected)
    config_json = json.loads((ours_dir / "config.json").read_text(encoding="utf-8"))
    assert config_json["tie_word_embeddings"] is False


#: Run in msModelSlim's environment: its rotation of a size that is not a power of two and the
#: Hadamard factor it reads from its tables, saved for the comparison below.
_THEIR_ROTATION = """
import sys
from safetensors.torch import save_file
from msmodelslim.processor.quarot.common.hadamard import get_had_k
from msmodelslim.processor.quarot.common.quarot_utils import QuaRotMode, create_rot
size = int(sys.argv[2])
core, _ = get_had_k(size)
rotation = create_rot(QuaRotMode.HADAMARD, size)
save_file({"rotation": rotation.contiguous(), "core": core.contiguous()}, sys.argv[1])
"""


@pytest.mark.parametrize("size", [576, 896])
def test_other_sizes_differ_only_by_the_hadamard_factor(size: int, tmp_path: Path) -> None:
    """SmolLM2's 576 (= 36 x 16) and Qwen2's 896 (= 28 x 32): msModelSlim reads the order-36/28
    factor from its tables, msquant builds its own (Paley). Given msModelSlim's factor, msquant's
    construction (signs, Kronecker product with Sylvester's matrix, scaling) gives msModelSlim's
    rotation bit for bit; with its own factor, a different but equally orthogonal rotation."""
    import subprocess

    from msquant.quant.rotation import random_hadamard

    venv = _venv()
    out = tmp_path / "theirs.safetensors"
    script = tmp_path / "their_rotation.py"
    script.write_text(_THEIR_ROTATION, encoding="utf-8")
    subprocess.run([str(venv / "bin" / "python"), str(script), str(out), str(size)], check=True)
    theirs = load_file(str(out))
    assert torch.equal(random_hadamard(size, core=theirs["core"]), theirs["rotation"])
    ours = random_hadamard(size, dtype=torch.float64)
    assert torch.allclose(ours @ ours.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    assert not torch.equal(ours.float(), theirs["rotation"])


def test_moe_rotation_equals_msmodelslims_on_experts_and_router(tmp_path: Path) -> None:
    """Tiny Qwen3-MoE (8 experts) through msModelSlim's Qwen3-MoE adapter (transformers 4.57.6,
    ``$MSQUANT_MSMODELSLIM_TF4_VENV``), quarot + W8A8_DYNAMIC: every routed expert's gate/up/down,
    q/k, the embedding, the head and the norms equal msModelSlim's bit for bit. The router
    (``mlp.gate``) is rotated alike: msModelSlim also quantizes it (``include: ['*']``), msquant
    keeps routers float, so msquant's rotated router is within half a step of msModelSlim's
    dequantized one. v_proj / o_proj differ: msModelSlim's Qwen3-MoE adapter rotates them per
    head with its "block Hadamard shifted" matrix of block 32, which on this 16-wide head zeroes
    both (every code and scale 0 or its floor); msquant's per-head rotation keeps them."""
    import msquant

    if not (quarot_run.TF4_VENV / "bin" / "msmodelslim").is_file():
        pytest.fail(
            f"no msModelSlim environment with transformers 4.57.6 at {quarot_run.TF4_VENV}: run "
            "scripts/msmodelslim_env.sh VENV 4.57.6 (or set MSQUANT_MSMODELSLIM_TF4_VENV)"
        )
    theirs_dir = quarot_run.ensure_export(
        CACHE, quarot_run.TF4_VENV, "qwen3_moe_rot", "w8a8_dynamic"
    )
    ours_dir = tmp_path / "ours"
    config = quarot_run.config_path(CACHE, "w8a8_dynamic")
    msquant.quantize(CACHE / "models" / "qwen3_moe_rot", ours_dir, config, progress=False)
    theirs, their_description = _read(theirs_dir)
    ours, our_description = _read(ours_dir)
    routers = [f"model.layers.{layer}.mlp.gate" for layer in (0, 1)]
    quantized_router = {
        f"{r}.{suffix}" for r in routers for suffix in ("weight_scale", "weight_offset")
    }
    assert sorted(set(theirs) - set(ours)) == sorted(quantized_router)
    assert set(ours) <= set(theirs)
    head_pairs = {
        f"model.layers.{layer}.self_attn.{proj}.{suffix}"
        for layer in (0, 1)
        for proj in ("v_proj", "o_proj")
        for suffix in ("weight", "weight_scale")
    }
    differing = {name for name in ours if not torch.equal(ours[name], theirs[name])}
    assert differing == head_pairs | {f"{r}.weight" for r in routers}
    assert all(int(theirs[name].abs().max()) == 0 for name in head_pairs if name.endswith("weight"))
    experts = [name for name in ours if ".mlp.experts." in name]
    assert len(experts) == 2 * 8 * 3 * 3  # layers x experts x projections x (weight, scale, offset)
    for router in routers:
        dequantized = theirs[f"{router}.weight"] * theirs[f"{router}.weight_scale"].reshape(-1, 1)
        half_step = theirs[f"{router}.weight_scale"].reshape(-1, 1) / 2
        assert bool(((ours[f"{router}.weight"] - dequantized).abs() <= half_step * 1.0001).all())
        assert our_description[f"{router}.weight"] == "FLOAT"
    differing_descriptions = {
        name for name in their_description if our_description.get(name) != their_description[name]
    }
    assert differing_descriptions == {f"{r}.weight" for r in routers} | quantized_router
