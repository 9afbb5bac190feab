"""What a format reader provides to :func:`msquant.verify_export`, and shared reading helpers."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from msquant.export.links import member
from msquant.model.adapter import ModelAdapter
from msquant.model.adapter_registry import default_adapter_registry
from msquant.verify.layer import DecodedLayer
from msquant.verify.report import Findings, LayerReport
from msquant.verify.tensors import TensorStore

__all__ = [
    "ExportReader",
    "read_json",
    "module_of",
    "ties_word_embeddings",
    "export_config",
    "FLOAT",
]

FLOAT = "FLOAT"  # scheme of an unquantized module in the fused-shard check


def read_json(path: Path, findings: Findings, required: bool = True) -> dict[str, Any] | None:
    """A JSON object from ``path``; records an error when missing (if required) or malformed."""
    if not path.is_file():
        if required:
            findings.error(f"{path.name} is missing")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        findings.error(f"{path.name}: not readable JSON ({exc})")
        return None
    if not isinstance(data, dict):
        findings.error(f"{path.name}: expected a JSON object, got {type(data).__name__}")
        return None
    return data


def export_config(directory: Path) -> dict[str, Any] | None:
    """``config.json`` of an export folder, None when absent or unreadable (the format's reader
    reports that; callers here only want what it says of the model)."""
    try:
        data = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def module_of(tensor_name: str, suffixes: tuple[str, ...]) -> str | None:
    """``P`` when ``tensor_name`` is ``P.<suffix>`` for one of ``suffixes``, else None."""
    module, _, leaf = tensor_name.rpartition(".")
    return module if module and leaf in suffixes else None


def ties_word_embeddings(config: dict[str, Any] | None) -> bool:
    """Whether a model config ties the output head to the input embeddings."""
    if not config:
        return False
    text = config.get("text_config")
    nested = text.get("tie_word_embeddings") if isinstance(text, dict) else None
    return bool(config.get("tie_word_embeddings", nested))


class SchemeLike(Protocol):
    """A format's per-module scheme: comparable key and readable description."""

    def key(self) -> Hashable: ...

    def describe(self) -> str: ...


