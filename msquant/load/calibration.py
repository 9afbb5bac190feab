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
from dataclasses import dataclass
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
    "DEFAULT_MAX_SAMPLE_TOKENS",
    "SampleLimit",
]

TEXT_KEYS = ("inputs_pretokenized", "text")
# msModelSlim's default dataset name; a config naming it gets msquant's shipped set instead.
DEFAULT_DATASET_ALIASES = ("mix_calib.jsonl",)
SUFFIXES = (".jsonl", ".json", ".txt")
logger = logging.getLogger(__name__)


#: The longest calibration sample (in tokens) a run takes whole by default, unless the model's
#: context (``max_position_embeddings``) is longer: about four minutes of attention on a CPU for a
#: 64-wide two-layer model, and hours for an unknowingly huge sample (a book on one line).
DEFAULT_MAX_SAMPLE_TOKENS = 65536


@dataclass(frozen=True)
class SampleLimit:
    """The most tokens one calibration sample may have without ``--max_calib_tokens``, and why.

    :param tokens: the limit.
    :param context: the model's ``max_position_embeddings`` (None when unknown).
    """

    tokens: int
    context: int | None = None

    @classmethod
    def for_model(cls, model_config: Any) -> SampleLimit:
        """The larger of :data:`DEFAULT_MAX_SAMPLE_TOKENS` and the model's context length."""
        context = getattr(model_config, "max_position_embeddings", None)
        context = context if isinstance(context, int) and context > 0 else None
        return cls(max(DEFAULT_MAX_SAMPLE_TOKENS, context or 0), context)

    def message(self, number: int, count: int, tokens: int) -> str:
        """Why sample ``number`` of ``count`` (``tokens`` long) is refused, and what to do."""
        context = (
            "" if self.context is None else f", the model's max_position_embeddings {self.context}"
        )
        return (
            f"calibration sample {number} of {count} has {tokens} tokens, more than the "
            f"{self.tokens} a sample may have whole (the larger of {DEFAULT_MAX_SAMPLE_TOKENS}"
            f"{context}): each sample goes through attention at once, in time growing with its "
            "length squared. Split the text into shorter samples (one per line in .jsonl, "
            "separated by blank lines in .txt), or pass --max_calib_tokens N (Python: "
            "max_calib_tokens=N) to keep the first N tokens of every sample (any N: it is then "
            "your limit)"
        )


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
    if name in MSMODELSLIM_MEDIA_SETS:  # image folders, even where msModelSlim provides them
        refuse_msmodelslim_dataset(name)
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
        texts = _parse_text(content, file)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationDataError(f"{role} file {file} contains no text samples")
    return texts


def _parse_text(content: str, file: Path) -> list[str]:
    """The blank-line separated samples of a ``.txt`` file, each checked to be text."""
    texts, line = [], 1
    for block in content.split("\n\n"):
        texts.append(_checked(block.strip(), f"{file} line {line}"))
        line += block.count("\n") + 2
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
        texts.append(_checked(_text_of(item, f"{file} line {number}"), f"{file} line {number}"))
    return texts


def _checked(text: str, where: str) -> str:
    """``text``, refused when it cannot be text for a tokenizer: a NUL character (a binary file,
    or a broken export) or a lone surrogate (half of an escaped UTF-16 pair, ``\\ud800``, which
    is not Unicode; tokenizers fail on it with a TypeError)."""
    nul = text.find("\x00")
    if nul >= 0:
        raise CalibrationDataError(
            f"{where}: holds a NUL character (U+0000) at character {nul + 1}, which is not text "
            "(a binary file, or a broken conversion?); remove it from the sample"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise CalibrationDataError(
            f"{where}: holds a lone surrogate (U+{code:04X}) at character {exc.start + 1}, which "
            "is not valid Unicode (half of an escaped UTF-16 pair such as \\ud83d\\ude00 "
            "written without its other half); fix or remove the escape"
        ) from None
    return text


def _parse_json(content: str, file: Path) -> list[str]:
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        raise CalibrationDataError(
            f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})"
        ) from exc
    if not isinstance(data, list):
        raise CalibrationDataError(f"{file}: a .json calibration file must hold a list of strings")
    return [
        _checked(_text_of(item, f"{file} item {i}"), f"{file} item {i}")
        for i, item in enumerate(data)
    ]


#: Keys of msModelSlim's multimodal calibration samples (``{"image": "a.jpg", "text": ...}``).
MEDIA_KEYS = ("image", "images", "video", "videos", "audio")


def _text_of(item: Any, where: str) -> str:
    if isinstance(item, str):
        return item
    media = [key for key in MEDIA_KEYS if isinstance(item, dict) and item.get(key)]
    if media:
        raise CalibrationDataError(
            f"{where}: a multimodal sample (its {media[0]!r} key); msquant reads text samples "
            "from a calibration file, and images only as a folder of .jpg / .png files (each "
            "paired with spec.default_text of a vision-language config), so drop the "
            f"{media[0]!r} key, or put the images in a folder and name it in spec.dataset"
        )
    if isinstance(item, dict):
        for key in TEXT_KEYS:
            if isinstance(item.get(key), str):
                return str(item[key])
    raise CalibrationDataError(
        f"{where}: expected a string or an object with a string under one of {', '.join(TEXT_KEYS)}"
    )


def tokenize_samples(
    texts: Sequence[str],
    tokenizer: Any,
    max_length: int | None = None,
    longest: SampleLimit | None = None,
) -> list[torch.Tensor]:
    """Tokenize each sample on its own (no padding), as ``[1, seq]`` int64 ``input_ids`` tensors.

    :param max_length: truncate samples to this many tokens (``None`` keeps them whole).
    :param longest: without ``max_length``, the most tokens a sample may have (a longer one is
        refused: one sample goes through attention whole, whose cost grows with its length
        squared; a ``.txt`` file without blank lines is a single sample).
    :raises CalibrationDataError: if no sample yields any token, or one is longer than
        ``longest``.
    """
    if max_length is not None and max_length < 1:
        raise CalibrationDataError(f"max_calib_tokens must be a positive integer, got {max_length}")
    samples = []
    for number, text in enumerate(texts, start=1):
        ids = tokenizer(
            text,
            return_tensors="pt",
            truncation=max_length is not None,
            max_length=max_length,
        )["input_ids"]
        if max_length is None and longest is not None and ids.shape[-1] > longest.tokens:
            raise CalibrationDataError(longest.message(number, len(texts), int(ids.shape[-1])))
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
