"""``verify_export`` and ``check_export``: read an export back and check it layer by layer.

Every file is first compared with the sha256 msquant recorded when it wrote the export
(:mod:`msquant.verify.checksums`). Layers are then decoded one at a time (only one layer's tensors
are in memory), each by the reader of its format, and checked the same way whatever the format:
parameter values, the consumer rules of the format, the in-memory reference (codes bit for bit),
the original weights (relative error), and the fused-shard rule (q/k/v, gate/up and whatever
else the exported model's adapter fuses must share a scheme).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from msquant.contracts.format import FormatRegistry
from msquant.contracts.registry import ProcessorRegistry
from msquant.export.marker import TRANSFORMED_KEY, weights_transformed_by
from msquant.model.vision import other_parts
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.verify.base import ExportReader, export_config, ties_word_embeddings
from msquant.verify.checksums import check_checksums
from msquant.verify.compare import (
    compare_float_tensor,
    compare_original,
    compare_reference,
    missing_modules,
    open_original,
)
from msquant.verify.detect import open_reader
from msquant.verify.errors import ExportVerificationError
from msquant.verify.fingerprints import check_transforms
from msquant.verify.forward import compare_forward
from msquant.verify.layer import check_values
from msquant.verify.report import Findings, LayerReport, VerifyReport
from msquant.verify.tensors import TensorStore

__all__ = ["verify_export", "check_export"]

logger = logging.getLogger(__name__)


def verify_export(
    save_path: str | Path,
    *,
    reference: Mapping[str, QuantizedWeight] | None = None,
    model_path: str | Path | None = None,
    formats: FormatRegistry | None = None,
    processors: ProcessorRegistry | None = None,
    forward: bool = True,
) -> VerifyReport:
    """Read an export folder back and check it; never raises for an inconsistent export.

    :param save_path: an export folder of any registered format (Ascend, MindIE, GPTQ and
        compressed-tensors are built in); the format is detected.
    :param reference: module name -> the in-memory :class:`~msquant.plugin.QuantizedWeight` of the same
        run: codes must match bit for bit, zero points exactly, scales within the rounding of
        their stored dtype, and the module sets must be equal.
    :param model_path: the original float model folder: per-layer relative error against its
        weights (bound: :func:`msquant.verify.compare.relative_error_bound`), float tensors equal
        (for an export whose weights a rotation or smoothing transformed: their names only), and
        the logits of both models on a few tokens (:mod:`msquant.verify.forward`).
    :param formats: the export formats to detect and read with (default: every installed one).
    :param processors: where the processors that recorded transforms in ``msquant_export.json``
        are looked up to check their records (default: every installed one).
    :param forward: with ``model_path``, run the logits comparison (it loads the original model
        whole, then the export rebuilt in float; False skips it).
    :returns: the report; ``report.ok`` is False when any consistency error was found.
    :raises ExportReadError: when ``save_path`` is missing or holds no known format.
    :raises msquant.ModelLoadError: when ``model_path`` cannot be read.
    """
    path = Path(save_path).expanduser().absolute()
    findings = Findings()
    reader = open_reader(path, findings, formats)
    original = open_original(model_path) if model_path is not None else None
    report = VerifyReport(reader.format_name, path)
    transformed = weights_transformed_by(path) if original is not None else []
    if transformed and not forward:
        findings.warn(
            f"the export's float weights were transformed by {', '.join(transformed)} "
            f"(msquant_export.json {TRANSFORMED_KEY}): they compute what the original model "
            "computes but differ from it tensor by tensor, so only the names of the original's "
            "tensors were checked, not their values (the forward check, which compares the "
            "outputs, was skipped)"
        )
    compared = None if transformed else original
    altered: list[str] = []
    try:
        check_checksums(path, findings)
        check_transforms(reader, path, findings, processors)
        modules = reader.quantized_modules()
        altered = sorted(reader.altered_float_tensors())
        if not modules and not altered and reader.store is not None:
            findings.warn("no quantized layer found: every weight is stored in float")
        if reference is not None:
            missing_modules(modules, reference, findings)
        for module in modules:
            report.layers.append(_check_layer(reader, module, reference, compared, findings))
        for problem in reader.adapter.fused_group_problems(*reader.schemes()):
            findings.error(problem)
        reader.finish()
        if original is not None:
            _check_float_tensors(reader, original, path, findings, compare_values=not transformed)
    finally:
        if reader.store is not None:
            reader.store.close()
        if original is not None:
            original.close()
    if model_path is not None and forward and altered:
        findings.warn(
            f"{len(altered)} float tensor(s) were changed on purpose by the export's format "
            f"(e.g. pruned, {altered[0]}): the original model computes something else, so the "
            "forward check, which bounds the logits' difference by the quantization's rounding, "
            "was skipped"
        )
    elif model_path is not None and forward and not findings.errors:
        report.forward = compare_forward(path, Path(model_path), report.layers, findings, formats)
    report.errors = list(findings.errors)
    report.warnings = findings.warnings + findings.grouped_warnings()
    logger.debug(
        "verified %s export %s: %d layer(s), %d error(s), %d warning(s)",
        report.format,
        path,
        len(report.layers),
        len(report.errors),
        len(report.warnings),
    )
    return report


def _check_layer(
    reader: ExportReader,
    module: str,
    reference: Mapping[str, QuantizedWeight] | None,
    original: TensorStore | None,
    findings: Findings,
) -> LayerReport:
    entry = reader.entry(module)
    layer = reader.decode(module)
    if layer is None:
        return entry
    entry.bits, entry.group_size = layer.bits, layer.group_size
    entry.value_type = layer.values.name
    if entry.symmetric is None:  # the format does not declare it (Ascend): read it off the offsets
        entry.symmetric = layer.symmetric
    values_ok = check_values(layer, findings)
    reader.consumer_notes(layer)
    if reference is not None and module in reference:
        compare_reference(layer, reference[module], entry, findings)
    if original is not None and values_ok:
        weight = f"{module}.weight"
        if weight in original:
            compare_original(layer, original.get(weight), entry, findings)
        else:
            findings.error(f"{module}: stored quantized but the original model has no {weight}")
    return entry


def _check_float_tensors(
    reader: ExportReader,
    original: TensorStore,
    path: Path,
    findings: Findings,
    compare_values: bool = True,
) -> None:
    """Float tensors equal the original's (unless ``compare_values`` is off); no original tensor
    is lost."""
    if reader.store is None:
        return
    altered = reader.altered_float_tensors()
    for name in reader.float_tensors():
        if compare_values and name in original and name not in altered:
            compare_float_tensor(name, reader.store.get(name), original.get(name), findings)
    quantized = {f"{m}.weight" for m in reader.quantized_modules()}
    config = export_config(path)
    tied = ties_word_embeddings(config)
    # an Omni model's talker / speech decoder: not part of what msquant quantizes and exports
    left_out = tuple(f"{prefix}." for prefix in other_parts(config or {}))
    skipped = [name for name in original.names() if name.startswith(left_out)] if left_out else []
    if skipped:
        findings.warn(
            f"{len(skipped)} tensor(s) of the original model's "
            f"{', '.join(p.rstrip('.') for p in left_out)} are not in the export: msquant "
            "quantizes and exports this model's thinker only, as msModelSlim does"
        )
    for name in original.names():
        if name in reader.store or name in quantized or (left_out and name.startswith(left_out)):
            continue
        if tied and name.endswith("lm_head.weight"):
            continue
        findings.error(f"{name} of the original model is missing from the export")


def check_export(
    save_path: str | Path,
    *,
    reference: Mapping[str, QuantizedWeight] | None = None,
    model_path: str | Path | None = None,
    formats: FormatRegistry | None = None,
    forward: bool = True,
) -> VerifyReport:
    """:func:`verify_export`, logging its warnings and raising when the export is inconsistent.

    :raises ExportVerificationError: listing the errors (``.report`` holds the full report).
    :raises ExportReadError: when ``save_path`` is missing or holds no known format.
    """
    report = verify_export(
        save_path, reference=reference, model_path=model_path, formats=formats, forward=forward
    )
    for warning in report.warnings:
        logger.warning("%s export: %s", report.format, warning)
    if not report.ok:
        raise ExportVerificationError(report)
    logger.info(
        "verified the %s export: %d quantized layer(s) consistent",
        report.format,
        len(report.layers),
    )
    return report
