"""Check an export against what its weight-transforming processors recorded of their transforms
(``msquant_export.json`` ``"transforms"``, written from ``ctx.transforms``:
:mod:`msquant.contracts.transforms`).

Two checks, both from the export alone:

* every float tensor a transform set (a norm quarot made a constant or smoothing divided by its
  scales, a rotated embedding or head) that the export stores in float must have the dtype and
  sha256 recorded when it was set: a norm or a rotated float tensor changed afterwards fails,
  naming the tensor and the processor;
* each processor's own record (a rotation's seed, block size and matrix hash) is handed to the
  processor class registered under its type (:meth:`msquant.plugin.Processor.check_transform`),
  which rebuilds what it can (quarot rebuilds its matrices and compares the exported rotation).
  The engine names no processor: a record of a type that is not installed is a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from msquant.contracts.registry import ProcessorRegistry, default_registry
from msquant.contracts.transforms import TRANSFORMS_KEY, dtype_name, tensor_sha256
from msquant.export.marker import EXPORT_MARKER
from msquant.verify.base import ExportReader
from msquant.verify.checksums import find_marker
from msquant.verify.report import Findings

__all__ = ["check_transforms"]

_WHERE = f"{EXPORT_MARKER} {TRANSFORMS_KEY}"


def check_transforms(
    reader: ExportReader,
    path: Path,
    findings: Findings,
    processors: ProcessorRegistry | None = None,
) -> None:
    """Record an error for every recorded transform the export at ``path`` contradicts."""
    found = find_marker(path)
    data = found[0].data.get(TRANSFORMS_KEY) if found is not None else None
    if data is None:
        return
    tensors = data.get("tensors", {}) if isinstance(data, dict) else None
    records = data.get("processors", []) if isinstance(data, dict) else None
    if not isinstance(tensors, dict) or not isinstance(records, list):
        findings.error(f"{_WHERE}: not an object with 'tensors' and 'processors'")
        return
    _check_tensors(reader, tensors, findings)
    _check_records(reader, records, findings, processors or default_registry())


def _check_tensors(reader: ExportReader, tensors: dict[str, Any], findings: Findings) -> None:
    if reader.store is None:
        return
    stored = set(reader.float_tensors())
    for name, entry in sorted(tensors.items()):
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), str) for k in ("by", "dtype", "sha256")
        ):
            findings.error(f"{_WHERE}: the entry of {name} lacks 'by', 'dtype' or 'sha256'")
            continue
        if name not in stored:
            continue  # stored quantized (checked as such), or not stored by this format
        tensor = reader.store.get(name)
        by = entry["by"]
        if dtype_name(tensor.dtype) != entry["dtype"]:
            findings.error(
                f"{name}: stored as {dtype_name(tensor.dtype)}, but {by} left it in "
                f"{entry['dtype']} ({_WHERE})"
            )
        elif tensor_sha256(tensor) != entry["sha256"]:
            findings.error(
                f"{name}: its values differ from those {by} left it with (sha256 recorded in "
                f"{_WHERE}): the {by}-transformed tensor was changed after the export was written"
            )


def _check_records(
    reader: ExportReader,
    records: list[Any],
    findings: Findings,
    processors: ProcessorRegistry,
) -> None:
    for record in records:
        kind = record.get("type") if isinstance(record, dict) else None
        if not isinstance(record, dict) or not isinstance(kind, str):
            findings.error(f"{_WHERE}: a processor record without a 'type'")
            continue
        if kind not in processors:
            findings.warn(
                f"{_WHERE} records a {kind!r} transform, a processor that is not installed: "
                "its parameters were not checked"
            )
            continue
        for problem in processors.get(kind).check_transform(record, reader):
            findings.error(problem)
