"""The attention and MLP blocks of a decoder layer as a residual-stream rotation sees them: which
linear layers read the stream (after the block's norm) and which write it.

Known by their transformers module names (relative to the decoder layer):

* attention: q/k/v attention (``self_attn.q/k/v_proj`` -> ``o_proj``; Llama, Qwen, Mistral,
  GLM-4-MoE, MiniMax-M2, Qwen3-Next's gated full attention), DeepSeek's multi-head latent
  attention (``self_attn.q_a_proj`` or ``q_proj``, ``kv_a_proj_with_mqa`` -> ``o_proj``; with a
  DSA indexer, as DeepSeek-V3.2's and GLM-5's, also its ``indexer.wk`` and ``weights_proj``), and
  Gated DeltaNet linear attention (``linear_attn.in_proj_qkvz``, ``in_proj_ba``, or the four
  ``in_proj_qkv/z/b/a`` -> ``out_proj``);
* MLP: dense (``mlp.gate/up_proj`` -> ``down_proj``) and mixture of experts (a block holding
  ``experts``): its routers (an ``nn.Linear`` or a module with a 2-D ``weight``, and Qwen's
  ``shared_expert_gate``), every expert's and shared expert's ``gate_proj`` / ``up_proj`` read
  the stream, their ``down_proj`` write it. Experts must be split into per-expert linear layers
  first (:func:`msquant.model.moe.unfuse_experts`; runs and plans do it when the model loads).

Anything in a MoE block that is not one of these refuses the layout, and so does any other module
of the layer that reads the stream's width without being a known reader: a weight left unrotated
would change the model's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from msquant.model.moe import moe_routers

__all__ = [
    "ATTENTION_SHAPES",
    "AttentionShape",
    "BlockLayout",
    "find_attention_block",
    "find_mlp_block",
    "unknown_readers",
]

#: The projections of one (dense or expert) gated MLP.
MLP_READERS = ("gate_proj", "up_proj")
MLP_WRITER = "down_proj"


@dataclass(frozen=True)
class AttentionShape:
    """One attention layout: reader slots (each a tuple of alternative names, the first present
    one is used), the writer, and the value projection rotated per head with the writer (None:
    no per-head rotation)."""

    kind: str
    readers: tuple[tuple[str, ...], ...]
    writer: str
    value: str | None = None
    #: readers of the same normed stream that the block may have (read when present)
    optional: tuple[str, ...] = ()


ATTENTION_SHAPES: tuple[AttentionShape, ...] = (
    AttentionShape(
        "q/k/v attention",
        (("self_attn.q_proj",), ("self_attn.k_proj",), ("self_attn.v_proj",)),
        "self_attn.o_proj",
        value="self_attn.v_proj",
    ),
    AttentionShape(
        "multi-head latent attention",
        (("self_attn.q_a_proj", "self_attn.q_proj"), ("self_attn.kv_a_proj_with_mqa",)),
        "self_attn.o_proj",
        value="self_attn.kv_b_proj",
        # the DSA indexer (DeepSeek-V3.2, GLM-5): its key and head-weight projections read the
        # normed stream as q_a_proj does (its wq_b reads the query latent, which is not rotated)
        optional=("self_attn.indexer.wk", "self_attn.indexer.weights_proj"),
    ),
    AttentionShape(
        "Gated DeltaNet linear attention",
        (("linear_attn.in_proj_qkvz",), ("linear_attn.in_proj_ba",)),
        "linear_attn.out_proj",
    ),
    AttentionShape(
        "Gated DeltaNet linear attention",
        (
            ("linear_attn.in_proj_qkv",),
            ("linear_attn.in_proj_z",),
            ("linear_attn.in_proj_b",),
            ("linear_attn.in_proj_a",),
        ),
        "linear_attn.out_proj",
    ),
)


@dataclass(frozen=True)
class BlockLayout:
    """One block's weights on the stream, names relative to the decoder layer.

    :param kind: what the block was recognised as (for messages and logs).
    :param readers: the modules reading the block's norm output (their weight's columns).
    :param writers: the linears whose output is added into the stream.
    :param value_output: ``(value, output)`` pairs rotated once more per attention head.
    :param head_width: the width of one head's value (the per-head rotation's size; 0: none).
    :param value_skip: rows of each head's block in the value projection's output before its
        value rows, left unrotated (MLA's kv_b_proj writes ``[k_nope, value]`` per head).
    """

    kind: str
    readers: tuple[str, ...]
    writers: tuple[str, ...]
    value_output: tuple[tuple[str, str], ...] = ()
    head_width: int = 0
    value_skip: int = 0


def _weight(module: nn.Module) -> torch.Tensor | None:
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight if weight is not None and weight.dim() == 2 else None


def _reads(module: nn.Module, width: int) -> bool:
    """A linear (or a router holding a 2-D ``weight``) whose input is ``width`` wide."""
    weight = _weight(module)
    return weight is not None and weight.shape[1] == width


def _writes(module: nn.Module, width: int) -> bool:
    return isinstance(module, nn.Linear) and module.out_features == width


def find_attention_block(
    found: dict[str, nn.Module], head_dim: int | None, heads: int | None = None
) -> BlockLayout | None:
    """The first :data:`ATTENTION_SHAPES` entry whose modules the layer has (``found``: the
    layer's ``named_modules``), None when none fits, with its per-head value/output pair where
    that rotation is exact (:func:`_per_head`).

    :param head_dim: the attention heads' width (q/k/v attention); None: unknown.
    :param heads: the number of attention heads (MLA); None: unknown.
    """
    for shape in ATTENTION_SHAPES:
        chosen = [next((n for n in slot if n in found), None) for slot in shape.readers]
        if shape.writer not in found or any(name is None for name in chosen):
            continue
        readers = tuple(name for name in chosen if name is not None)
        readers += tuple(name for name in shape.optional if name in found)
        widths = _per_head(found, shape, head_dim, heads)
        if shape.value is None or widths is None:
            return BlockLayout(shape.kind, readers, (shape.writer,))
        pairs = ((shape.value, shape.writer),)
        return BlockLayout(shape.kind, readers, (shape.writer,), pairs, *widths)
    return None


def _per_head(
    found: dict[str, nn.Module], shape: AttentionShape, head_dim: int | None, heads: int | None
) -> tuple[int, int] | None:
    """``(value width, rows skipped per head)`` of the shape's per-head value/output rotation,
    None where it would not be exact.

    q/k/v attention: the queries must be as wide as the output projection's input (no output
    gate computed with the queries, as Qwen3-Next's gated attention has: its gate multiplies the
    attention output channel by channel, which a per-head rotation does not commute with) and
    ``head_dim`` must divide the value and output widths. MLA: kv_b_proj writes ``[k_nope,
    value]`` per head and o_proj reads the heads' values, so each head's value rows and o_proj's
    columns of that head are rotated alike (the keys are left alone).
    """
    if shape.value is None or shape.value not in found:
        return None
    value, output = found[shape.value], found[shape.writer]
    if not isinstance(value, nn.Linear) or not isinstance(output, nn.Linear):
        return None
    if shape.value == "self_attn.kv_b_proj":
        if heads is None or value.out_features % heads or output.in_features % heads:
            return None
        width, block = output.in_features // heads, value.out_features // heads
        return (width, block - width) if block > width else None
    query = found[shape.readers[0][0]]
    if head_dim is None or not isinstance(query, nn.Linear):
        return None
    exact = (
        query.out_features == output.in_features
        and value.out_features % head_dim == 0
        and output.in_features % head_dim == 0
    )
    return (head_dim, 0) if exact else None


def find_mlp_block(
    layer_module: nn.Module, found: dict[str, nn.Module], problems: list[str], layer_name: str
) -> BlockLayout | None:
    """The layer's MLP: dense ``mlp.gate/up_proj`` -> ``down_proj``, or the MoE block (a child
    holding ``experts``); None when neither fits or the MoE block holds an unknown module
    (``problems`` then says which)."""
    moe = [
        name
        for name, child in layer_module.named_children()
        if isinstance(getattr(child, "experts", None), nn.Module)
    ]
    if not moe:
        if all(f"mlp.{name}" in found for name in (*MLP_READERS, MLP_WRITER)):
            readers = tuple(f"mlp.{name}" for name in MLP_READERS)
            return BlockLayout("dense MLP", readers, (f"mlp.{MLP_WRITER}",))
        return None
    if len(moe) > 1:
        problems.append(f"{layer_name} has several MoE blocks ({', '.join(moe)})")
        return None
    return _moe_block(moe[0], layer_module.get_submodule(moe[0]), problems, layer_name)


def _moe_block(
    prefix: str, block: nn.Module, problems: list[str], layer_name: str
) -> BlockLayout | None:
    """Routers and every expert's / shared expert's projections of one MoE block."""
    routers = moe_routers(block, prefix)
    readers = [name for name, _ in block.named_children() if f"{prefix}.{name}" in routers]
    writers: list[str] = []
    unknown: list[str] = []
    experts = block.get_submodule("experts")
    held = [(i, e) for i, e in experts.named_children() if any(True for _ in e.parameters())]
    for index, expert in held:  # (the activation is a child without parameters)
        _gated_mlp(f"experts.{index}", expert, readers, writers, unknown)
    if not held or list(experts.parameters(recurse=False)):
        unknown.append(f"experts ({type(experts).__name__}, not split into per-expert linears)")
    for name, child in block.named_children():
        if name == "experts" or name in readers:
            continue
        if not any(True for _ in child.parameters()):
            continue  # activations, dropout
        _gated_mlp(name, child, readers, writers, unknown)
    if unknown:
        problems.append(
            f"{layer_name}.{prefix} holds modules the rotation does not know ({', '.join(unknown)}): "
            "a MoE block may hold routers (a linear or a 2-D weight), experts and shared experts "
            "with gate_proj / up_proj / down_proj"
        )
        return None
    full = tuple(f"{prefix}.{name}" for name in readers)
    return BlockLayout("MoE", full, tuple(f"{prefix}.{name}" for name in writers))


def _gated_mlp(
    name: str, module: nn.Module, readers: list[str], writers: list[str], unknown: list[str]
) -> None:
    """Add ``module``'s gate/up (readers) and down (writer) when it is a gated MLP whose only
    parameters are theirs, else record it as unknown."""
    children = dict(module.named_children())
    held = {child for child, sub in children.items() if any(True for _ in sub.parameters())}
    own = list(module.parameters(recurse=False))
    if own or held != {*MLP_READERS, MLP_WRITER}:
        unknown.append(f"{name} ({type(module).__name__})")
        return
    readers.extend(f"{name}.{child}" for child in MLP_READERS)
    writers.append(f"{name}.{MLP_WRITER}")


def unknown_readers(found: dict[str, nn.Module], known: set[str], hidden_size: int) -> list[str]:
    """Modules of the layer (``found``: relative name -> module) that read a ``hidden_size``-wide
    input but are neither a known reader nor a writer: each would miss the rotation."""
    return sorted(
        name
        for name, module in found.items()
        if name and name not in known and _reads(module, hidden_size)
    )
