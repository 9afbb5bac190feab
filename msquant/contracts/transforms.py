"""What processors that transform float weights record of their transforms, for ``msquant verify``.

A rotation or a smoothing changes float tensors into others computing the same function: the
export then differs from the original model tensor by tensor, and its own files say nothing of
which rotation or which scales were applied. Such a processor (``transforms_weights``) writes two
things into the run's :class:`TransformLog` (``ctx.transforms``), which the run stores in
``msquant_export.json`` under ``"transforms"``:

* :meth:`TransformLog.describe`: the transform's parameters (a rotation's seed, block size and the
  sha256 of the matrix applied), checked against the export by the processor's own
  :meth:`msquant.plugin.Processor.check_transform`;
* :meth:`TransformLog.fingerprint`: the sha256 of each float tensor it set (norms folded to a
  constant or divided by smoothing scales, a rotated embedding); the last fingerprint of a tensor
  wins, so a norm quarot set to ones and smoothing then scaled keeps smoothing's. Verify compares
  every such tensor the export stores in float with its fingerprint.

Like the file checksums, these detect a changed export, not a forger who rewrites the marker too;
what verify recomputes on its own (a rotation from its seed, the forward pass against the float
model) does not depend on the marker.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import torch

__all__ = ["TRANSFORMS_KEY", "TransformLog", "TransformedExport", "tensor_sha256"]

#: The key of ``msquant_export.json`` holding :meth:`TransformLog.to_json`.
TRANSFORMS_KEY = "transforms"


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The hex sha256 of a tensor's bytes as stored (row-major, its own dtype)."""
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256()
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class TransformLog:
    """The transforms of one run, in the order they were made (see the module doc)."""

    def __init__(self) -> None:
        self.processors: list[dict[str, Any]] = []
        self.tensors: dict[str, dict[str, str]] = {}

    def describe(self, type_name: str, **params: Any) -> None:
        """Record a transform's parameters (JSON values) under its processor's ``type_name``."""
        self.processors.append({"type": type_name, **params})

    def fingerprint(self, type_name: str, name: str, tensor: torch.Tensor) -> None:
        """Record the value a processor left a float tensor with: ``name`` as the export names it
        (``ctx.disk_name``), its dtype and sha256 (replacing an earlier fingerprint of it)."""
        self.tensors[name] = {
            "by": type_name,
            "dtype": dtype_name(tensor.dtype),
            "sha256": tensor_sha256(tensor),
        }

    def state(self) -> dict[str, Any]:
        """Everything recorded, as JSON-able data (a checkpoint of the run; :meth:`restore`)."""
        return {"processors": list(self.processors), "tensors": dict(self.tensors)}

    def restore(self, state: dict[str, Any]) -> None:
        """Replace everything recorded by a :meth:`state` (a resumed run takes up its
        checkpoint's records)."""
        self.processors = [dict(entry) for entry in state["processors"]]
        self.tensors = {name: dict(entry) for name, entry in state["tensors"].items()}

    def to_json(self) -> dict[str, Any] | None:
        """The marker's ``"transforms"`` value; None when nothing was recorded."""
        if not self.processors and not self.tensors:
            return None
        return {"processors": self.processors, "tensors": dict(sorted(self.tensors.items()))}


class TransformedExport(Protocol):
    """What :meth:`msquant.plugin.Processor.check_transform` may read of an export."""

    def optional_tensor(self, scope: str, name: str) -> torch.Tensor | None:
        """A tensor processors asked savers to ship beside the weights (``ctx.optional_tensors``
        ``{scope: {name: tensor}}``), as the export stores it; None when the format has none."""
        ...
