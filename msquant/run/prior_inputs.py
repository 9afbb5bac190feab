"""``spec.prior`` stages in a run: checked as msModelSlim reads them, never run.

msModelSlim 26.1.0 runs each prior stage as a run of its own and then builds the model of the
next stage afresh from ``model_path``, so what a stage's processors change in the weights never
reaches ``spec.process`` or the export (its prior stages exist for processors that pass a result
on through its run context, as ``adapt_rotation`` stage 1 does; msquant has none). msquant
therefore does not run them (:func:`msquant.config.spec.prior_stage_notes` says so in the log)
but refuses what msModelSlim would fail on before any weight is loaded: a stage ``dataset`` that
cannot be read, and a processor that cannot apply to the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msquant.config.resolve import ResolvedConfig
from msquant.contracts.processor import Processor, flatten_processors
from msquant.errors import QuantizationError
from msquant.load.calibration import read_calibration_texts, resolve_dataset_path
from msquant.model.adapter_registry import adapter_for
from msquant.model.layers import DecoderLayer
from msquant.planning.model import ModulePlanner

__all__ = ["check_prior_datasets", "check_prior_stages"]

#: How many module names a refusal lists.
LISTED = 3


def check_prior_datasets(resolved: ResolvedConfig) -> None:
    """Read every prior stage's own ``dataset`` (msModelSlim loads it before the stage runs).

    :raises msquant.MsquantInputError: (a subclass) when one is missing or unreadable.
    """
    for stage in resolved.config.spec.prior:
        if stage.dataset is not None:
            read_calibration_texts(resolve_dataset_path(stage.dataset, resolved.directory))


def check_prior_stages(stages: list[list[Processor]], meta_model: Any) -> None:
    """Every prior processor's ``check_model`` on the weightless model, and no quantization in
    a prior stage; all problems at once.

    :raises QuantizationError: listing them, each under its ``spec.prior[i]`` stage.
    """
    layers = adapter_for(meta_model).decoder_layers(meta_model)
    problems = [
        f"spec.prior[{index}]: {message}"
        for index, processors in enumerate(stages)
        for processor in processors
        for message in processor.check_model(meta_model, layers)
    ]
    for index, processors in enumerate(stages):
        problems += _quantizing(index, processors, meta_model, layers)
    if problems:
        count = len(problems)
        raise QuantizationError(
            f"the spec.prior stages cannot be applied to this model ({count} problem"
            f"{'s' if count > 1 else ''}):\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _quantizing(
    index: int, processors: list[Processor], meta_model: Any, layers: Sequence[DecoderLayer]
) -> list[str]:
    """A prior stage that would quantize linear layers, one problem per entry: msModelSlim
    reloads the weights after the stage, so its export holds none of that quantization, and a
    reader of the YAML would expect it there."""
    problems = []
    for processor in flatten_processors(processors):
        if not isinstance(processor, ModulePlanner):
            continue
        decisions = processor.plan_modules(meta_model, layers)
        chosen = [
            name
            for name, decision in decisions.items()
            if decision.scheme is not None and not decision.scheme.skipped
        ]
        if chosen:
            shown = ", ".join(chosen[:LISTED]) + (
                f" and {len(chosen) - LISTED} more" if len(chosen) > LISTED else ""
            )
            problems.append(
                f"spec.prior[{index}]: {processor.type_name} would quantize {len(chosen)} "
                f"linear layer(s) ({shown}) in a prior stage, which changes nothing in the export "
                "(msModelSlim reloads the weights after each prior stage; msquant does not run "
                "them): move the entry into spec.process"
            )
    return problems
