"""Calibration data: read text samples from a local file and tokenize them.

Accepted files (msModelSlim's formats plus plain text):

* ``.jsonl``: one JSON object per line with the text under ``inputs_pretokenized`` or ``text``
  (a bare JSON string per line is accepted too);
* ``.json``: a list of strings;
* ``.txt``: samples separated by blank lines.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from msquant.errors import CalibrationDataError
from msquant.load.msmodelslim_datasets import (
    MSMODELSLIM_MEDIA_SETS,
    MSMODELSLIM_TEXT_SETS,
    msmodelslim_lab_calib,
    refuse_msmodelslim_dataset,
)

__all__ = [
    "TEXT_KEYS",
    "DEFAULT_DATASET_ALIASES",
    "default_dataset_path",
    "read_calibration_texts",
    "resolve_dataset_path",
    "tokenize_samples",
]

TEXT_KEYS = ("inputs_pretokenized", "text")
# msModelSlim's default dataset name; a config naming it gets msquant's shipped set instead.
DEFAULT_DATASET_ALIASES = ("mix_calib.jsonl",)
SUFFIXES = (".jsonl", ".json", ".txt")
logger = logging.getLogger(__name__)


def default_dataset_path() -> Path:
    """The calibration set shipped with msquant (prose, code and dialogue written for it)."""
    return Path(str(files("msquant") / "data" / "default_calib.jsonl"))


def resolve_dataset_path(name: str, config_dir: Path | None) -> Path:
    """Resolve ``spec.dataset``: an absolute path, else relative to the CWD, else to the YAML's
    folder; then one of msModelSlim's dataset names (``boolq.jsonl``), read from an installed
    msModelSlim's ``lab_calib`` folder; without one, its default name (``mix_calib.jsonl``) maps
    to the shipped set and the others are refused.

    :raises CalibrationDataError: for an msModelSlim dataset name that cannot be resolved.
    """
    path = Path(name).expanduser()
    if path.is_absolute() or path.exists():
        return path
    beside_config = config_dir / path if config_dir is not None else path
    if beside_config.exists():
        return beside_config
    if name not in MSMODELSLIM_TEXT_SETS | MSMODELSLIM_MEDIA_SETS:
        return path
    lab_calib = msmodelslim_lab_calib()
    if lab_calib is not None and (lab_calib / name).exists():
        logger.info("dataset %s: read from msModelSlim's %s", name, lab_calib)
        return lab_calib / name
    if name in DEFAULT_DATASET_ALIASES:
        logger.info("dataset %s: using msquant's shipped default calibration set", name)
        return default_dataset_path()
    refuse_msmodelslim_dataset(name)


def read_calibration_texts(path: str | Path, role: str = "calibration") -> list[str]:
    """Read the text samples of a calibration file (or any text file in the same formats).

    :param role: what the file is for, in messages (``"evaluation data"`` for ``msquant eval``).
    :raises CalibrationDataError: when the file is missing, unreadable, malformed or has no samples.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise CalibrationDataError(f"{role} file {file} {what}")
    if file.suffix not in SUFFIXES:
        raise CalibrationDataError(
            f"{role} file {file} has unsupported extension {file.suffix!r}; "
            f"use one of {', '.join(SUFFIXES)}"
        )
    try:
        content = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationDataError(f"cannot read {role} file {file}: {exc}") from exc
    if file.suffix == ".jsonl":
        texts = _parse_jsonl(content, file)
    elif file.suffix == ".json":
        texts = _parse_json(content, file)
    else:
        texts = [block.strip() for block in content.split("\n\n")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationDataError(f"{role} file {file} contains no text samples")
    return texts


def _parse_jsonl(content: str, file: Path) -> list[str]:
    texts = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationDataError(f"{file} line {number}: not valid JSON ({exc.msg})") from exc
        texts.append(_text_of(item, f"{file} line {number}"))
    return texts


def _parse_json(content: str, file: Path) -> list[str]:
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        raise CalibrationDataError(
            f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})"
        ) from exc
    if not isinstance(data, list):
        raise CalibrationDataError(f"{file}: a .json calibration file must hold a list of strings")
    return [_text_of(item, f"{file} item {i}") for i, item in enumerate(data)]


def _text_of(item: Any, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in TEXT_KEYS:
            if isinstance(item.get(key), str):
                return str(item[key])
    raise CalibrationDataError(
        f"{where}: expected a string or an object with a string under one of {', '.join(TEXT_KEYS)}"
    )


def tokenize_samples(
    texts: Sequence[str], tokenizer: Any, max_length: int | None = None
) -> list[torch.Tensor]:
    """Tokenize each sample on its own (no padding), as ``[1, seq]`` int64 ``input_ids`` tensors.

    :param max_length: truncate samples to this many tokens (``None`` keeps them whole).
    :raises CalibrationDataError: if no sample yields any token.
    """
    if max_length is not None and max_length < 1:
        raise CalibrationDataError(f"max_calib_tokens must be a positive integer, got {max_length}")
    samples = []
    for text in texts:
        ids = tokenizer(
            text,
            return_tensors="pt",
            truncation=max_length is not None,
            max_length=max_length,
        )["input_ids"]
        if ids.shape[-1] > 0:
            samples.append(ids.to(torch.long))
    if not samples:
        raise CalibrationDataError("no calibration sample produced any token")
    if len(samples) < len(texts):
        logger.warning(
            "%d calibration sample(s) produced no tokens and were skipped",
            len(texts) - len(samples),
        )
    return samples
