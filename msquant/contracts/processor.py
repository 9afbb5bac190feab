"""The processor contract: a class with a pydantic config, registered under its YAML ``type``.

A run calls, for every processor in ``spec.process`` order followed by ``spec.save`` order:

================  ==========================================================================
hook              when it runs
================  ==========================================================================
check_config      at validation time, no model needed (semantic checks beyond the schema)
check_model       after the model's *config* is read, on a weightless (meta) copy of the model,
                  before any weight is loaded: shape-dependent errors (e.g. group_size)
memory_bytes      on the weightless model, for each decoder layer, when a memory limit is given
                  (``--max_memory``): what the processor holds while the run works on the layer
setup             once, the model loaded, before the first decoder layer
before_layer      for each decoder layer, before calibration data flows through it
before_pass       for each calibration pass over the layer (see below), before it
after_pass        for each calibration pass over the layer, after it
after_layer       for each decoder layer, after calibration data flowed through it
finalize          once, after the last layer (savers write non-layer tensors and metadata)
resume_state      after each decoder layer, in a checkpointed run (only when ``resumable``)
restore           once, when a killed run resumes, after ``setup`` (only when ``resumable``)
================  ==========================================================================

Processors that set ``requires_calibration`` make the runner capture decoder-layer inputs and run
each layer forward over the calibration set between ``before_layer`` and ``after_layer``. A
processor that cannot hold what it gathers from one pass for all of a layer's modules at once
(GPTQ Hessians of hundreds of MoE experts), or that quantizes a layer's modules in stages
(true-sequential GPTQ: the attention's linears before the MLP's Hessians are gathered), asks for
more passes with :meth:`Processor.calibration_passes`: the runner then pushes the calibration set
through the layer that many times (the most any processor asks for), calling ``before_pass`` /
``after_pass`` around each. A processor may replace modules of the layer in ``after_pass`` (the
later passes then run through them). Forward hooks registered in ``before_layer`` see every pass;
register them in ``before_pass`` and remove them in ``after_pass`` to see one.

Processors that rewrite the layer (``rewrites_layer``): the YAML order decides what each processor
sees. The processors are grouped in ``spec.process`` order, each group closed by a calibrating
processor that sets ``rewrites_layer``; each group gets its own calibration passes (``before_pass`` /
``after_pass`` go to the group's processors only, pass indices counted from 0 within the group),
the groups in order, so a processor after a smoothing processor gathers its activation ranges or
Hessians on the smoothed layer. A group whose processors gather nothing costs no forward. Without
such a processor there is a single group, every processor, exactly as described above.
``after_layer`` is called for every processor after the last group's passes. The next layer's
inputs are then the outputs of the first pass of the last group that calibrates (msModelSlim feeds
the next layer the outputs of the last calibrating processor's forward).

Processors that observe the finished layer (``calibrates_after_previous``): a calibrating processor
that sets it starts a new segment of the layer's processors. The segments run one after another,
each with its own ``before_layer``, passes (grouped as above) and ``after_layer``, so such a
processor calibrates on the layer as the processors before it left it (quantized linears
included), as msModelSlim's entries do. The next layer's inputs are the outputs of the first pass
of the last segment that calibrates.

What the next layer is calibrated on: by default the outputs of the first pass, computed before
any processor changed the layer (the float model's activations, as msModelSlim does). When a
processor sets ``calibrate_on_quantized``, the runner instead runs the layer once more after every
``after_layer`` and feeds those outputs (the already quantized layers' outputs, as the GPTQ
authors, GPTQModel and llm-compressor do).

Checkpoints (:mod:`msquant.run.checkpoint`): a run whose processors are all ``resumable`` records, after
every decoder layer, each processor's :meth:`Processor.resume_state` (JSON) beside the layers'
quantized linears and the hidden states entering the next layer. ``msquant quant --resume`` then
calls ``setup``, rebuilds the finished layers' :class:`msquant.plugin.QuantizedLinear` modules (and,
in a run that transforms weights, their other tensors, the probe's hidden states and
``ctx.transforms``), calls :meth:`Processor.restore` with the recorded state and continues with
the next layer; the export must come out identical to an uninterrupted run's.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Sequence
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Literal,
    Protocol,
    runtime_checkable,
)

from pydantic import BaseModel, ConfigDict
from torch import nn

from msquant.errors import ConfigIssue

if TYPE_CHECKING:
    from msquant.contracts.context import RunContext
    from msquant.contracts.memory import CalibrationSize
    from msquant.contracts.transforms import TransformedExport
    from msquant.model.layers import DecoderLayer

__all__ = [
    "Stage",
    "ProcessorConfig",
    "Processor",
    "OutputHeadUser",
    "NestedProcessors",
    "ProcessorConfigList",
    "ProcessorContainer",
    "nested_fields",
    "flatten_processors",
]

Stage = Literal["process", "save"]


class ProcessorConfig(BaseModel):
    """Base of every processor config: unknown keys are rejected; ``type`` selects the processor."""

    model_config = ConfigDict(extra="forbid")

    type: str


class Processor(ABC):
    """Base class of pluggable processors (quantizers, savers, analysers).

    Subclasses set ``type_name`` (the YAML ``type``), ``config_class`` (a :class:`ProcessorConfig`
    subclass whose ``type`` field is ``Literal[type_name]``) and ``stage`` (``"process"`` for
    ``spec.process`` entries, ``"save"`` for ``spec.save`` entries), then override the hooks
    they need. Processors keep their per-run state on ``self``; one instance serves one run.
    """

    type_name: ClassVar[str]
    config_class: ClassVar[type[ProcessorConfig]]
    stage: ClassVar[Stage] = "process"
    #: Class default; an instance may set its own value in ``__init__`` (e.g. depending on its config).
    requires_calibration: bool = False
    #: Whether a run with this processor may be checkpointed and resumed after a kill. Set it when
    #: everything the processor carries from one layer to the next is in :meth:`resume_state`
    #: (nothing, for a stateless processor) and a finished layer is rebuilt from what the
    #: checkpoint keeps of it: its :class:`msquant.plugin.QuantizedLinear` modules, and in a run
    #: whose processors set ``transforms_weights`` (the model kept in memory) its other tensors
    #: too. What :meth:`setup` changes outside the layers is not kept: the resumed run's ``setup``
    #: derives it again, so it must be deterministic (a ``transforms_weights`` processor's
    #: fingerprints from ``setup`` are compared with the checkpoint's). One processor without it
    #: turns checkpoints off.
    resumable: ClassVar[bool] = False
    #: Whether the processor changes float weights into others computing the same function (a
    #: rotation, a smoothing): the export then differs from the original model tensor by tensor.
    #: A run records such processors in ``msquant_export.json`` (``weights_transformed_by``), and
    #: ``msquant verify --model_path`` compares only names, not values, with the original, and
    #: the logits of both models on a few tokens. Such a processor records its parameters and the
    #: float tensors it set in ``ctx.transforms`` (:class:`msquant.plugin.TransformLog`). It
    #: quantizes nothing: a config whose other entries quantize no linear layer is refused
    #: (unless ``allow_float_export``), as a config without them would be.
    transforms_weights: ClassVar[bool] = False
    #: Class default; an instance may set its own value. When any processor of a run sets it,
    #: each decoder layer's inputs are the previous layer's outputs after every ``after_layer``
    #: (one more forward per layer), instead of the float outputs of its first calibration pass.
    calibrate_on_quantized: bool = False
    #: Class default; an instance may set its own value. When a calibrating processor of a run
    #: clears it, the calibration samples go through each layer one at a time, in the dataset's
    #: order, instead of stacked in batches of equal length (statistics gathered online, where a
    #: sample's treatment depends on the samples before it, e.g. static activation ranges).
    batch_calibration: bool = True
    #: Class default; an instance may set its own value. Set it when the processor changes the
    #: layer's weights at the end of its calibration passes (in the ``after_pass`` of its last
    #: pass; e.g. smoothing scales folded into a norm and the linears after it) and the
    #: processors after it in ``spec.process`` must gather their statistics on the changed layer:
    #: the runner then runs its passes first, and gives the processors after it passes of their
    #: own over the rewritten layer (none when none of them calibrates).
    rewrites_layer: bool = False
    #: Class default; an instance may set its own value. Set it when the processor's calibration
    #: must see the layer as the processors before it in ``spec.process`` leave it, their
    #: ``after_layer`` included (msModelSlim runs each entry's forward after the entries before it
    #: finished the layer, e.g. attention activations observed through already quantized
    #: linears). The runner then finishes the processors before it (``before_layer``, passes,
    #: ``after_layer``) before it calls this processor's ``before_layer`` and runs its passes; the
    #: processors after it go with it (see :func:`msquant.run.runner.layer_segments`). It has an
    #: effect only on a calibrating processor that is not the first.
    calibrates_after_previous: bool = False
    #: Set to the reason when a config may hold at most one entry of this processor, counting
    #: every place an entry can be (``spec.prior`` stages, ``spec.process``, the entries of a
    #: container): validation then refuses every entry after the first, naming both entries' YAML
    #: paths and this reason (e.g. a rotation whose export ships one matrix: two entries would
    #: rotate twice and ship only one of them).
    once_per_config: ClassVar[str | None] = None

    #: Set by the run when several savers share one save path: this saver then writes into
    #: ``save_path/<output_subdir>`` (see :meth:`output_dir`).
    output_subdir: str | None = None

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config

    def output_dir(self, ctx: RunContext) -> Path:
        """The folder this processor writes into (created on first use)."""
        directory = ctx.output_dir / self.output_subdir if self.output_subdir else ctx.output_dir
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        """Semantic checks that need no model; issue paths are relative to this processor's entry."""
        return []

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        """Model-dependent checks on a weightless copy of the model; return one message per problem."""
        return []

    def memory_bytes(
        self, model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
    ) -> dict[str, int]:
        """What this processor holds at once while the run works on ``layer``, in bytes, by what
        it is (e.g. ``{"gptq Hessians": ..., "gptq solve (largest module)": ...}``): the memory
        estimate of ``--max_memory`` and ``msquant plan --max_memory`` adds it to the runner's
        own (the layer's weights, the calibration hidden states) for every decoder layer of the
        weightless ``model``, before any weight is loaded. Count what lives through the layer
        (statistics, Hessians, quantized copies, matrices kept for the whole run) and the largest
        working copy a step makes; a close upper bound is the aim. Default: nothing."""
        return {}

    @classmethod
    def check_transform(cls, record: dict[str, Any], export: TransformedExport) -> list[str]:
        """For ``msquant verify``: check what this processor recorded of its transform
        (``ctx.transforms.describe(type_name, **params)``, here ``record``: ``type`` and the
        params, as read back from ``msquant_export.json``, so possibly edited) against the
        export, from the export alone; one message per problem. A malformed record is a problem
        to report, not an exception. Default: nothing to check (the fingerprints of the float
        tensors a processor set are checked by verify itself)."""
        return []

    def setup(self, ctx: RunContext) -> None:
        """Prepare for a run on the loaded model."""

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Act on one decoder layer before calibration data flows through it."""

    def calibration_passes(self, layer: DecoderLayer) -> int:
        """How many times the calibration set must flow through ``layer`` for this processor
        (called on the weightless model too, for the memory estimate; default 1)."""
        return 1

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Act before calibration pass ``index`` (0-based) over ``layer``; every processor gets
        the call for every pass the runner makes, also past its own ``calibration_passes``."""

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        """Act after calibration pass ``index`` over ``layer`` (before the next pass starts)."""

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Act on one decoder layer after calibration data flowed through it."""

    def finalize(self, ctx: RunContext) -> None:
        """Finish the run (write metadata, non-layer tensors, summaries)."""

    def resume_state(self, ctx: RunContext) -> dict[str, Any]:
        """What this processor carries from the finished layers to the next ones, as JSON-able
        data (a checkpoint; called after each layer's ``after_layer`` when ``resumable``).

        Savers return their writer's :meth:`msquant.plugin.export.ShardedSafetensorsWriter.state` and what
        they recorded about the written tensors; a stateless processor keeps this default.
        """
        return {}

    def restore(self, ctx: RunContext, state: dict[str, Any]) -> None:
        """Take up the state :meth:`resume_state` recorded (a resumed run calls this after
        ``setup``, before the first layer it runs)."""


@runtime_checkable
class OutputHeadUser(Protocol):
    """A processor that may need the output head stage (e.g. ``linear_quant`` with ``lm_head``)."""

    def uses_output_head(self, ctx: RunContext) -> bool:
        """Whether the runner must run the head stage for this processor in this run."""
        ...


class NestedProcessors:
    """Marker in a config field's ``Annotated`` metadata: the field holds processor entries.

    The engine validates each entry of such a field against every registered ``spec.process``
    processor (discriminated on ``type``, errors located as ``...configs[0].qconfig...``), runs
    their ``check_config`` and builds their processors, which it hands to the container
    through :meth:`ProcessorContainer.adopt_children`. Use :data:`ProcessorConfigList`.
    """

    def __repr__(self) -> str:
        return "NestedProcessors()"


#: The type of a config field holding a list of processor entries (a container's children).
ProcessorConfigList = Annotated[list[ProcessorConfig], NestedProcessors()]


def nested_fields(config_class: type[BaseModel]) -> list[str]:
    """The fields of ``config_class`` that hold processor entries (:data:`ProcessorConfigList`)."""
    return [
        name
        for name, field in config_class.model_fields.items()
        if any(isinstance(item, NestedProcessors) for item in field.metadata)
    ]


@runtime_checkable
class ProcessorContainer(Protocol):
    """A processor whose config holds processor entries (:data:`ProcessorConfigList` fields):
    the engine builds a processor for each entry, in order, and hands them over once, right
    after the container is built."""

    def adopt_children(self, children: list[Processor]) -> None:
        """Take the processors built from the config's nested entries (in field, then list order)."""
        ...


def flatten_processors(processors: Sequence[Processor]) -> list[Processor]:
    """``processors`` with every container followed by its children (recursively), for checks
    that concern each processor a run calls (e.g. whether all of them are resumable)."""
    out: list[Processor] = []
    for processor in processors:
        out.append(processor)
        out += flatten_processors(getattr(processor, "children", ()))
    return out
