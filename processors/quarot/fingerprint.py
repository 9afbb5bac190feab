"""What ``quarot`` records of its rotation in ``msquant_export.json``, and the check of it.

The record (``ctx.transforms.describe``): the width of the residual stream, ``block_size``, the
seed of msModelSlim's random Hadamard construction, the dtype the matrices were applied in and the
sha256 of each matrix applied (the residual stream's, and the per-head ones of the value/output
projections). ``msquant verify`` rebuilds the matrices from width, block size and seed
(:func:`msquant.plugin.numerics.rotation_for`), so it needs neither the float model nor the record's
hashes to be trusted: a record whose hashes do not match its own parameters was edited, and an
exported rotation (``optional/quarot.safetensors``, which vLLM-Ascend applies to activations)
that differs from the rebuilt one is not the rotation folded into the weights. The norms quarot
sets to a constant, the rotated embedding and head are fingerprinted tensor by tensor
(``ctx.transforms.fingerprint``) and checked by verify itself.
"""

from __future__ import annotations

from typing import Any

import torch

from msquant.plugin import TransformedExport
from msquant.plugin.checks import tensor_sha256
from msquant.plugin.numerics import DEFAULT_ROTATION_SEED, rotation_for

__all__ = ["GLOBAL_ROTATION", "OPTIONAL_SCOPE", "check_rotation_record", "rotation_record"]

#: The scope and tensor name of the exported rotation (msModelSlim's ``optional.quarot``).
OPTIONAL_SCOPE = "quarot"
GLOBAL_ROTATION = "global_rotation"
#: Widest rotation a record may ask verify to rebuild (a record is read from a file).
MAX_WIDTH = 1 << 16
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def rotation_record(
    width: int, block_size: int, rotation: torch.Tensor, head_rotations: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """The parameters of the rotations applied (``rotation`` of the residual stream, and the
    per-head ones by width), for ``ctx.transforms.describe``."""
    return {
        "width": width,
        "block_size": block_size,
        "seed": DEFAULT_ROTATION_SEED,
        "dtype": str(rotation.dtype).removeprefix("torch."),
        "rotation_sha256": tensor_sha256(rotation),
        "head_rotations": {str(w): tensor_sha256(r) for w, r in sorted(head_rotations.items())},
    }


def _int(record: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = record.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    return None


def _rebuilt(width: int, block_size: int, seed: int, dtype: torch.dtype) -> torch.Tensor | str:
    try:
        return rotation_for(width, block_size, seed, dtype=dtype)
    except ValueError as exc:
        return str(exc)


def check_rotation_record(record: dict[str, Any], export: TransformedExport) -> list[str]:
    """Problems of a ``quarot`` record against itself and the export's rotation (module doc)."""
    width = _int(record, "width", 1, MAX_WIDTH)
    block = _int(record, "block_size", -1, MAX_WIDTH)
    seed = _int(record, "seed", 0, 2**63 - 1)
    dtype = DTYPES.get(str(record.get("dtype")))
    heads = record.get("head_rotations", {})
    if None in (width, block, seed, dtype) or block == 0 or not isinstance(heads, dict):
        return [
            "quarot: the rotation record in msquant_export.json is malformed (expected width "
            f"1..{MAX_WIDTH}, block_size -1 or a positive size, seed, dtype float32/float64, "
            "head_rotations): it was edited; re-export the model"
        ]
    assert width is not None and block is not None and seed is not None and dtype is not None
    what = f"seed {seed}, block_size {block}"
    rotation = _rebuilt(width, block, seed, dtype)
    if isinstance(rotation, str):
        return [
            f"quarot: the recorded rotation ({what}, width {width}) cannot be built: {rotation}"
        ]
    problems = []
    if tensor_sha256(rotation) != record.get("rotation_sha256"):
        problems.append(
            f"quarot: msquant_export.json records a rotation of width {width} whose sha256 is not "
            f"that of the matrix quarot builds for {what}: the record was edited"
        )
    for key, digest in sorted(heads.items()):
        head_width = int(key) if str(key).isdigit() and int(key) <= MAX_WIDTH else 0
        head = _rebuilt(head_width, block, seed, dtype) if head_width else "not a width"
        if isinstance(head, str) or tensor_sha256(head) != digest:
            problems.append(
                f"quarot: msquant_export.json records a per-head rotation of width {key!r} that is "
                f"not the one quarot builds for {what}: the record was edited"
            )
    exported = export.optional_tensor(OPTIONAL_SCOPE, GLOBAL_ROTATION)
    if exported is not None:
        expected = rotation.to(torch.float32)
        if tuple(exported.shape) != tuple(expected.shape) or not torch.equal(
            exported.to(torch.float32), expected
        ):
            problems.append(
                f"quarot: the exported rotation ({OPTIONAL_SCOPE}.{GLOBAL_ROTATION}, shape "
                f"{list(exported.shape)}) is not the rotation folded into the weights (width "
                f"{width}, {what}): a consumer applying it to activations would compute wrong "
                "outputs"
            )
    return problems
