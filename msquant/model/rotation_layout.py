"""Where a model's residual stream is read and written: what a rotation of it must change.

A rotation of the residual stream (QuaRot) touches every weight on the stream: the input
embedding, in each decoder layer the norms and the linears that read their output (q/k/v after
the attention norm, gate/up after the MLP norm) and the linears that add into the stream (o_proj,
down_proj), then the final norm and the output head. The value/output projections of each
attention head may be rotated once more, per head. :class:`RotationLayout` names all of them;
:func:`default_rotation_layout` finds them in Llama-shaped models (Llama, Qwen2/3, Mistral) by
their transformers names, on a weightless model; other shapes get a message saying what is
missing, and a model adapter may describe them (:meth:`msquant.ModelAdapter.rotation_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from msquant.model.head import find_final_norm, find_output_head, head_is_tied
from msquant.model.layers import DecoderLayer

__all__ = [
    "LayerRotationLayout",
    "NormReaders",
    "RotationLayout",
    "default_rotation_layout",
    "layer_rotation_layout",
]

#: The Llama-shaped decoder layer, names relative to the layer.
ATTENTION_NORM = "input_layernorm"
MLP_NORM = "post_attention_layernorm"
ATTENTION_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_READERS = ("mlp.gate_proj", "mlp.up_proj")
VALUE = "self_attn.v_proj"
ATTENTION_OUTPUT = "self_attn.o_proj"
MLP_OUTPUT = "mlp.down_proj"


@dataclass(frozen=True)
class NormReaders:
    """A norm on the residual stream and the linears reading its output (full module names)."""

    norm: str
    readers: tuple[str, ...]


@dataclass(frozen=True)
class LayerRotationLayout:
    """One decoder layer's weights on the residual stream (full module names).

    :param norms: each norm with the linears that read it.
    :param writers: the linears whose output is added into the stream.
    :param value_output: ``(value projection, attention output projection)`` pairs, rotated per
        attention head (``head_dim`` wide blocks).
    """

    norms: tuple[NormReaders, ...]
    writers: tuple[str, ...]
    value_output: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RotationLayout:
    """The whole model's weights on the residual stream.

    :param hidden_size: the stream's width.
    :param head_dim: the attention heads' width (the per-head rotation's size).
    :param embedding: the input embedding module.
    :param final_norm: the norm before the head; ``head`` the output head.
    :param tied: whether the head shares its weight with the embedding (a rotation unties them).
    :param layers: per decoder layer, in order.
    """

    hidden_size: int
    head_dim: int
    embedding: str
    final_norm: str
    head: str
    tied: bool
    layers: tuple[LayerRotationLayout, ...]


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def _head_dim(model: nn.Module, hidden_size: int) -> int | None:
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0 and hidden_size % heads == 0:
        return hidden_size // heads
    return None


def layer_rotation_layout(
    layer: DecoderLayer, hidden_size: int, problems: list[str]
) -> LayerRotationLayout | None:
    """The Llama-shaped layout of one decoder layer; None (with ``problems`` appended) when the
    layer lacks a module of it or a module has another shape."""
    found = dict(layer.module.named_modules())
    missing = [
        name
        for name in (ATTENTION_NORM, MLP_NORM, *ATTENTION_READERS, *MLP_READERS)
        + (ATTENTION_OUTPUT, MLP_OUTPUT)
        if name not in found
    ]
    if missing:
        problems.append(
            f"{layer.name} has no {', '.join(missing)}: the rotation knows Llama-shaped dense "
            "layers (input_layernorm -> self_attn.q/k/v_proj, o_proj; post_attention_layernorm "
            "-> mlp.gate/up_proj, down_proj); MoE and other layouts need a model adapter that "
            "describes them (docs/developer/add-model-adapter.md)"
        )
        return None
    before = len(problems)
    for name in (ATTENTION_NORM, MLP_NORM):
        weight = getattr(found[name], "weight", None)
        if weight is None or weight.dim() != 1 or weight.shape[0] != hidden_size:
            problems.append(
                f"{layer.name}.{name} is not a norm with a scale of width {hidden_size}"
            )
        if getattr(found[name], "bias", None) is not None:
            problems.append(f"{layer.name}.{name} has a bias: the rotation needs RMSNorm layers")
    for name in (*ATTENTION_READERS, *MLP_READERS):
        module = found[name]
        if not isinstance(module, nn.Linear) or module.in_features != hidden_size:
            problems.append(f"{layer.name}.{name} is not a linear reading width {hidden_size}")
    for name in (ATTENTION_OUTPUT, MLP_OUTPUT):
        module = found[name]
        if not isinstance(module, nn.Linear) or module.out_features != hidden_size:
            problems.append(f"{layer.name}.{name} is not a linear writing width {hidden_size}")
    if len(problems) > before:
        return None
    prefix = f"{layer.name}."
    return LayerRotationLayout(
        norms=(
            NormReaders(prefix + ATTENTION_NORM, tuple(prefix + n for n in ATTENTION_READERS)),
            NormReaders(prefix + MLP_NORM, tuple(prefix + n for n in MLP_READERS)),
        ),
        writers=(prefix + ATTENTION_OUTPUT, prefix + MLP_OUTPUT),
        value_output=((prefix + VALUE, prefix + ATTENTION_OUTPUT),),
    )


def default_rotation_layout(
    model: nn.Module, layers: Sequence[DecoderLayer]
) -> tuple[RotationLayout | None, list[str]]:
    """The rotation layout of a Llama-shaped model (weightless models work: only names and shapes
    are read), or None with one message per problem found."""
    problems: list[str] = []
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    names = _module_names(model)
    if not isinstance(embedding, nn.Embedding) or id(embedding) not in names:
        return None, [f"{type(model).__name__} has no input embedding (nn.Embedding) to rotate"]
    hidden_size = embedding.embedding_dim
    head = find_output_head(model)
    if head is None or not isinstance(head[1], nn.Linear) or head[1].in_features != hidden_size:
        problems.append(
            f"{type(model).__name__} has no linear output head reading width {hidden_size}"
        )
    norm = find_final_norm(model, list(layers))
    if norm is None or id(norm) not in names:
        problems.append(f"{type(model).__name__}: the final norm before the head was not found")
    elif getattr(norm, "bias", None) is not None:
        problems.append(f"{names[id(norm)]} has a bias: the rotation needs RMSNorm layers")
    head_dim = _head_dim(model, hidden_size)
    if head_dim is None:
        problems.append(f"{type(model).__name__}: the attention head width (head_dim) is unknown")
    per_layer = [layer_rotation_layout(layer, hidden_size, problems) for layer in layers]
    if problems:
        return None, problems
    assert head is not None and norm is not None and head_dim is not None
    return (
        RotationLayout(
            hidden_size=hidden_size,
            head_dim=head_dim,
            embedding=names[id(embedding)],
            final_norm=names[id(norm)],
            head=head[0],
            tied=head_is_tied(model),
            layers=tuple(layout for layout in per_layer if layout is not None),
        ),
        [],
    )
