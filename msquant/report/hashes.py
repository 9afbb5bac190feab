"""The hashes a run report records of its inputs: the validated config and the calibration token ids
(a resumed run must match them, the regression gate compares them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["config_sha256", "calibration_sha256"]


def config_sha256(config_json: Mapping[str, Any]) -> str:
    """sha256 of a validated config as canonical JSON (``model_dump(mode="json")``, sorted keys)."""
    text = json.dumps(config_json, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def calibration_sha256(samples: Sequence[torch.Tensor] | None) -> str | None:
    """sha256 over the calibration token ids in order; None when no calibration was used.

    Each sample contributes its token count then its ids, all as little-endian int64, so the
    hash changes when ids move between samples as well as when they change.
    """
    if not samples:
        return None
    digest = hashlib.sha256()
    for sample in samples:
        ids = sample.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
        digest.update(int(ids.numel()).to_bytes(8, "little"))
        digest.update(_int64_le_bytes(ids))
    return digest.hexdigest()


def _int64_le_bytes(ids: torch.Tensor) -> bytes:
    data = ids.numpy()
    return bytes(data.astype("<i8", copy=False).tobytes())
