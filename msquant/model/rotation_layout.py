"""Where a model's residual stream is read and written: what a rotation of it must change.

A rotation of the residual stream (QuaRot) touches every weight on the stream: the input
embedding, in each decoder layer the norms and the linears that read their output (q/k/v after
the attention norm, gate/up and the MoE routers after the MLP norm) and the linears that add into
the stream (o_proj, down_proj), then the final norm and the output head. The value/output
projections of each attention head may be rotated once more, per head. :class:`RotationLayout`
names all of them; :func:`default_rotation_layout` finds them by their transformers names, on a
weightless model, in pre-norm layers whose attention and MLP blocks
:mod:`msquant.model.rotation_blocks` knows (Llama, Qwen2/3, Mistral, Qwen-MoE, DeepSeek-V3,
GLM-4-MoE, MiniMax-M2, Qwen3-Next); other shapes get a message saying what is missing, and a
model adapter may describe them (:meth:`msquant.ModelAdapter.rotation_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from msquant.model.head import find_final_norm, find_output_head, head_is_tied
from msquant.model.layers import DecoderLayer
from msquant.model.norms import NormLayout
from msquant.model.rotation_blocks import find_attention_block, find_mlp_block, unknown_readers

__all__ = [
    "LayerRotationLayout",
    "NormReaders",
    "RotationLayout",
    "default_rotation_layout",
    "layer_rotation_layout",
]


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
        attention head (``head_width`` wide blocks).
    :param head_width: the width of one head's value (the per-head rotation's size; 0: none).
    :param value_skip: rows of each head's block in the value projection's output that come
        before the head's value and are not rotated (DeepSeek's kv_b_proj: the head's k_nope).
    :param branch_norms: norms on a block's output before the residual add (Gemma 2/3's
        sandwich norms): the rotated writers' output passes through them, which is exact only
        when each one's gain is the same for every channel (checked on the weights in the run).
    """

    norms: tuple[NormReaders, ...]
    writers: tuple[str, ...]
    value_output: tuple[tuple[str, str], ...]
    head_width: int = 0
    value_skip: int = 0
    branch_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class RotationLayout:
    """The whole model's weights on the residual stream.

    :param hidden_size: the stream's width.
    :param head_dim: the attention heads' width (the config's; each layer's per-head rotation
        has its own ``head_width``).
    :param embedding: the input embedding module.
    :param final_norm: the norm before the head; ``head`` the output head.
    :param tied: whether the head shares its weight with the embedding (a rotation unties them).
    :param layers: per decoder layer, in order.
    :param norm_offset: the norms on the stream compute ``x / rms(x) * (norm_offset + weight)``
        (0 for RMSNorm; 1 for Qwen3-Next's, whose weight is stored as the gain minus one), as the
        model adapter declares it; None when it does not (the rotation measures each norm and
        folds ``offset + weight`` into the readers, then sets the weight to ``1 - offset``).
    :param feeders: linears outside the text decoder whose output joins the stream: a
        vision-language model's projector outputs, which replace the image tokens' embeddings
        or are added to the stream (Qwen3-VL's deepstack mergers); rotated on their output
        (``R.T @ W``, ``R.T @ b``) like the embedding is on its (:mod:`msquant.model.vision`).
    """

    hidden_size: int
    head_dim: int
    embedding: str
    final_norm: str
    head: str
    tied: bool
    layers: tuple[LayerRotationLayout, ...]
    norm_offset: float | None = None
    feeders: tuple[str, ...] = ()

    @property
    def rotates_heads(self) -> bool:
        """Whether some layer rotates a value/output pair per attention head."""
        return any(layer.value_output for layer in self.layers)

    @property
    def head_widths(self) -> list[int]:
        """The widths of the per-head rotations, ascending (empty when there is none)."""
        return sorted({layer.head_width for layer in self.layers if layer.value_output})


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def _heads(model: nn.Module) -> int | None:
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    return heads if isinstance(heads, int) and heads > 0 else None


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
    layer: DecoderLayer,
    hidden_size: int,
    problems: list[str],
    head_dim: int | None = None,
    heads: int | None = None,
    norms: NormLayout | None = None,
) -> LayerRotationLayout | None:
    """The layout of one pre-norm decoder layer (the attention norm -> an attention block, the
    MLP norm -> a dense or MoE MLP, names from ``norms``, Llama's by default; the blocks msquant
    knows are listed in :mod:`msquant.model.rotation_blocks`); None (with ``problems`` appended)
    when the layer lacks a module of it, a module has another shape, or another module reads the
    stream.

    :param head_dim: the attention heads' width; ``heads`` their number (each None when unknown:
        no per-head value/output rotation where the attention needs it).
    """
    norms = norms or NormLayout()
    attention_norm, mlp_norm = norms.attention, norms.mlp
    found = dict(layer.module.named_modules())
    attention = find_attention_block(found, head_dim, heads)
    before = len(problems)
    mlp = find_mlp_block(layer.module, found, problems, layer.name)
    missing = [name for name in (attention_norm, mlp_norm) if name not in found]
    if attention is None:
        missing.append("an attention block (self_attn.q/k/v_proj, q_a_proj / kv_a_proj_with_mqa, "
                       "or linear_attn.in_proj_*) with its output projection")  # fmt: skip
    if mlp is None and len(problems) == before:
        missing.append("an MLP (mlp.gate/up_proj -> down_proj, or a MoE block holding experts)")
    if missing:
        problems.append(
            f"{layer.name} has no {'; no '.join(missing)}: the rotation knows pre-norm layers "
            f"({attention_norm} -> attention, {mlp_norm} -> MLP) with q/k/v, "
            "multi-head latent or Gated DeltaNet attention and dense or MoE MLPs; other layouts "
            "need a model adapter that describes them (docs/developer/add-model-adapter.md)"
        )
    if attention is None or mlp is None or len(problems) > before:
        return None
    branch = tuple(name for name in norms.branch if name in found)
    for name in (attention_norm, mlp_norm, *branch):
        weight = getattr(found[name], "weight", None)
        if weight is None or weight.dim() != 1 or weight.shape[0] != hidden_size:
            problems.append(
                f"{layer.name}.{name} is not a norm with a scale of width {hidden_size}"
            )
        if getattr(found[name], "bias", None) is not None:
            problems.append(f"{layer.name}.{name} has a bias: the rotation needs RMSNorm layers")
    for block in (attention, mlp):
        for name in block.readers:
            weight = dict(found[name].named_parameters(recurse=False)).get("weight")
            if weight is None or weight.dim() != 2 or weight.shape[1] != hidden_size:
                problems.append(f"{layer.name}.{name} is not a linear reading width {hidden_size}")
        for name in block.writers:
            module = found[name]
            if not isinstance(module, nn.Linear) or module.out_features != hidden_size:
                problems.append(f"{layer.name}.{name} is not a linear writing width {hidden_size}")
    known = {*attention.readers, *attention.writers, *mlp.readers, *mlp.writers}
    for name in unknown_readers(found, known, hidden_size):
        problems.append(
            f"{layer.name}.{name} ({type(found[name]).__name__}) reads the residual stream's "
            f"width {hidden_size} but is not a reader the rotation knows for this layer "
            f"({attention.kind}, {mlp.kind}): rotating the stream would change its input"
        )
    if len(problems) > before:
        return None
    prefix = f"{layer.name}."
    return LayerRotationLayout(
        norms=(
            NormReaders(prefix + attention_norm, tuple(prefix + n for n in attention.readers)),
            NormReaders(prefix + mlp_norm, tuple(prefix + n for n in mlp.readers)),
        ),
        writers=tuple(prefix + n for n in (*attention.writers, *mlp.writers)),
        value_output=tuple((prefix + v, prefix + o) for v, o in attention.value_output),
        head_width=attention.head_width,
        value_skip=attention.value_skip,
        branch_norms=tuple(prefix + name for name in branch),
    )


def default_rotation_layout(
    model: nn.Module,
    layers: Sequence[DecoderLayer],
    norm_offset: float | None = None,
    norms: NormLayout | None = None,
) -> tuple[RotationLayout | None, list[str]]:
    """The rotation layout of a pre-norm model (weightless models work: only names and shapes
    are read), or None with one message per problem found.

    :param norm_offset: see :attr:`RotationLayout.norm_offset` (declared by the model adapter).
    :param norms: which norm feeds which block (the model adapter's; Llama's by default).
    """
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
    heads = _heads(model)
    per_layer = [
        layer_rotation_layout(layer, hidden_size, problems, head_dim, heads, norms)
        for layer in layers
    ]
    if problems:
        return None, problems
    assert head is not None and norm is not None
    return (
        RotationLayout(
            hidden_size=hidden_size,
            head_dim=head_dim or 0,
            embedding=names[id(embedding)],
            final_norm=names[id(norm)],
            head=head[0],
            tied=head_is_tied(model),
            layers=tuple(layout for layout in per_layer if layout is not None),
            norm_offset=norm_offset,
        ),
        [],
    )
