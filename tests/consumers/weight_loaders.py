"""Run an engine's own weight loaders on an export's tensors.

The shape comparison of :mod:`loading` describes how the loaders combine tensors; where the
outcome depends on a loader's own code (the padded vocabulary of a quantized head), the tests
call the loader itself: every parameter of a real engine layer gets ``param.weight_loader(param,
tensor)`` with the checkpoint tensor of the same name, as the engines' ``load_weights`` do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors ``<prefix>.<leaf>`` of the export, by leaf."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if name.startswith(f"{prefix}.") and "." not in name[len(prefix) + 1 :]:
                    found[name[len(prefix) + 1 :]] = handle.get_tensor(name)
    return found


def load_layer(layer: torch.nn.Module, folder: Path, prefix: str) -> dict[str, str | None]:
    """Load every parameter of ``layer`` from the export with the parameter's own weight loader.

    :returns: parameter name -> None when it loaded, else the loader's exception (type and
        message); a parameter without a checkpoint tensor maps to ``"missing"``.
    """
    tensors = checkpoint_tensors(folder, prefix)
    outcome: dict[str, str | None] = {}
    for name, param in layer.named_parameters(recurse=False):
        if name not in tensors:
            outcome[name] = "missing"
            continue
        try:
            with torch.no_grad():
                param.weight_loader(param, tensors[name])  # type: ignore[attr-defined]
        except (RuntimeError, AssertionError, ValueError) as error:
            outcome[name] = f"{type(error).__name__}: {error}"
        else:
            outcome[name] = None
    return outcome
