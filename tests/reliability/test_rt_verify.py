"""Red-team replays: ``msquant verify`` on damaged exports (V-rows). Without the float model it
passed flipped codes, a code off by one, doubled scales and a zeroed embedding row; it now
checks every file against the sha256 recorded in ``msquant_export.json`` when it was written."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from replay import Cli, quant_args, replay
from safetensors.torch import load_file, save_file

SAVERS = {
    "ascend": "    - type: ascendv1_saver\n",
    "gptq": "    - type: gptq_saver\n",
    "ct": "    - type: compressed_tensors\n",
}


def _export(case: Path, run_cli: Cli, saver: str = "ascend", int4: bool = False) -> Path:
    config = case / "w8.yaml"
    text = config.read_text() + "  save:\n" + SAVERS[saver]
    if int4:
        text = text.replace(
            "dtype: int8, scope: per_channel",
            "dtype: int4, scope: per_group, ext: {group_size: 32}",
        )
    config.write_text(text)
    assert replay(run_cli, case, *quant_args(case)).code == 0
    return case / "out"


def _weights(out: Path) -> Path:
    [file] = [p for p in out.glob("*.safetensors") if not p.name.startswith(".")]
    return file


def _edit(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _flip_in_tensor(file: Path, suffix: str, count: int, mask: int) -> None:
    """XOR ``count`` bytes of the stored tensor whose name ends with ``suffix`` (in place, as a
    bad copy would: the header and every other byte stay)."""
    data = bytearray(file.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    name = next(k for k in sorted(header) if k.endswith(suffix))
    start, end = header[name]["data_offsets"]
    for offset in range(8 + size + start, min(8 + size + end, 8 + size + start + count)):
        data[offset] ^= mask
    file.write_bytes(bytes(data))


def _key(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def _plus_one(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        flat = tensors[_key(tensors, suffix)].view(-1)
        flat[0] = flat[0] + 1 if flat[0] < 100 else flat[0] - 1

    return edit


def _times_two(tensors: dict[str, torch.Tensor]) -> None:
    key = _key(tensors, "o_proj.weight_scale")
    tensors[key] = tensors[key] * 2


def _zero_embedding_row(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.embed_tokens.weight"][5] = 0


CASES = {
    "v1_64_code_bytes_xor_1": ("ascend", lambda f: _flip_in_tensor(f, "up_proj.weight", 64, 1)),
    "v2_4k_code_bytes_xor_ff": (
        "ascend",
        lambda f: _flip_in_tensor(f, "up_proj.weight", 4096, 255),
    ),
    "v3_one_code_plus_one": ("ascend", lambda f: _edit(f, _plus_one("q_proj.weight"))),
    "v3_gptq_one_code_plus_one": ("gptq", lambda f: _edit(f, _plus_one("q_proj.qweight"))),
    "v5_scales_doubled": ("ascend", lambda f: _edit(f, _times_two)),
    "v7_embedding_row_zeroed": ("ascend", lambda f: _edit(f, _zero_embedding_row)),
    "v12_gptq_qweight_flipped": ("gptq", lambda f: _flip_in_tensor(f, "qweight", 16, 0xFF)),
    "v12_ct_weight_packed_flipped": ("ct", lambda f: _flip_in_tensor(f, "weight_packed", 16, 0xFF)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_v_damaged_files_fail_verify(case: Path, run_cli: Cli, name: str) -> None:
    saver, damage = CASES[name]
    out = _export(case, run_cli, saver, int4=saver != "ascend")
    assert replay(run_cli, case, "verify", out).code == 0  # the control
    weights = _weights(out)
    damage(weights)
    outcome = replay(run_cli, case, "verify", out)
    assert outcome.code == 2
    assert (
        f"{weights.name}: its bytes differ from the sha256 recorded in msquant_export.json"
        in outcome.err
    )
    assert outcome.added == outcome.removed == outcome.changed == []


def test_v_a_missing_file_and_a_foreign_file(case: Path, run_cli: Cli) -> None:
    out = _export(case, run_cli)
    (out / "NOTES.md").write_text("mine")  # a user's file: named, not an error
    assert replay(run_cli, case, "verify", out).code == 0
    assert (
        "1 file(s) not written by msquant: NOTES.md"
        in replay(run_cli, case, "verify", out, "--json").out
    )
    (out / "generation_config.json").unlink()
    outcome = replay(run_cli, case, "verify", out)
    assert (
        outcome.code == 2
        and "generation_config.json: listed in msquant_export.json but missing" in outcome.err
    )


def test_v_several_savers_are_checked_folder_by_folder(case: Path, run_cli: Cli) -> None:
    config = case / "w8.yaml"
    config.write_text(
        config.read_text() + "  save:\n" + SAVERS["ascend"] + "    - type: mindie_format_saver\n"
    )
    assert replay(run_cli, case, *quant_args(case)).code == 0
    damaged = _weights(case / "out" / "mindie_format_saver")
    _flip_in_tensor(damaged, "weight", 4, 0x01)
    outcome = replay(run_cli, case, "verify", case / "out")
    assert outcome.code == 2
    assert f"mindie_format_saver/{damaged.name}: its bytes differ" in outcome.err
    assert "ascendv1_saver/" not in outcome.err.split("msquant: error:", 1)[1]


def _rewrite_marker(out: Path, name: str) -> None:
    """As if the export had been written so (the checksum of ``name`` updated)."""
    marker = json.loads((out / "msquant_export.json").read_text())
    data = (out / name).read_bytes()
    marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "msquant_export.json").write_text(json.dumps(marker, indent=2) + "\n")


def test_v9_a_global_type_changed_after_writing_fails(case: Path, run_cli: Cli) -> None:
    """model_quant_type W8A8 on a W8A16 export (vLLM-Ascend would pick W8A8 kernels) passed with
    a warning. Changed after writing, the checksum fails it; written so (MindIE's
    ``ext.json_append`` may set the global type, as msModelSlim's does) it stays a warning."""
    out = _export(case, run_cli)
    description = out / "quant_model_description.json"
    data = json.loads(description.read_text())
    data["model_quant_type"] = "W8A8"
    description.write_text(json.dumps(data, indent=4) + "\n")
    changed = replay(run_cli, case, "verify", out)
    assert changed.code == 2
    assert "quant_model_description.json: its bytes differ from the sha256" in changed.err
    _rewrite_marker(out, description.name)
    written_so = replay(run_cli, case, "verify", out)
    assert written_so.code == 0
    assert "model_quant_type 'W8A8' is not among the types of its tensors" in written_so.out


def test_v_an_export_without_checksums_is_still_read(case: Path, run_cli: Cli) -> None:
    """msModelSlim's exports (no msquant_export.json) are verified as before."""
    out = _export(case, run_cli)
    (out / "msquant_export.json").unlink()
    outcome = replay(run_cli, case, "verify", out)
    assert outcome.code == 0, outcome.err
