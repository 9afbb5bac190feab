"""The model-adapter contract: what msquant must know about a model architecture, in one object.

A :class:`ModelAdapter` answers every question the engine asks about a model's layout: the decoder
layer list, the output head and the final norm before it, the linear layers serving engines fuse
into one matrix (vLLM's ``packed_modules_mapping``), the subgraphs smoothing folds its scales
into (a norm and the linears it feeds, up_proj -> down_proj, v_proj -> o_proj), the MoE layout (fused experts split into
per-expert layers, which linear layers are experts, the routers) and the names the checkpoint uses
on disk.

This base class is the default adapter: the architecture-free heuristics that handle Llama,
Qwen2/3, Mistral, Qwen-MoE, Mixtral, DeepSeek-V3 and most decoder-only models. An architecture the
heuristics get wrong gets a subclass that overrides only what differs (usually
:attr:`ModelAdapter.fused_shards`), registered for its ``config.model_type`` in the
``msquant.model_adapters`` entry-point group (:mod:`msquant.model.adapters`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import ClassVar

from torch import nn

from msquant.model.checkpoint_names import CheckpointNames, checkpoint_names
from msquant.model.fused import (
    FUSED_SHARDS,
    FusedGroup,
    engine_names,
    expert_group_problems,
    expert_groups,
    fused_group_problems,
    fused_groups,
    parse_expert_linear,
)
from msquant.model.head import OutputHeadStage, find_final_norm, find_output_head
from msquant.model.layers import DecoderLayer, find_decoder_layers
from msquant.model.moe import MoEInfo, moe_routers, unfuse_experts
from msquant.model.norms import NormLayout
from msquant.model.rotation_layout import RotationLayout, default_rotation_layout
from msquant.model.subgraphs import SmoothingSubgraph, default_subgraphs
from msquant.model.vision import STREAM_FEEDERS, stream_feeders, vision_parts

__all__ = ["ModelAdapter"]


class ModelAdapter:
    """Architecture knowledge for one family of ``model_type`` s; this base class is the default.

    Subclasses override the class attributes or methods their architecture needs and keep the
    rest. Adapters hold no state: one instance serves any number of models of its types.
    """

    #: fused name -> the sibling linear layers engines load as that one matrix (vLLM's
    #: ``packed_modules_mapping``); the default is the generic table of Llama-like models.
    fused_shards: ClassVar[Mapping[str, tuple[str, ...]]] = FUSED_SHARDS

    #: The model's norms compute ``x / rms(x) * (norm_scale_offset + weight)``: 0 for the usual
    #: RMSNorm, 1 for those storing the gain minus one (Qwen3-Next's, Gemma's). None (the
    #: default): not declared. Smoothing and rotation measure every norm's form before folding
    #: into it (:func:`msquant.model.norms.measure_norm_form`) and use what they measure; a
    #: declared offset the measurement contradicts is refused.
    norm_scale_offset: ClassVar[float | None] = None

    #: Which norm of a decoder layer feeds the attention and which the MLP, and the norms on a
    #: block's output before the residual add (data smoothing and rotation both read; Llama's
    #: names by default).
    norm_layout: ClassVar[NormLayout] = NormLayout()

    # -- decoder body -----------------------------------------------------------------------

    def decoder_layers(self, model: nn.Module) -> list[DecoderLayer]:
        """The decoder layers in execution order (default: the homogeneous ``nn.ModuleList``
        holding the most parameters, :func:`~msquant.model.layers.find_decoder_layers`).

        :raises msquant.ModelLoadError: when the model has no decoder layer list.
        """
        return find_decoder_layers(model)

    def output_head(self, model: nn.Module) -> tuple[str, nn.Module] | None:
        """``(module name, module)`` of the output head, None when the model has none."""
        return find_output_head(model)

    def output_head_stage(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> OutputHeadStage | None:
        """The head presented as the stage after the decoder layers, as the model holds it now
        (re-ask after a processor replaced the head); None when the model has no head."""
        found = self.output_head(model)
        return None if found is None else OutputHeadStage(len(layers), found[0], found[1])

    def final_norm(self, model: nn.Module, layers: Sequence[DecoderLayer]) -> nn.Module | None:
        """The norm applied to the last layer's output before the head, None when not found."""
        return find_final_norm(model, layers)

    def rotation_layout(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> tuple[RotationLayout | None, list[str]]:
        """The weights on the residual stream that a rotation changes (embedding, per-layer norms
        and the linears reading and writing the stream, final norm, head), or None with one
        message per problem; the default finds pre-norm layers with the attention and MLP blocks
        of :mod:`msquant.model.rotation_blocks`, norms scaling by
        ``norm_scale_offset + weight``
        (:func:`~msquant.model.rotation_layout.default_rotation_layout`)."""
        head = self.output_head(model)
        parts = vision_parts(model, head[0] if head else None)
        feeders = stream_feeders(model) if parts else []
        if feeders is None:
            names = ", ".join(name for name, _ in parts)
            model_type = getattr(getattr(model, "config", None), "model_type", "?")
            return None, [
                f"the model is a vision-language model ({model_type}): its {names} output "
                "joins the text decoder's residual stream (image features replace image tokens' "
                "embeddings), so a rotation of that stream must rotate the linears producing "
                "it too; msquant knows them for "
                f"{', '.join(sorted(STREAM_FEEDERS))} only; remove the rotation from the config "
                "(smoothing and quantization of the text decoder do not need it)"
            ]
        layout, problems = default_rotation_layout(
            model, layers, self.norm_scale_offset, self.norm_layout
        )
        if layout is None or not parts:
            return layout, problems
        hidden = layout.hidden_size
        wrong = [
            name
            for name in feeders
            if getattr(model.get_submodule(name), "out_features", None) != hidden
        ]
        if not feeders or wrong:
            return None, [
                f"the vision-language model's linears feeding the residual stream "
                f"({', '.join(wrong) or 'none found'}) are not linears writing its width "
                f"{hidden}: the rotation cannot rotate their output"
            ]
        return replace(layout, feeders=tuple(feeders)), []

    # -- fused matrices ---------------------------------------------------------------------

    def fused_groups(self, module_names: Iterable[str]) -> list[FusedGroup]:
        """The fused matrices among ``module_names``, from :attr:`fused_shards`."""
        return fused_groups(module_names, self.fused_shards)

    def expert_groups(self, module_names: Iterable[str]) -> list[FusedGroup]:
        """The MoE experts modules among ``module_names`` (each loaded as one ``FusedMoE``)."""
        return expert_groups(module_names)

    def engine_names(self, module_names: Iterable[str]) -> dict[str, tuple[FusedGroup, ...]]:
        """For each module loaded as part of a bigger one, the groups engines look it up by."""
        return engine_names(module_names, self.fused_shards)

    def fused_group_problems(
        self, schemes: Mapping[str, Hashable], describe: Mapping[str, str] | None = None
    ) -> list[str]:
        """One message per fused matrix whose shards resolve to different schemes."""
        return fused_group_problems(schemes, describe, self.fused_shards)

    def expert_group_problems(
        self, schemes: Mapping[str, Hashable], describe: Mapping[str, str] | None = None
    ) -> list[str]:
        """One message per experts module whose experts resolve to different schemes."""
        return expert_group_problems(schemes, describe)

    # -- mixture of experts -----------------------------------------------------------------

    def unfuse_experts(self, model: nn.Module) -> MoEInfo:
        """Split the model's fused experts modules into per-expert linear layers (in place)."""
        return unfuse_experts(model)

    def expert_linear(self, name: str) -> tuple[str, int] | None:
        """``(experts module, expert index)`` of a routed expert's linear layer, else None."""
        return parse_expert_linear(name)

    def routers(self, module: nn.Module, prefix: str = "") -> set[str]:
        """Full names of the MoE routers under ``module`` (named ``prefix``); they stay float."""
        return moe_routers(module, prefix)

    # -- smoothing ------------------------------------------------------------------------

    def smoothing_subgraphs(self, model: nn.Module, layer: DecoderLayer) -> list[SmoothingSubgraph]:
        """The norm -> linears and linear -> linear subgraphs of ``layer`` that smoothing
        processors fold their scales into (default: by module names, the norms from
        :attr:`norm_layout`, :func:`~msquant.model.subgraphs.default_subgraphs`); the norms'
        subgraphs carry :attr:`norm_scale_offset` when it is declared."""
        found = default_subgraphs(model, layer, self.norm_layout)
        if self.norm_scale_offset is None:
            return found
        return [
            replace(s, norm_offset=self.norm_scale_offset) if s.kind == "norm-linear" else s
            for s in found
        ]

    # -- names on disk ----------------------------------------------------------------------

    def checkpoint_names(self, model: nn.Module) -> CheckpointNames:
        """The names the model's checkpoint uses on disk (call after :meth:`unfuse_experts`)."""
        return checkpoint_names(model)
