"""Reading exports back and checking them: ``msquant verify`` and the check ``quantize`` runs.

The engine keeps the reader contract (:class:`~msquant.verify.base.ExportReader`), the shared
machinery (safetensors headers, unpacking, comparisons, checksums, reports) and the detection
loop over the format registry (:mod:`msquant.contracts.format`); the readers themselves belong to the
formats. Every format's reader is written from the format's specification, independently of its
packer (readers never import packers), so an exporter bug cannot hide behind the same bug here.
"""

from msquant.verify.compare import relative_error_bound
from msquant.verify.core import check_export, verify_export
from msquant.verify.detect import detect_format, export_folders, hf_quant_method, read_model_config
from msquant.verify.errors import ExportReadError, ExportVerificationError
from msquant.verify.report import LayerReport, VerifyReport, render_table

__all__ = [
    "verify_export",
    "check_export",
    "detect_format",
    "export_folders",
    "hf_quant_method",
    "read_model_config",
    "VerifyReport",
    "LayerReport",
    "render_table",
    "relative_error_bound",
    "ExportReadError",
    "ExportVerificationError",
]
