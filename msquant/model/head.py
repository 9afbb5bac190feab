"""The output head (``lm_head``) of a causal LM: where it is, whether it is tied to the input
embeddings, the final norm before it, and the head presented as one more stage after the decoder
layers.

Quantizing the head is opt-in (``linear_quant``'s ``lm_head: true``). A run presents it to the
processors as an :class:`OutputHeadStage`, a :class:`~msquant.plugin.DecoderLayer` whose
``named_linears()`` yields the head itself under its own name (``lm_head``), so quantizers and
savers treat it like any layer (:mod:`msquant.run.output_head` runs that stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from msquant.model.layers import DecoderLayer, layer_list_name, parent_module

__all__ = [
    "FINAL_NORM_NAMES",
    "OutputHeadStage",
    "find_output_head",
    "head_is_tied",
    "tied_head_message",
    "find_final_norm",
    "output_head_stage",
]

#: Names of the final norm inside the decoder body, tried first (Llama/Qwen/Mistral ``norm``,
#: GPT-2/Falcon ``ln_f``, GPT-NeoX/OPT ``final_layer_norm``, Phi ``final_layernorm``).
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")


@dataclass(frozen=True)
class OutputHeadStage(DecoderLayer):
    """The output head presented as a stage: ``name`` is the head's module name (``lm_head``),
    ``module`` the head itself, ``index`` the number of decoder layers (it runs after them).

    Savers write ``module.state_dict(prefix=name + ".")`` and ``module.named_modules(prefix=name)``
    exactly as for a decoder layer; ``isinstance(layer, OutputHeadStage)`` tells the head apart.
    """

    def named_linears(self) -> list[tuple[str, nn.Linear]]:
        """``[(name, head)]`` while the head is a float ``nn.Linear``, else ``[]``."""
        return [(self.name, self.module)] if isinstance(self.module, nn.Linear) else []


def find_output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(module name, module)`` of the model's output head (``get_output_embeddings()``), or
    None when the model has none."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module):
        return None
    for name, module in model.named_modules():
        if module is head and name:
            return name, module
    return None


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def head_is_tied(model: nn.Module) -> bool:
    """Whether the output head shares its weight with the input embeddings: the config says so
    (``tie_word_embeddings``, also under ``text_config``) or the two are one tensor."""
    config = _config(model)
    text = getattr(config, "text_config", None)
    flag = getattr(config, "tie_word_embeddings", None)
    if flag is None and text is not None:
        flag = getattr(text, "tie_word_embeddings", None)
    if flag:
        return True
    found = find_output_head(model)
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    head_weight = getattr(found[1], "weight", None) if found else None
    return head_weight is not None and head_weight is getattr(embeddings, "weight", None)


def tied_head_message(model: nn.Module, head_name: str, requested_by: str) -> str:
    """Why a tied head cannot be quantized, naming the model, ``tie_word_embeddings`` and the fix."""
    config = _config(model)
    model_type = str(getattr(config, "model_type", "unknown"))
    where = str(getattr(config, "_name_or_path", "") or "")
    described = f"{type(model).__name__} ({model_type}{', ' + where if where else ''})"
    return (
        f"{requested_by} asks to quantize {head_name}, but {described} ties {head_name} to the "
        "input embeddings (tie_word_embeddings: true, one shared tensor): quantizing the head "
        "would also change the embeddings, and loaders re-tie the head to the float embeddings. "
        "Keep the head in float (lm_head: false), or untie the model first (save it with "
        f"tie_word_embeddings: false and its own {head_name}.weight)"
    )


def find_final_norm(model: nn.Module, layers: Sequence[DecoderLayer]) -> nn.Module | None:
    """The decoder body's final norm (applied to the last layer's output before the head).

    A child of the body named in :data:`FINAL_NORM_NAMES`, else the only child with parameters
    registered after the layer list that is not an embedding; None when neither exists.
    """
    if not layers:
        return None
    body = parent_module(model, list(layers))
    children = dict(body.named_children())
    for name in FINAL_NORM_NAMES:
        if name in children:
            return children[name]
    list_leaf = layer_list_name(list(layers)).rpartition(".")[2]
    names = list(children)
    after = names[names.index(list_leaf) + 1 :] if list_leaf in names else []
    candidates = [
        children[name]
        for name in after
        if not isinstance(children[name], nn.Embedding)
        and any(True for _ in children[name].parameters())
    ]
    return candidates[0] if len(candidates) == 1 else None


def output_head_stage(model: nn.Module, layers: Sequence[DecoderLayer]) -> OutputHeadStage | None:
    """The head stage as the model holds it now (re-resolve it after a processor replaced the
    head), or None when the model has no output head."""
    found = find_output_head(model)
    if found is None:
        return None
    name, module = found
    return OutputHeadStage(len(layers), name, module)
