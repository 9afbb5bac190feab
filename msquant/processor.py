"""The processor contract: a class with a pydantic config, registered under its YAML ``type``.

A run calls, for every processor in ``spec.process`` order followed by ``spec.save`` order:

================  ==========================================================================
hook              when it runs
================  ==========================================================================
check_config      at validation time, no model needed (semantic checks beyond the schema)
check_model       after the model's *config* is read, on a weightless (meta) copy of the model,
                  before any weight is loaded: shape-dependent errors (e.g. group_size)
setup             once, the model loaded, before the first decoder layer
before_layer      for each decoder layer, before calibration data flows through it
after_layer       for each decoder layer, after calibration data flowed through it
finalize          once, after the last layer (savers write non-layer tensors and metadata)
================  ==========================================================================

Processors that set ``requires_calibration`` make the runner capture decoder-layer inputs and run
each layer forward over the calibration set between ``before_layer`` and ``after_layer``.
"""

from __future__ import annotations

from abc import ABC
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict
from torch import nn

from msquant.errors import ConfigIssue

if TYPE_CHECKING:
    from msquant.context import DecoderLayer, RunContext

__all__ = ["Stage", "ProcessorConfig", "Processor"]

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

    def setup(self, ctx: RunContext) -> None:
        """Prepare for a run on the loaded model."""

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Act on one decoder layer before calibration data flows through it."""

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Act on one decoder layer after calibration data flowed through it."""

    def finalize(self, ctx: RunContext) -> None:
        """Finish the run (write metadata, non-layer tensors, summaries)."""
