"""Find a transformer's decoder layers generically (no per-architecture list).

The decoder stack is the ``nn.ModuleList`` whose children all share one class and which holds the
most parameters; this finds ``model.layers`` in Llama, Qwen2/3, Mistral and most decoder-only models
while ignoring smaller lists such as MoE experts inside a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from msquant.errors import ModelLoadError
from msquant.model.vision import text_decoder_name

__all__ = ["DecoderLayer", "find_decoder_layers", "layer_list_name", "parent_module"]


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer of the model being quantized.

    :param index: position in the model's layer list.
    :param name: full module name, e.g. ``model.layers.3``.
    :param module: the layer module itself.
    """

    index: int
    name: str
    module: nn.Module

    def named_linears(self) -> list[tuple[str, nn.Linear]]:
        """``(full module name, module)`` of every ``nn.Linear`` inside this layer, in order."""
        return [
            (f"{self.name}.{sub}", mod)
            for sub, mod in self.module.named_modules()
            if isinstance(mod, nn.Linear)
        ]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_decoder_layers(model: nn.Module) -> list[DecoderLayer]:
    """The model's decoder layers in execution order.

    A vision-language model's layers are searched in its text decoder only
    (:func:`~msquant.model.vision.text_decoder_name`): its vision tower has layer lists too.

    :raises ModelLoadError: when the model has no homogeneous ``nn.ModuleList`` of layers.
    """
    decoder = text_decoder_name(model)
    best: tuple[int, int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if decoder is not None and not name.startswith(f"{decoder}."):
            continue
        if len({type(child) for child in module}) != 1:
            continue
        # Prefer more parameters, then shallower names (a stable, architecture-free tie-break).
        key = (_numel(module), -name.count("."), name, module)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        raise ModelLoadError(
            f"cannot find the decoder layers of {type(model).__name__}: "
            "no nn.ModuleList of identical layers was found"
        )
    _, _, name, layers = best
    return [DecoderLayer(i, f"{name}.{i}", layer) for i, layer in enumerate(layers)]


def layer_list_name(layers: list[DecoderLayer]) -> str:
    """Full name of the ``nn.ModuleList`` holding the layers (e.g. ``model.layers``)."""
    return layers[0].name.rsplit(".", 1)[0]


def parent_module(model: nn.Module, layers: list[DecoderLayer]) -> nn.Module:
    """The module that owns the decoder layer list (e.g. ``LlamaModel`` for ``model.layers``)."""
    list_name = layer_list_name(layers)
    parent_name = list_name.rsplit(".", 1)[0] if "." in list_name else ""
    return model.get_submodule(parent_name)
