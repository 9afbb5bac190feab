"""The inputs of ``spec.prior`` stages, checked before any weight is loaded: each stage's
calibration texts (its own ``dataset``, else the main calibration set) and its processors'
model checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msquant.config.resolve import ResolvedConfig
from msquant.errors import QuantizationError
from msquant.load.calibration import read_calibration_texts, resolve_dataset_path
from msquant.model.adapter_registry import adapter_for
from msquant.model.layers import DecoderLayer
from msquant.planning.model import ModulePlanner
from msquant.plugin.processor import Processor, flatten_processors
from msquant.run.runner import needs_calibration

__all__ = ["check_prior_stages", "prior_calibration_texts"]

#: How many module names a refusal lists.
LISTED = 3

#: What the log calls the main calibration set when a prior stage uses it.
MAIN_SET = "the main calibration set"


def prior_calibration_texts(
    resolved: ResolvedConfig, stages: list[list[Processor]], main_texts: list[str] | None
) -> list[tuple[str, list[str] | None]]:
    """``(dataset, texts)`` of each prior stage: its own ``dataset`` read (and validated even
    when no processor of the stage calibrates, as ``spec.dataset`` is), else the main texts;
    ``texts`` is None when the stage does not calibrate."""
    found: list[tuple[str, list[str] | None]] = []
    for stage, processors in zip(resolved.config.spec.prior, stages, strict=True):
        needed = needs_calibration(processors)
        if stage.dataset is None:
            found.append((MAIN_SET, main_texts if needed else None))
            continue
        path = resolve_dataset_path(stage.dataset, resolved.directory)
        texts = read_calibration_texts(path)
        found.append((str(path), texts if needed else None))
    return found


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
    """A prior stage that would quantize linear layers, one problem per entry: the modules it
    quantizes are then already quantized when ``spec.process`` runs, which quantizes nothing
    more, and the run report (which counts ``spec.process``'s modules) lists none of them: a
    regression gate would compare nothing."""
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
                f"linear layer(s) ({shown}) in a prior stage; prior stages prepare the float "
                "model for spec.process (msModelSlim uses them for rotations), and what they "
                "quantize is missing from the run report: move the entry into spec.process"
            )
    return problems
