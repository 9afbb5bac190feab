"""The quantized linears of finished layers, kept on disk: a checkpointed run's layer store, or a
streamed run's reference of its released layers for the read-back check. In a run whose processors
transform float weights, a layer's file also holds the layer's other tensors (norms, biases, float
linears) as the processors left them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from msquant.quant.activation import ActivationQuant
from msquant.quant.quantized_linear import QuantizedLinear, replace_module
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.quant.value_types import ValueType, int_value_type, value_type_named
from msquant.run.checkpoint.durable import save_tensors_atomically
from msquant.run.checkpoint.layout import ResumeError

__all__ = ["LayerStore"]


_PARTS = ("codes", "scale", "offset")
#: The metadata key of a file's float tensors (``save(..., floats=True)``).
_FLOATS = "floats"


class LayerStore(Mapping[str, QuantizedWeight]):
    """The quantized linears of finished layers, one safetensors file per layer, kept across runs.

    A read-only mapping ``module name ->`` :class:`~msquant.plugin.QuantizedWeight`, read from disk on
    demand: in a streamed run it is the reference of the read-back check for the layers released
    from memory (the checkpoints' store, or without checkpoints a scratch one: ``ctx.spill``).

    :param directory: where the files go (created on first use).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._modules: dict[str, tuple[Path, dict[str, Any]]] = {}
        self._floats: dict[str, list[str]] = {}  # key -> its float tensors' names

    def path(self, key: str) -> Path:
        """The file of ``key`` (a layer index as ``00003``, or ``outside``)."""
        return self.directory / f"{key}.safetensors"

    def save(
        self,
        key: str,
        root: nn.Module,
        prefix: str,
        exclude: Sequence[str] = (),
        floats: bool = False,
    ) -> list[str]:
        """Write every :class:`QuantizedLinear` with data under ``root`` (full names under
        ``prefix``; those under an ``exclude`` prefix skipped) as ``key``'s file.

        :param floats: also write every other tensor of ``root``'s state (norms, biases, float
            linears, buffers; those with data, outside the quantized linears and ``exclude``),
            as they are: what a processor that transforms float weights changed in them is
            restored with them (:meth:`rebuild`).
        :returns: the names of the quantized linears written.
        """
        tensors: dict[str, torch.Tensor] = {}
        entries: dict[str, dict[str, Any]] = {}
        for name, module in root.named_modules(prefix=prefix):
            if not isinstance(module, QuantizedLinear) or module.weight.is_meta:
                continue
            if _under(name, exclude):
                continue
            qweight = module.qweight
            for part in _PARTS:
                tensors[f"{name}.{part}"] = getattr(qweight, part).detach().to("cpu").contiguous()
            bias = module.bias
            if bias is not None:
                tensors[f"{name}.bias"] = bias.detach().to("cpu").contiguous()
            entries[name] = {
                "bits": qweight.bits,
                "symmetric": qweight.symmetric,
                "group_size": qweight.group_size,
                "method": module.method,
                "act_order": module.act_order,
                "act": None if module.act is None else module.act.to_json(),
                "shape": list(qweight.shape),
                "bias": None if bias is None else str(bias.dtype).removeprefix("torch."),
            }
            if qweight.value_type != int_value_type(qweight.bits):  # integer codes: implied
                entries[name]["value_type"] = qweight.value_type.name
        metadata = {"modules": json.dumps(entries)}
        if floats:
            kept = _float_state(root, prefix, [*exclude, *_quantized_names(root, prefix)])
            tensors.update(kept)
            metadata[_FLOATS] = json.dumps(list(kept))
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        save_tensors_atomically(tensors, path, metadata)
        self._modules.update({name: (path, entry) for name, entry in entries.items()})
        return list(entries)

    def load(self, key: str) -> dict[str, dict[str, Any]]:
        """Index ``key``'s file (written by an earlier run); returns its modules' entries.

        :raises ResumeError: when the file is missing or unreadable.
        """
        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            entries: dict[str, dict[str, Any]] = json.loads(metadata["modules"])
            self._floats[key] = json.loads(metadata.get(_FLOATS, "[]"))
        except (OSError, SafetensorError, KeyError, json.JSONDecodeError) as error:
            raise ResumeError(
                f"the checkpoint file {path} is missing or damaged ({error}); the interrupted run "
                "cannot be resumed: start over with --overwrite (without --resume)"
            ) from error
        self._modules.update({name: (path, entry) for name, entry in entries.items()})
        return entries

    def rebuild(self, model: nn.Module, key: str, weightless: bool) -> None:
        """Put ``key``'s quantized linears back into ``model`` in place of its float ones, and
        the float tensors stored with them (``save(..., floats=True)``) in place of the loaded
        ones.

        :param weightless: build them on the meta device (a streamed run's released layers),
            without reading their tensors (nor setting the float ones).
        """
        for name, entry in self.load(key).items():
            try:
                current = model.get_submodule(name)
            except AttributeError:
                raise ResumeError(
                    f"{name}: the checkpoint holds a quantized linear the model does not have: "
                    "the model changed since the run started"
                ) from None
            shape = tuple(entry["shape"])
            found = tuple(getattr(current, "weight", torch.empty(0)).shape)
            if not isinstance(current, nn.Linear | QuantizedLinear) or found != shape:
                raise ResumeError(
                    f"{name}: the checkpoint holds a quantized linear {shape}, the model has "
                    f"{type(current).__name__} {found}: the model changed since the run started"
                )
            qweight, bias = (
                self._weightless(entry) if weightless else (self[name], self._bias(name))
            )
            replace_module(
                model,
                name,
                QuantizedLinear(
                    qweight,
                    bias,
                    entry["method"],
                    entry.get("act_order", False),
                    None if entry.get("act") is None else ActivationQuant.from_json(entry["act"]),
                ),
            )
        if not weightless:
            self._restore_floats(model, key)

    def _restore_floats(self, model: nn.Module, key: str) -> None:
        """Set the float tensors of ``key``'s file into ``model`` (each a parameter or buffer
        of its own: a head a processor untied from the embedding stays untied)."""
        names = self._floats.get(key, [])
        if not names:
            return
        with safe_open(str(self.path(key)), framework="pt") as handle:
            for name in names:
                _set_tensor(model, name, handle.get_tensor(name))

    @staticmethod
    def _weightless(entry: Mapping[str, Any]) -> tuple[QuantizedWeight, torch.Tensor | None]:
        out_features, in_features = entry["shape"]
        group_size = entry["group_size"]
        groups = 1 if group_size is None else in_features // group_size
        meta = torch.device("meta")
        values = _value_type(entry)
        qweight = QuantizedWeight(
            torch.empty(out_features, in_features, dtype=values.code_dtype, device=meta),
            torch.empty(out_features, groups, dtype=torch.float32, device=meta),
            torch.empty(out_features, groups, dtype=torch.float32, device=meta),
            entry["bits"],
            entry["symmetric"],
            group_size,
            values,
        )
        dtype = entry["bias"]
        if dtype is None:
            return qweight, None
        return qweight, torch.empty(out_features, dtype=getattr(torch, dtype), device=meta)

    def _bias(self, name: str) -> torch.Tensor | None:
        path, entry = self._modules[name]
        if entry["bias"] is None:
            return None
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(f"{name}.bias")

    def __getitem__(self, name: str) -> QuantizedWeight:
        path, entry = self._modules[name]
        with safe_open(str(path), framework="pt") as handle:
            codes, scale, offset = (handle.get_tensor(f"{name}.{part}") for part in _PARTS)
        return QuantizedWeight(
            codes,
            scale,
            offset,
            entry["bits"],
            entry["symmetric"],
            entry["group_size"],
            _value_type(entry),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


def _value_type(entry: Mapping[str, Any]) -> ValueType:
    """The codes' value type of a checkpoint entry (integers of ``bits`` when not named)."""
    name = entry.get("value_type")
    return int_value_type(entry["bits"]) if name is None else value_type_named(name)


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _quantized_names(root: nn.Module, prefix: str) -> list[str]:
    return [n for n, m in root.named_modules(prefix=prefix) if isinstance(m, QuantizedLinear)]


def _float_state(root: nn.Module, prefix: str, skip: Sequence[str]) -> dict[str, torch.Tensor]:
    """``root``'s state with data, by full name, but what lies under a ``skip`` module."""
    state = root.state_dict(prefix=f"{prefix}." if prefix else "")
    return {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in state.items()
        if not tensor.is_meta and not _under(name.rpartition(".")[0], skip)
    }


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the parameter or buffer ``name`` of ``model`` (a parameter the model does
    not have yet, such as a norm bias a processor added, is created)."""
    owner, _, attribute = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        raise ResumeError(
            f"{name}: the checkpoint holds a tensor the model does not have: the model changed "
            "since the run started"
        ) from None
    current = getattr(module, attribute, None)
    if isinstance(current, torch.Tensor) and not current.is_meta:
        tensor = tensor.to(current.device)
    if attribute in module._buffers:
        module._buffers[attribute] = tensor
        return
    grad = isinstance(current, nn.Parameter) and current.requires_grad
    setattr(
        module, attribute, nn.Parameter(tensor, requires_grad=grad and tensor.is_floating_point())
    )
