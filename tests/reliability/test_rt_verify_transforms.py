"""Red-team replays (issue 24): tampered rotations, norms and smoothing scales passed ``verify``
and ``verify --model_path``.

A rotated or smoothed export differs from the original tensor by tensor, so ``--model_path``
compared names only; and once the file checksums in ``msquant_export.json`` were rewritten (as if
the export had been written so), nothing looked at the values. Now:

* the marker records what each transform left (``transforms``): the rotation's seed, block size
  and matrix hash, and the sha256 of every norm quarot set to ones or smoothing divided by its
  scales. ``verify`` alone fails a changed norm, an exported rotation that is not the one folded
  into the weights, and a rotation record that does not match its own seed;
* ``verify --model_path`` runs the original and the export (rebuilt by its reader, activations
  quantized as stored) on 32 tokens and fails when their logits differ by more than the scheme
  allows: a changed quantized weight, or a norm whose fingerprint was rewritten too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from replay import CALIB_TXT, Cli, replay
from rotation_helpers import randomize_norms
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

import msquant
from msquant.plugin.checks import tensor_sha256
from msquant.plugin.numerics import rotation_for

W8A8_DYNAMIC = """\
    - type: linear_quant
      qconfig:
        act: {dtype: int8, scope: per_token, symmetric: true, method: minmax}
        weight: {dtype: int8, scope: per_channel, symmetric: true, method: minmax}
  save:
    - type: ascendv1_saver
