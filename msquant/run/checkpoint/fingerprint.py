"""A run's fingerprint: what must not change between a run and its resumption, and the differences
named when it did.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from msquant.run.checkpoint.layout import WORLD_SIZE_HINT
from msquant.version import __version__

__all__ = ["run_fingerprint", "fingerprint_differences"]


_FINGERPRINT_LABELS = {
    "msquant_version": "msquant version",
    "torch_version": "torch version",
    "transformers_version": "transformers version",
    "config_sha256": "config (sha256 of the validated spec)",
    "calibration_sha256": "calibration data (sha256 of the token ids)",
    "model_path": "model path",
    "model_files": "model files",
    "device_kind": "device kind",
    "num_layers": "number of decoder layers",
    "world_size": "number of processes (dp_layer_wise)",
    "model_type": "--model_type (msModelSlim model adapter)",
}


def _model_files(model_dir: Path) -> dict[str, list[int]]:
    """Size and modification time (ns) of the files defining the model: config, weights, code.

    Sizes and times, not hashes: hashing hundreds of GB of weights would cost minutes per run.
    """
    files = {}
    for path in sorted(model_dir.iterdir()):
        name = path.name
        relevant = name == "config.json" or name.endswith((".safetensors", ".index.json", ".py"))
        if relevant and path.is_file():
            stat = path.stat()
            files[name] = [stat.st_size, stat.st_mtime_ns]
    return files


def _package_version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def run_fingerprint(
    *,
    config_sha256: str,
    calibration_sha256: str | None,
    model_dir: Path,
    device_kind: str,
    num_layers: int,
    model_type: str | None = None,
) -> dict[str, Any]:
    """What must not change between a run and its resumption (anything that changes a result;
    ``model_type``: the ``--model_type`` named, None when none)."""
    return {
        "model_type": model_type,
        "msquant_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": _package_version("transformers"),
        "config_sha256": config_sha256,
        "calibration_sha256": calibration_sha256,
        "model_path": str(Path(model_dir).expanduser().absolute()),
        "model_files": _model_files(Path(model_dir)),
        "device_kind": device_kind,
        "num_layers": num_layers,
    }


def _short(value: Any) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 16 else str(value)


# Shown whole in messages: two paths cut to 12 characters often look identical.
_SHOWN_WHOLE = frozenset({"model_path"})


def _files_difference(then: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    parts = [f"{name} removed" for name in sorted(set(then) - set(now))]
    parts += [f"{name} added" for name in sorted(set(now) - set(then))]
    parts += [
        f"{name} changed (size or modification time)"
        for name in sorted(set(then) & set(now))
        if list(then[name]) != list(now[name])
    ]
    return ", ".join(parts)


def fingerprint_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per input that differs between a checkpoint and the run resuming it."""
    lines = []
    for key, label in _FINGERPRINT_LABELS.items():
        then, now = recorded.get(key), current.get(key)
        if then == now:
            continue
        if key == "model_files":
            lines.append(f"{label}: {_files_difference(then or {}, now or {})}")
        elif key == "world_size":
            lines.append(f"{label}: {then} then, {now} now; {WORLD_SIZE_HINT}")
        elif key in _SHOWN_WHOLE:
            lines.append(f"{label}: {then} then, {now} now")
        else:
            lines.append(f"{label}: {_short(then)} then, {_short(now)} now")
    return lines
