"""Vision-language models: which part is the text decoder msquant quantizes, and which parts
(vision tower, projector) it keeps as they are.

A vision-language model of transformers (Qwen3-VL, Qwen3.5, InternVL, Kimi-K2.5, ...) holds a
text decoder (``model.language_model``) beside a vision tower (``model.visual``,
``model.vision_tower``) and a projector (``model.multi_modal_projector``, ``model.mm_projector``,
or a merger inside the tower) whose output replaces the image tokens' embeddings. msquant's layer
loop walks the text decoder's layers and calibrates on text; the other parts are not walked, so
their weights are exported unchanged (as float). msModelSlim walks the vision tower and the
projector too, each as one unit, and quantizes the linear layers its scopes reach there, with
image calibration data. msquant quantizes the linears a config selects there only when their
scheme needs no calibration data (:mod:`msquant.run.vision_stage`); a config selecting them with
one that does is refused (:mod:`msquant.planning.vision_scopes`), as is a residual-stream
rotation, whose projector output would have to be rotated as well.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["is_vision_language", "text_decoder_name", "vision_parts"]


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` (a transformers config, or a model holding one) is a vision-language
    model's: a ``vision_config`` beside the text model, and transformers builds it as an
    image-text-to-text model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = getattr(config, "config", config)
    model_type = getattr(config, "model_type", None)
    return (
        getattr(config, "vision_config", None) is not None
        and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def text_decoder_name(model: nn.Module) -> str | None:
    """Full name of a vision-language model's text decoder (``model.language_model``); None for
    any other model, or when its text decoder cannot be told apart."""
    if not is_vision_language(model):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        return None
    for name, module in model.named_modules():
        if module is decoder:
            return name
    return None


def vision_parts(model: nn.Module, head: str | None = None) -> list[tuple[str, nn.Module]]:
    """``(full name, module)`` of each part of a vision-language model outside its text decoder
    that holds linear layers (the vision tower, the projector), in model order; empty for a
    text-only model. ``head``: the output head's name, which is not one of them."""
    decoder = text_decoder_name(model)
    if decoder is None:
        return []
    parts = []
    owner = decoder.rsplit(".", 1)[0] if "." in decoder else ""
    containers = [owner, ""] if owner else [""]
    seen = {decoder, owner, head}
    for container in containers:
        holder = model.get_submodule(container)
        for child, module in holder.named_children():
            name = f"{container}.{child}" if container else child
            if name in seen:
                continue
            seen.add(name)
            if any(isinstance(m, nn.Linear) for m in module.modules()):
                parts.append((name, module))
    return parts
