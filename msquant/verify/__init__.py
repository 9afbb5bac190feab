"""Reading exports back and checking them: ``msquant verify`` and the check ``quantize`` runs.

Every format has its own reader written from the format's specification, independently of the
exporters (no shared packing code), so an exporter bug cannot hide behind the same bug here.
"""

from msquant.verify.compare import relative_error_bound
from msquant.verify.core import check_export, verify_export
from msquant.verify.detect import FORMATS, detect_format, export_folders
from msquant.verify.errors import ExportReadError, ExportVerificationError
from msquant.verify.report import LayerReport, VerifyReport, render_table

__all__ = [
    "verify_export",
    "check_export",
    "detect_format",
    "export_folders",
    "FORMATS",
    "VerifyReport",
    "LayerReport",
    "render_table",
    "relative_error_bound",
    "ExportReadError",
    "ExportVerificationError",
]
