"""Exceptions of export verification.

:class:`ExportReadError` means the folder cannot be verified at all (missing, not a directory, no
export format recognized): the user's input is wrong, so it is a :class:`MsquantInputError`.
:class:`ExportVerificationError` means the folder was read and found inconsistent: an exporter
wrote something its consumers would reject or mis-read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msquant.errors import MsquantError, MsquantInputError

if TYPE_CHECKING:
    from msquant.verify.report import VerifyReport

__all__ = ["ExportReadError", "ExportVerificationError"]

# How many errors the exception message lists before summarizing the rest.
MAX_LISTED_ERRORS = 20


class ExportReadError(MsquantInputError):
    """The save path is missing, not a directory, or holds no export format msquant can read."""


class ExportVerificationError(MsquantError):
    """An export failed verification; ``report`` holds every finding, the message lists the errors."""

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        errors = report.errors
        count = len(errors)
        lines = [
            f"{report.format} export {report.path} failed verification "
            f"({count} error{'s' if count != 1 else ''}):"
        ]
        lines += [f"  - {error}" for error in errors[:MAX_LISTED_ERRORS]]
        if count > MAX_LISTED_ERRORS:
            lines.append(
                f"  ... and {count - MAX_LISTED_ERRORS} more (msquant verify --json lists all)"
            )
        super().__init__("\n".join(lines))
