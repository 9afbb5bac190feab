"""The saver contract: a template method that writes an export as layers finish.

Every saver of a weight export does the same things around its format: it opens a sharded
safetensors writer in its output folder (``part_file_size`` GiB per shard), writes each decoder
layer's tensors when the layer is done (the quantized linears through the format's packer, every
other tensor as it is), remembers which tensors it wrote and whether the output head was
quantized, refuses fused layers (q/k/v, gate/up; the model's adapter,
:func:`msquant.plugin.adapter_for`, says which) whose shards differ, keeps that record in a
checkpoint so a killed run resumes, and at the end writes the tensors outside the layers, closes
the writer and writes the format's metadata. :class:`Saver` does all of that; a format's saver
implements only:

================  ==========================================================================
hook              what the format provides
================  ==========================================================================
pack              the stored tensors of one quantized linear (the format's packer; required)
write_config      the format's metadata once the weights are closed (required)
fused_scheme      how one linear's scheme reads in the fused-layer check (default: its
                  ``describe()`` text; ``FLOAT`` for a float linear)
fused_message     the error raised when the shards of a fused layer differ
check_layer       checks before a layer's tensors are written (default: the fused check)
record_quantized  what the format remembers of each quantized linear it wrote
record_extra      what the format remembers of each tensor a processor added
                  (``ctx.export_tensors``, of a type in ``tensor_kinds``)
prepare           extra setup (called after the writer and the state exist)
finish_layers     work after the last layer, before the remaining tensors are written
================  ==========================================================================

What a saver remembers lives in one pydantic model (:class:`SaverState`, subclassed per format
and named by ``state_class``), which is the saver's checkpoint: :meth:`Saver.resume_state`
dumps it with the writer's state and :meth:`Saver.restore` validates it back, refusing a state
written in another layout (``SAVER_STATE_FORMAT``) with a message naming the fix.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer
from torch import nn

from msquant.contracts.processor import Processor, ProcessorConfig
from msquant.errors import QuantizationError
from msquant.export.hf_checkpoint import unique_state_items
from msquant.export.shards import ShardedSafetensorsWriter
from msquant.model.adapter import ModelAdapter
from msquant.model.adapter_registry import adapter_for
from msquant.model.head import OutputHeadStage
from msquant.quant.quantized_linear import QuantizedLinear

if TYPE_CHECKING:
    from pathlib import Path

    from msquant.contracts.context import RunContext
    from msquant.model.layers import DecoderLayer

__all__ = [
    "SAVER_STATE_FORMAT",
    "GIB",
    "NameSet",
    "SaverConfig",
    "SaverState",
    "Saver",
]

logger = logging.getLogger(__name__)

#: Layout of a saver's checkpointed state; bumped when :class:`SaverState` changes shape, so that
#: a checkpoint of an older layout is refused with a clear message instead of misread.
SAVER_STATE_FORMAT = 1
GIB = 1024**3
#: The fused-check scheme of a linear layer left in float (unless a format names it otherwise).
FLOAT = "FLOAT"

#: A set of names, stored sorted in a checkpoint (deterministic files).
NameSet = Annotated[set[str], PlainSerializer(sorted, return_type=list[str])]


class SaverConfig(ProcessorConfig):
    """Base of a saver's config: the shard size every saver takes."""

    part_file_size: int = Field(4, ge=0, description="Shard size in GiB; 0 writes a single file.")


class SaverState(BaseModel):
    """What a saver carries from the finished layers to the next ones (its checkpoint).

    :param written: state-dict names already written or replaced by packed tensors.
    :param quantized: the quantized linears written through :meth:`Saver.pack`.
    :param head: the output head's name, when its stage ran quantized.
    """

    model_config = ConfigDict(extra="forbid")

    written: NameSet = Field(default_factory=set)
    quantized: NameSet = Field(default_factory=set)
    head: str | None = None