class ExportReader(ABC):
    """Reads one export format: inventory and metadata checks on construction, layers on demand.

    Subclasses record every problem in ``findings`` instead of raising.
    """

    format_name: str = "unknown"

    def __init__(self, directory: Path, findings: Findings) -> None:
        self.directory = directory
        self.findings = findings
        self.store: TensorStore | None = None
        self.packed: set[str] = set()  # tensors holding quantized data (codes, scales, zeros, ...)

    @cached_property
    def adapter(self) -> ModelAdapter:
        """The exported model's adapter, chosen by ``config.json``'s ``model_type`` (the default
        one when it has none): which stored linears engines load as one fused matrix."""
        config = export_config(self.directory) or {}
        model_type = config.get("model_type")
        return default_adapter_registry().get(model_type if isinstance(model_type, str) else None)

    @abstractmethod
    def quantized_modules(self) -> list[str]:
        """Names of the modules stored quantized, sorted."""

    @abstractmethod
    def decode(self, module: str) -> DecodedLayer | None:
        """Read one quantized module back; None (with errors recorded) when it cannot be."""

    @abstractmethod
    def entry(self, module: str) -> LayerReport:
        """The report entry of a module from metadata alone (filled in further by the caller)."""

    @abstractmethod
    def schemes(self) -> tuple[dict[str, Hashable], dict[str, str]]:
        """Module -> comparable scheme (``FLOAT`` when unquantized) and a readable description,
        for the fused-shard check."""

    def hf_schemes(
        self, modules: list[str], scheme_of: Callable[[str], SchemeLike | None]
    ) -> tuple[dict[str, Hashable], dict[str, str]]:
        """:meth:`schemes` of a Hugging Face checkpoint (GPTQ, compressed-tensors): every stored
        2-D ``.weight`` is a float linear, every quantized module gets ``scheme_of(module)``."""
        schemes: dict[str, Hashable] = {}
        describe: dict[str, str] = {}
        if self.store is None:
            return schemes, describe
        for name in self.store.names():
            if name.endswith(".weight") and len(self.store.infos[name].shape) == 2:
                module = name[: -len(".weight")]
                schemes[module], describe[module] = FLOAT, FLOAT
        for module in modules:
            scheme = scheme_of(module)
            schemes[module] = scheme.key() if scheme is not None else FLOAT
            describe[module] = scheme.describe() if scheme is not None else FLOAT
        return schemes, describe

    def find_packed_modules(
        self, parts: tuple[str, ...], expected: tuple[str, ...], layer_kind: str
    ) -> list[str]:
        """The modules storing any tensor named ``<module>.<part>`` for one of ``parts``, sorted;
        every other tensor stored under such a module (besides ``expected`` and ``bias``) is
        recorded as an error naming the ``layer_kind`` (``GPTQ layer``)."""
        if self.store is None:
            return []
        names = self.store.names()
        modules = sorted({m for n in names if (m := module_of(n, parts)) is not None})
        for module in modules:
            for name in names:
                if not name.startswith(f"{module}."):
                    continue
                if name[len(module) + 1 :] not in (*expected, "bias"):
                    self.findings.error(
                        f"{name}: unexpected tensor for {layer_kind} {module} "
                        f"(expected {', '.join(expected)}, bias)"
                    )
        return modules

    def consumer_notes(self, layer: DecodedLayer) -> None:
        """Record the consumer rules one decoded layer falls under (default: none)."""

    def finish(self) -> None:
        """Record notes that need every layer seen (default: none)."""

    def optional_tensor(self, scope: str, name: str) -> torch.Tensor | None:
        """A tensor a processor asked savers to ship beside the weights (``ctx.optional_tensors``
        ``{scope: {name: tensor}}``, e.g. quarot's rotation), as the export stores it; None when
        the format stores none (default) or this export lacks it (an error is recorded when the
        export names a file it cannot read)."""
        return None

    def file_tensor(self, relative: object, name: str, what: str) -> torch.Tensor | None:
        """Tensor ``name`` of the safetensors file ``relative`` (a path inside the export that
        its metadata ``what`` names); None, with an error recorded, when the path is not a file
        inside the export (never opened then), or the file or tensor cannot be read."""
        path = member(self.directory, relative)
        if path is None:
            self.findings.error(
                f"{what} names {relative!r}, which is not a file inside the export (an absolute "
                "path, '..' or a symbolic link out of it); it was not read"
            )
            return None
        if not path.is_file():
            self.findings.error(f"{what} names {relative}, which is missing from the export")
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(name)
        except (OSError, SafetensorError) as exc:
            self.findings.error(f"{relative}: cannot read tensor {name} named by {what} ({exc})")
            return None

    def float_tensors(self) -> list[str]:
        """Stored tensors that are not part of a quantized layer's data (kept as in the model)."""
        if self.store is None:
            return []
        return [name for name in self.store.names() if name not in self.packed]

    def altered_float_tensors(self) -> set[str]:
        """Float tensors whose values the export's format says a processor changed on purpose
        (e.g. pruned weights): not compared with the original model's (default: none)."""
        return set()

    def expect(
        self,
        name: str,
        dtypes: tuple[torch.dtype, ...],
        shape: tuple[int, ...] | None,
        what: str = "",
    ) -> bool:
        """Check that tensor ``name`` is stored with one of ``dtypes`` and ``shape`` (None: any).

        :returns: whether it passed (errors recorded otherwise).
        """
        if self.store is None:
            return False
        info = self.store.infos.get(name)
        if info is None:
            self.findings.error(f"{name} is missing{what}")
            return False
        ok = True
        if info.dtype not in dtypes:
            wanted = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            self.findings.error(f"{name}: dtype {info.dtype_code}, expected {wanted}")
            ok = False
        if shape is not None and info.shape != shape:
            self.findings.error(f"{name}: shape {list(info.shape)}, expected {list(shape)}{what}")
            ok = False
        return ok
