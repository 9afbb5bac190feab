"""Vision-language models: which part is the text decoder msquant quantizes, and which parts
(vision tower, projector) it keeps as they are.

A vision-language model of transformers (Qwen3-VL, Qwen3.5, InternVL, Kimi-K2.5, ...) holds a
text decoder (``model.language_model``) beside a vision tower (``model.visual``,
``model.vision_tower``) and a projector (``model.multi_modal_projector``, ``model.mm_projector``,
or a merger inside the tower) whose output replaces the image tokens' embeddings. msquant's layer
loop walks the text decoder's layers; the other parts are not walked, so their weights are
exported unchanged (as float) unless a config selects linears there. msModelSlim walks the
vision tower and the projector too, each as one unit, and quantizes the linear layers its scopes
reach there, with image calibration data. msquant quantizes the linears a config selects there
with a data-free scheme, or, when the run calibrates on images
(:mod:`msquant.load.image_calibration`), with static activations calibrated on the images'
forward (:mod:`msquant.run.vision_stage`); a config selecting them with a scheme the run cannot
calibrate is refused (:mod:`msquant.planning.vision_scopes`). A rotation of the residual
stream also rotates the projector linears whose output joins it (:data:`STREAM_FEEDERS`), for
the families where that is known; it is refused for the others. An Omni checkpoint (thinker,
talker, speech decoder) is loaded as its thinker, the part msModelSlim quantizes
(:data:`SUB_MODELS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

__all__ = [
    "BETWEEN_LAYERS",
    "between_layers_method",
    "is_vision_language",
    "multimodal_body_name",
    "other_parts",
    "part_prefix",
    "stream_feeders",
    "quantized_part",
    "text_decoder_name",
    "vision_parts",
]

#: The sub-model of a checkpoint that msquant loads and quantizes, by the checkpoint's
#: ``model_type``: Qwen2.5-Omni and Qwen3-Omni hold a "thinker" (audio tower, vision tower,
#: text decoder: an image-text-to-text model of its own) beside a "talker" and a speech decoder
#: (``token2wav`` / ``code2wav``). msModelSlim 26.1.0 loads and quantizes the thinker only and
#: writes only its tensors, under the checkpoint's ``thinker.`` names
#: (``model/qwen2_5_omni_thinker`` and ``model/qwen3_omni_moe`` adapters: ``init_model`` builds
#: the thinker class from ``thinker_config``, ``ascendv1_save_postprocess`` adds the prefix), which
#: is what vLLM serves (its Omni thinker skips ``talker.`` / ``token2wav.`` tensors).
SUB_MODELS: dict[str, str] = {"qwen2_5_omni": "thinker_config", "qwen3_omni_moe": "thinker_config"}


def quantized_part(config: Any) -> tuple[Any, str | None]:
    """``(config of the part msquant quantizes, its attribute name in config)``: the thinker's
    config of an Omni checkpoint (:data:`SUB_MODELS`), else ``(config, None)``."""
    key = SUB_MODELS.get(getattr(config, "model_type", ""))
    part = getattr(config, key, None) if key else None
    if part is None:
        return config, None
    return part, key


def other_parts(config_json: Mapping[str, Any]) -> list[str]:
    """The checkpoint-name prefixes of the parts of an Omni-like checkpoint msquant neither
    quantizes nor exports (``talker``, ``token2wav`` / ``code2wav``), from its ``config.json``
    mapping; empty for any other model."""
    part = SUB_MODELS.get(str(config_json.get("model_type")))
    if part is None:
        return []
    return sorted(
        key.removesuffix("_config")
        for key, value in config_json.items()
        if key.endswith("_config") and key != part and isinstance(value, dict)
    )


#: Per ``model_type``: the linears (``fnmatch`` patterns of transformers' names) whose output
#: joins the text decoder's residual stream, and nothing else of the vision side does: the
#: projector's last linear (its output replaces the image tokens' embeddings) and Qwen3-VL's
#: deepstack mergers (added to the hidden states after the first layers). A rotation of the
#: stream rotates them on their output. msModelSlim 26.1.0's quarot does the same
#: (``model/qwen3_vl/model_adapter.py`` and ``qwen3_vl_moe``: ``merger.linear_fc2`` and
#: ``deepstack_merger_list.*.linear_fc2``; ``internvl3_5``: ``mlp1.3``, transformers'
#: ``multi_modal_projector.linear_2``). Only families whose rotated model was shown to compute
#: the original logits on text and image inputs are listed (tests/processors/test_quarot_vlm.py).
STREAM_FEEDERS: dict[str, tuple[str, ...]] = {
    "qwen3_vl": (
        "model.visual.merger.linear_fc2",
        "model.visual.deepstack_merger_list.*.linear_fc2",
    ),
    "qwen3_vl_moe": (
        "model.visual.merger.linear_fc2",
        "model.visual.deepstack_merger_list.*.linear_fc2",
    ),
    "qwen3_5": ("model.visual.merger.linear_fc2",),
    "qwen3_5_moe": ("model.visual.merger.linear_fc2",),
    "internvl": ("model.multi_modal_projector.linear_2",),
}


def stream_feeders(model: nn.Module) -> list[str] | None:
    """Full names of the linears of a vision-language model whose output joins its text
    decoder's residual stream (:data:`STREAM_FEEDERS`), in model order; None for a model whose
    family is not listed there."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    patterns = STREAM_FEEDERS.get(str(model_type))
    if patterns is None:
        return None
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(fnmatchcase(name, p) for p in patterns)
    ]


def part_prefix(config_json: Mapping[str, Any]) -> str:
    """The checkpoint-name prefix of the part msquant quantizes (``thinker.`` for an Omni
    model, from its ``config.json`` mapping); empty for any other model."""
    part = SUB_MODELS.get(str(config_json.get("model_type")))
    return f"{part.removesuffix('_config')}." if part else ""


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


#: Per ``model_type``: the method of the text decoder's body that it applies to the hidden
#: states between two decoder layers on image inputs, ``method(hidden_states, *arguments)``.
#: Qwen3-VL adds its deepstack visual features to the image tokens' hidden states after the
#: first layers (transformers' ``Qwen3VLTextModel._deepstack_process``; msModelSlim's Qwen3-VL
#: adapter does the same between the layers it runs one by one). A layer-wise run records each
#: call with its arguments and makes it again on the layer's outputs
#: (:class:`msquant.run.capture.CalibrationActivations`).
BETWEEN_LAYERS: dict[str, str] = {
    "qwen3_vl": "_deepstack_process",
    "qwen3_vl_moe": "_deepstack_process",
}


def between_layers_method(model: nn.Module) -> str | None:
    """The name of the method the text decoder's body applies between layers on image inputs
    (:data:`BETWEEN_LAYERS`), or None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return BETWEEN_LAYERS.get(str(model_type))


def multimodal_body_name(model: nn.Module) -> str | None:
    """Full name of the module of a vision-language model that runs the vision tower, merges
    its features into the text embeddings and runs the text decoder (``model`` of
    ``Qwen3VLForConditionalGeneration``: the text decoder's owner); None for a text-only model."""
    decoder = text_decoder_name(model)
    if decoder is None:
        return None
    return decoder.rsplit(".", 1)[0] if "." in decoder else ""
