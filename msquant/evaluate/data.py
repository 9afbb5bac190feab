"""The evaluation text: a local file read like a calibration file (``.txt``, ``.jsonl``, ``.json``),
its samples joined with blank lines and tokenized once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from msquant.errors import CalibrationDataError
from msquant.evaluate.errors import EvaluationError
from msquant.load.calibration import read_calibration_texts

__all__ = [
    "SAMPLE_SEPARATOR",
    "read_eval_tokens",
    "read_eval_texts",
    "tokenize_eval_texts",
    "file_sha256",
]


SAMPLE_SEPARATOR = "\n\n"


def read_eval_tokens(data_path: str | Path, tokenizer: Any) -> torch.Tensor:
    """The token ids (1-D int64) of a text file's samples joined with blank lines.

    The file is read like a calibration file (:func:`msquant.load.calibration.read_calibration_texts`).

    :raises EvaluationError: when the file is missing, unreadable, malformed or yields no token.
    """
    path = Path(data_path)
    return tokenize_eval_texts(read_eval_texts(path), tokenizer, path)


def read_eval_texts(path: Path) -> list[str]:
    """The samples of an evaluation text file, read like a calibration file.

    :raises EvaluationError: when the file is missing, unreadable or malformed.
    """
    try:
        return read_calibration_texts(path, role="evaluation data")
    except CalibrationDataError as exc:
        raise EvaluationError(str(exc)) from exc


def tokenize_eval_texts(texts: Sequence[str], tokenizer: Any, path: Path) -> torch.Tensor:
    """The samples joined with blank lines, tokenized once; at least 2 tokens."""
    text = SAMPLE_SEPARATOR.join(texts)
    ids = tokenizer(text, return_tensors="pt", verbose=False)["input_ids"].reshape(-1)
    if ids.numel() < 2:
        raise EvaluationError(
            f"evaluation data file {path} yields {ids.numel()} token(s); at least 2 are needed"
        )
    return ids.to(torch.long)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (``sha256sum`` prints the same).

    :raises EvaluationError: when the file cannot be read.
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise EvaluationError(f"cannot read evaluation data file {path}: {exc.strerror}") from None
    return digest.hexdigest()