class Saver(Processor):
    """Base of the savers that write a weight export layer by layer (see the module doc).

    Subclasses set ``type_name``, ``config_class`` (a :class:`SaverConfig` subclass),
    ``weights_prefix`` (the weight files' stem) and ``state_class``, and implement :meth:`pack`
    and :meth:`write_config`. ``default_saver = True`` on exactly one registered saver class makes
    it the saver of configs whose ``spec.save`` is empty (not inherited by its subclasses).
    """

    stage = "save"
    resumable = True
    config: SaverConfig
    #: Stem of the weight files (``<stem>.safetensors`` or ``<stem>-0000i-of-0000N.safetensors``).
    weights_prefix: ClassVar[str]
    #: Write ``<stem>.safetensors`` (no index) when everything fits one shard.
    plain_when_single: ClassVar[bool] = False
    state_class: ClassVar[type[SaverState]] = SaverState
    default_saver: ClassVar[bool] = False
    #: Whether the format stores quantized activations (:attr:`QuantizedLinear.act`); a saver
    #: without it refuses such a layer instead of writing it as weight-only.
    writes_activations: ClassVar[bool] = False
    #: Which activation schemes (msModelSlim's names, as plans show them: ``W8A8``,
    #: ``W8A8_DYNAMIC``, ``W4A8_DYNAMIC``) a saver with ``writes_activations`` stores; empty:
    #: every one. The plan refuses the others, naming the savers that store them.
    activation_schemes: ClassVar[tuple[str, ...]] = ()
    #: The types of the tensors processors add to the export (``ctx.export_tensors``, e.g.
    #: ``"C8"``, the int8 KV cache's scales) this format stores; a saver refuses the others,
    #: naming the tensor, rather than leave them out.
    tensor_kinds: ClassVar[tuple[str, ...]] = ()
    #: The value-type families (:attr:`msquant.plugin.ValueType.family`: ``int``, ``mx``) whose
    #: codes this format stores; a saver refuses a layer of another, naming it.
    value_families: ClassVar[tuple[str, ...]] = ("int",)

    @classmethod
    def stores_activation_scheme(cls, scheme: str) -> bool:
        """Whether this format stores layers with the activation scheme ``scheme``."""
        return cls.writes_activations and (
            not cls.activation_schemes or scheme in cls.activation_schemes
        )

    directory: Path
    writer: ShardedSafetensorsWriter
    state: SaverState
    #: The model's adapter (:func:`msquant.plugin.adapter_for`, asked in :meth:`setup`): which linears
    #: engines fuse, the MoE routers. Before ``setup`` (a saver's checks called on their own) the
    #: default adapter answers, with the generic heuristics.
    adapter: ModelAdapter = ModelAdapter()
    #: model tensor names transformers saves through a conversion, and the function giving
    #: their checkpoint form (set from the run in :meth:`setup`)
    converted: frozenset[str] = frozenset()
    disk_form: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = dict

    # --- the template --------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        self.adapter = adapter_for(ctx.model)
        names = ctx.checkpoint_names
        self.converted = names.converted if names is not None else frozenset()
        self.disk_form = ctx.disk_form
        self.directory = self.output_dir(ctx)
        size = self.config.part_file_size
        # tensors are recorded under the model's names and stored under the checkpoint's
        self.writer = ShardedSafetensorsWriter(
            self.directory,
            self.weights_prefix,
            size * GIB if size else None,
            self.plain_when_single,
            rename=ctx.disk_name,
        )
        self.state = self.state_class()
        self.prepare(ctx)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if isinstance(layer, OutputHeadStage) and isinstance(layer.module, QuantizedLinear):
            self.state.head = layer.name
        self.check_layer(ctx, layer)
        self.write_quantized(ctx, layer.module, layer.name)
        # before the layer's own tensors: a processor's typed tensor may stand for a model
        # tensor of the same name (float_sparse's W16A16S weights)
        self.write_extra(ctx)
        self.write_tensors(layer.module.state_dict(prefix=f"{layer.name}."))

    def finalize(self, ctx: RunContext) -> None:
        self.finish_layers(ctx)
        self.write_extra(ctx)
        self.write_remaining(ctx)
        self.close_writer()
        self.write_config(ctx)

    def resume_state(self, ctx: RunContext) -> dict[str, Any]:
        return {
            "format": SAVER_STATE_FORMAT,
            "writer": self.writer.state(),
            **self.state.model_dump(mode="json"),
        }

    def restore(self, ctx: RunContext, state: dict[str, Any]) -> None:
        found = state.get("format")
        if found != SAVER_STATE_FORMAT:
            raise ValueError(
                f"its saver state has layout {found!r}, this msquant reads layout "
                f"{SAVER_STATE_FORMAT}: the checkpoint was written by another msquant version"
            )
        self.writer.restore(state["writer"])
        recorded = {k: v for k, v in state.items() if k not in ("format", "writer")}
        self.state = self.state_class.model_validate(recorded)

    # --- shared steps ----------------------------------------------------------------------

    def write_quantized(self, ctx: RunContext, root: nn.Module, prefix: str) -> None:
        """Pack and write every quantized linear under ``root`` not written yet (module order);
        the module's own state (int8 codes, float32 scale and offset) counts as written."""
        for name, module in root.named_modules(prefix=prefix):
            if not isinstance(module, QuantizedLinear) or name in self.state.quantized:
                continue
            if module.value_type.family not in self.value_families:
                raise QuantizationError(
                    f"{self.type_name}: {name} holds {module.value_type.name} codes, which this "
                    f"format does not store (it stores {', '.join(self.value_families)} value "
                    "types); use a saver that stores them (docs/value-types.md lists which)"
                )
            if module.act is not None and not self.stores_activation_scheme(
                module.act.scheme_name(module.bits)
            ):
                raise QuantizationError(
                    f"{self.type_name}: {name} has quantized activations "
                    f"({module.act.scheme_name(module.bits)}), which this format does not store; "
                    "export activation schemes with a format that stores them "
                    "(docs/ascend-format.md, activation schemes), or use float activations "
                    "(omit qconfig.act)"
                )
            if f"{name}.weight" in self.converted:
                raise QuantizationError(
                    f"{self.type_name}: transformers stores {name}.weight on disk through a "
                    "weight conversion (fused with other tensors, e.g. a checkpoint's wqkv), so "
                    f"its quantized form has no name in the checkpoint; keep {name} float "
                    "(exclude it)"
                )
            packed = self.pack(ctx, name, module)
            for tensor_name, tensor in packed.items():
                self.add(tensor_name, tensor)
            self.state.written.update(f"{name}.{key}" for key in module.state_dict())
            self.state.quantized.add(name)
            self.record_quantized(name, module, list(packed))

    def write_extra(self, ctx: RunContext) -> None:
        """Write the tensors processors added (``ctx.export_tensors``) not written yet.

        :raises QuantizationError: for a type this format does not store.
        """
        for name, (kind, tensor) in ctx.export_tensors.items():
            if name in self.state.written:
                continue
            if kind not in self.tensor_kinds:
                raise QuantizationError(
                    f"{self.type_name}: {name} is a {kind} tensor, which this format does not "
                    f"store{'' if not self.tensor_kinds else ' (it stores ' + ', '.join(self.tensor_kinds) + ')'}; "
                    "export with a saver that stores it (docs/ascend-format.md) or drop the "
                    "processor that adds it"
                )
            self.add(name, tensor)
            self.record_extra(name, kind)

    def write_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, Any]
    ) -> None:
        """Write, as they are, the tensors not written or replaced yet; those transformers
        saves through a conversion (MoonViT's q/k/v -> ``wqkv``) in the checkpoint's form."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        todo = {name: tensor for name, tensor in items if name not in self.state.written}
        converted = self.converted & todo.keys()
        if converted:
            todo = self.disk_form(todo)
            self.state.written.update(converted)
        for name, tensor in todo.items():
            self.add(name, tensor)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor in the writer and remember it."""
        self.writer.add(name, tensor)
        self.state.written.add(name)

    def check_fused(self, root: nn.Module, prefix: str) -> None:
        """Refuse fused groups (q/k/v, gate/up, and what the model's adapter fuses) under
        ``root`` whose shards differ: vLLM and vLLM-Ascend load each group as one matrix with
        one scheme.

        :raises QuantizationError: with :meth:`fused_message`.
        """
        schemes: dict[str, Hashable] = {}
        describe: dict[str, str] = {}
        for name, module in root.named_modules(prefix=prefix):
            if isinstance(module, QuantizedLinear):
                schemes[name], describe[name] = self.fused_scheme(name, module)
            elif isinstance(module, nn.Linear):
                schemes[name], describe[name] = self.fused_scheme(name, None)
        problems = self.adapter.fused_group_problems(schemes, describe)
        if problems:
            raise QuantizationError(self.fused_message(prefix, problems))

    # --- what a format provides --------------------------------------------------------------

    @abstractmethod
    def pack(self, ctx: RunContext, name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
        """The stored tensors of the quantized linear ``name``, keyed by full tensor name."""

    @abstractmethod
    def write_config(self, ctx: RunContext) -> None:
        """Write the format's metadata files (the weights are closed)."""

    def prepare(self, ctx: RunContext) -> None:
        """Extra setup of a format (default: none)."""

    def check_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Checks before a layer's tensors are written (default: the fused-layer check)."""
        self.check_fused(layer.module, layer.name)

    def fused_scheme(self, name: str, module: QuantizedLinear | None) -> tuple[Hashable, str]:
        """A linear's comparable scheme and its text for the fused check (``module`` None: a
        linear left in float)."""
        if module is None:
            return FLOAT, FLOAT
        scope = "per-channel" if module.group_size is None else f"group {module.group_size}"
        text = f"int{module.bits} {scope} {'sym' if module.symmetric else 'asym'}"
        return text, text

    def fused_message(self, prefix: str, problems: list[str]) -> str:
        """The error for fused groups under ``prefix`` whose shards differ."""
        return f"{self.type_name}: " + "; ".join(problems)

    def record_quantized(self, name: str, module: QuantizedLinear, packed: list[str]) -> None:
        """Remember what the format needs of a quantized linear just written (default: nothing)."""

    def record_extra(self, name: str, kind: str) -> None:
        """Remember a tensor a processor added, of type ``kind`` (default: nothing)."""

    def finish_layers(self, ctx: RunContext) -> None:
        """Work after the last layer, before the remaining tensors (default: none)."""

    def write_remaining(self, ctx: RunContext) -> None:
        """The tensors outside the decoder layers (embeddings, final norm, a float head), tied
        ones once, as Hugging Face stores them."""
        self.write_tensors(unique_state_items(ctx.model))

    def close_writer(self) -> None:
        """Write the last shard and the index (a format may rename the files here)."""
        self.writer.close()
