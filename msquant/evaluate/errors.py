"""The error of an evaluation that cannot run as asked."""

from __future__ import annotations

from msquant.errors import MsquantInputError

__all__ = ["EvaluationError"]


class EvaluationError(MsquantInputError):
    """The evaluation cannot run as asked: data file, window settings or model do not fit."""