"""
ROTATED = "apiversion: modelslim_v1\nspec:\n  process:\n    - type: quarot\n" + W8A8_DYNAMIC
SMOOTHED = "apiversion: modelslim_v1\nspec:\n  process:\n    - type: iter_smooth\n" + W8A8_DYNAMIC
NORM = "model.layers.0.input_layernorm.weight"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"
FINGERPRINT = "{name}: its values differ from those {by} left it with (sha256 recorded in " + (
    "msquant_export.json transforms): the {by}-transformed tensor was changed after the export "
    "was written"
)
FORWARD = (
    "the export does not compute what the original model computes: on 32 tokens its logits "
    "differ from the original's by"
)

Edit = Callable[[dict[str, torch.Tensor]], None]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama whose norms are not ones (folding and smoothing them matter)."""
    folder = build_tiny_model(tmp_path_factory.mktemp("norms_llama"), "llama")
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    randomize_norms(loaded)
    loaded.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def exports(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The rotated and the smoothed W8A8_DYNAMIC exports of ``model``."""
    root = tmp_path_factory.mktemp("transformed")
    found = {}
    for name, text in (("rotated", ROTATED), ("smoothed", SMOOTHED)):
        config = root / f"{name}.yaml"
        config.write_text(text, encoding="utf-8")
        found[name] = root / name
        msquant.quantize(
            model, found[name], config, calib_path=CALIB_TXT, max_calib_tokens=64, progress=False
        )
    return found


def _weights(out: Path) -> Path:
    [file] = out.glob("quant_model_weights*.safetensors")
    return file


def _rewrite_checksums(out: Path, names: list[str], fingerprints: list[str] = ()) -> None:  # type: ignore[assignment]
    """As if the export had been written so: the sha256 of ``names`` updated in the marker, and
    the transform fingerprints of the tensors ``fingerprints`` too (a forger's marker)."""
    marker = json.loads((out / "msquant_export.json").read_text())
    for name in names:
        data = (out / name).read_bytes()
        marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    stored = load_file(_weights(out))
    for tensor in fingerprints:
        marker["transforms"]["tensors"][tensor]["sha256"] = tensor_sha256(stored[tensor])
    (out / "msquant_export.json").write_text(json.dumps(marker, indent=2) + "\n")


def _tampered(
    export: Path, case: Path, edit: Edit, forge_fingerprints: tuple[str, ...] = ()
) -> Path:
    """A copy of ``export`` in ``case/out`` with its weights edited and checksums rewritten."""
    out = case / "out"
    shutil.copytree(export, out)
    weights = _weights(out)
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
    _rewrite_checksums(out, [weights.name], list(forge_fingerprints))
    return out


def _doubled_norm(tensors: dict[str, torch.Tensor]) -> None:
    tensors[NORM] = tensors[NORM] * 2


def _permuted_columns(tensors: dict[str, torch.Tensor]) -> None:
    """Another rotation (a permutation) applied to one quantized weight's input columns."""
    order = torch.randperm(tensors[UP_PROJ].shape[1], generator=torch.Generator().manual_seed(0))
    tensors[UP_PROJ] = tensors[UP_PROJ][:, order].contiguous()


def _honest(run_cli: Cli, case: Path, out: Path, model: Path) -> None:
    """The control: the export as written passes both."""
    assert replay(run_cli, case, "verify", out).code == 0
    outcome = replay(run_cli, case, "verify", out, "--model_path", model)
    assert outcome.code == 0, outcome.err


@pytest.mark.parametrize("kind", ["rotated", "smoothed"])
def test_v24_a_changed_norm_fails_verify_alone(
    kind: str, exports: dict[str, Path], model: Path, tmp_path: Path, run_cli: Cli
) -> None:
    _honest(run_cli, tmp_path, exports[kind], model)
    out = _tampered(exports[kind], tmp_path, _doubled_norm)
    by = "quarot" if kind == "rotated" else "iter_smooth"
    for extra in ((), ("--model_path", model)):
        outcome = replay(run_cli, tmp_path, "verify", out, *extra)
        assert outcome.code == 2
        assert FINGERPRINT.format(name=NORM, by=by) in outcome.err, outcome.err


@pytest.mark.parametrize("kind", ["rotated", "smoothed"])
def test_v24_a_norm_with_a_forged_fingerprint_fails_the_forward_check(
    kind: str, exports: dict[str, Path], model: Path, tmp_path: Path, run_cli: Cli
) -> None:
    """Marker and fingerprints rewritten by a forger: the export alone looks consistent (the
    documented limit of any record), the logits against the float model do not."""
    out = _tampered(exports[kind], tmp_path, _doubled_norm, forge_fingerprints=(NORM,))
    assert replay(run_cli, tmp_path, "verify", out).code == 0
    outcome = replay(run_cli, tmp_path, "verify", out, "--model_path", model)
    assert outcome.code == 2
    assert (
        FORWARD in outcome.err
        and "for W8 weights (the original rounded to nearest per channel" in outcome.err
    ), outcome.err


@pytest.mark.parametrize("kind", ["rotated", "smoothed"])
def test_v24_a_rotated_or_smoothed_weight_changed_fails_the_forward_check(
    kind: str, exports: dict[str, Path], model: Path, tmp_path: Path, run_cli: Cli
) -> None:
    out = _tampered(exports[kind], tmp_path, _permuted_columns)
    outcome = replay(run_cli, tmp_path, "verify", out, "--model_path", model)
    assert outcome.code == 2
    assert FORWARD in outcome.err, outcome.err
    assert "names only" not in outcome.out + outcome.err


def test_v24_an_exported_rotation_that_was_not_applied_fails(
    exports: dict[str, Path], tmp_path: Path, run_cli: Cli
) -> None:
    """``optional/quarot.safetensors`` (which vLLM-Ascend applies to activations) holding
    another Hadamard matrix: verify rebuilds the rotation from the recorded seed and compares."""
    out = tmp_path / "out"
    shutil.copytree(exports["rotated"], out)
    optional = out / "optional" / "quarot.safetensors"
    other = rotation_for(64, -1, seed=7).contiguous()
    save_file({"global_rotation": other}, optional, metadata={"format": "pt"})
    _rewrite_checksums(out, ["optional/quarot.safetensors"])
    outcome = replay(run_cli, tmp_path, "verify", out)
    assert outcome.code == 2
    assert (
        "quarot: the exported rotation (quarot.global_rotation, shape [64, 64]) is not the "
        "rotation folded into the weights (width 64, seed 1234, block_size -1)" in outcome.err
    ), outcome.err


def test_v24_a_rotation_record_that_does_not_match_its_seed_fails(
    exports: dict[str, Path], tmp_path: Path, run_cli: Cli
) -> None:
    out = tmp_path / "out"
    shutil.copytree(exports["rotated"], out)
    marker = json.loads((out / "msquant_export.json").read_text())
    [record] = marker["transforms"]["processors"]
    record["seed"] = 7
    (out / "msquant_export.json").write_text(json.dumps(marker))
    outcome = replay(run_cli, tmp_path, "verify", out)
    assert outcome.code == 2
    assert (
        "quarot: msquant_export.json records a rotation of width 64 whose sha256 is not that of "
        "the matrix quarot builds for seed 7, block_size -1: the record was edited"
    ) in outcome.err, outcome.err
    record["width"] = 10**9
    (out / "msquant_export.json").write_text(json.dumps(marker))
    outcome = replay(run_cli, tmp_path, "verify", out)
    assert outcome.code == 2 and "quarot: the rotation record in msquant_export.json is malformed"


def test_v24_the_marker_records_each_transform(exports: dict[str, Path], model: Path) -> None:
    """What the run wrote: quarot's parameters and the fingerprints of the tensors it set (its
    norms are ones), smoothing's norms (the original's divided by the scales)."""
    rotated = json.loads((exports["rotated"] / "msquant_export.json").read_text())["transforms"]
    [record] = rotated["processors"]
    assert {k: record[k] for k in ("type", "width", "block_size", "seed", "dtype")} == {
        "type": "quarot",
        "width": 64,
        "block_size": -1,
        "seed": 1234,
        "dtype": "float32",
    }
    assert record["rotation_sha256"] == tensor_sha256(rotation_for(64, -1, seed=1234))
    ones = tensor_sha256(torch.ones(64))
    norms = [n for n in rotated["tensors"] if "norm" in n]
    assert len(norms) == 5  # two per layer and the final one
    assert all(
        rotated["tensors"][n] == {"by": "quarot", "dtype": "float32", "sha256": ones} for n in norms
    )
    stored = load_file(_weights(exports["rotated"]))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert rotated["tensors"][name]["sha256"] == tensor_sha256(stored[name])
    smoothed = json.loads((exports["smoothed"] / "msquant_export.json").read_text())["transforms"]
    original = load_file(model / "model.safetensors")
    stored = load_file(_weights(exports["smoothed"]))
    assert smoothed["processors"] == []
    assert sorted(smoothed["tensors"]) == sorted(
        n for n in original if "layers" in n and "norm" in n
    )
    for name, entry in smoothed["tensors"].items():
        assert entry["by"] == "iter_smooth" and entry["sha256"] == tensor_sha256(stored[name])
        assert not torch.equal(stored[name], original[name])


def test_v24_honest_transformed_exports_pass_the_forward_check(
    exports: dict[str, Path], model: Path, tmp_path: Path, run_cli: Cli
) -> None:
    """What replaced the names-only comparison: a forward check line, no warning; with
    ``--no_forward`` the old warning says the values were not compared."""
    for out in exports.values():
        outcome = replay(run_cli, tmp_path, "verify", out, "--model_path", model)
        assert outcome.code == 0, outcome.err
        assert "forward check (32 tokens, " in outcome.out
        assert "for W8 weights; rounded to nearest: " in outcome.out
        assert "only the names" not in outcome.out
        skipped = replay(run_cli, tmp_path, "verify", out, "--model_path", model, "--no_forward")
        assert skipped.code == 0 and "forward check" not in skipped.out.split("warning(s):")[0]
        assert "only the names of the original's tensors were checked" in skipped.out
