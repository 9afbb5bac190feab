"""Configs and float64 references shared by the activation-scheme tests of the Ascend and the
compressed-tensors exports (tests/processors/test_activation_schemes.py,
tests/processors/test_compressed_tensors_w8a8.py)."""

from __future__ import annotations

from typing import Any

import torch

WEIGHT = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
WEIGHT_INT4 = {**WEIGHT, "dtype": "int4"}
#: Calibration samples truncated to this many tokens: all of equal length, so the runner would
#: stack them into one batch if the online schedule did not ask for one sample at a time.
CALIB_TOKENS = 16


def act(scope: str = "per_tensor", symmetric: bool = False) -> dict[str, Any]:
    return {"dtype": "int8", "scope": scope, "symmetric": symmetric, "method": "minmax"}


def config(
    act_cfg: dict[str, Any],
    saver: str = "ascendv1_saver",
    weight: dict[str, Any] = WEIGHT,
    **entry: Any,
) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"act": act_cfg, "weight": weight}, **entry}
            ],
            "save": [{"type": saver, "part_file_size": 0}],
        },
    }


def reference_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per-channel symmetric codes and scales in float64 (msModelSlim's formula)."""
    w = weight.double()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).eps) / 127
    return torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8), scale
