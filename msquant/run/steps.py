"""The steps of a run after its inputs are checked (:func:`msquant.quantize` calls them in order):
hold the save path, load the model, start the run context, run the layers, finish the export.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from msquant.contracts.context import RunContext
from msquant.contracts.distributed import PeerLostError
from msquant.export.recovery import SCRATCH_INFIX, sibling
from msquant.model.layers import layer_list_name
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.opening import checkpoint_blocker, open_checkpoints
from msquant.run.checkpoint.progress import interrupted_work
from msquant.run.exports import mark_export, model_to_evaluate, verify_exports
from msquant.run.inputs import RunInputs
from msquant.run.placement import LoadedModel, load_for_run
from msquant.run.reporting import start_report, write_run_report
from msquant.run.runner import run_layer_wise
from msquant.run.save_path import locked_save_path

__all__ = ["finish_run", "hold_save_path", "load_model", "run_layers", "start_run"]

logger = logging.getLogger(__name__)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11), or its effect on 3.10: the CLI prints the notes of
    an interruption after its own line."""
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)


@contextmanager
def hold_save_path(inputs: RunInputs) -> Iterator[RunCheckpoints | None]:
    """Lock the save path until the export is in place, and decide how the run uses its
    checkpoint folder: the run's checkpoints (fresh or resumed), or None when not checkpointed."""
    options = inputs.options
    blocker = checkpoint_blocker(inputs.processors, options.checkpoints)
    with locked_save_path(
        inputs.target,
        options.overwrite,
        inputs.model_path,
        inputs.dist,
        lambda: open_checkpoints(
            inputs.target,
            inputs.fingerprint,
            resume=options.resume,
            overwrite=options.overwrite,
            blocker=blocker,
            dist=inputs.dist,
        ),
    ) as run_checkpoints:
        try:
            yield run_checkpoints
        except BaseException as exc:
            if isinstance(exc, PeerLostError) or not isinstance(exc, Exception | GeneratorExit):
                # interrupted (Ctrl-C, SIGTERM, a lost process): say what became of the work
                add_note(exc, interrupted_work(inputs.target, blocker))
            raise


@contextmanager
def load_model(inputs: RunInputs, checkpoints: RunCheckpoints | None) -> Iterator[LoadedModel]:
    """The run's model, whole or streamed (:func:`~msquant.run.placement.load_for_run`); a
    streamed run's scratch folder goes with its checkpoints, else beside the save path."""
    target, dist = inputs.target, inputs.dist
    with load_for_run(
        inputs.model_dir,
        inputs.meta_model,
        streaming=inputs.streaming,
        scratch_parent=(
            target.parent
            if checkpoints is None
            else checkpoints.directory  # a killed run's scratch goes with its work
        ),
        scratch_prefix=(sibling(target, SCRATCH_INFIX).name if checkpoints is None else None),
        # a checkpointed run's layer store is the reference of the released layers
        keep_reference=inputs.options.verify and dist.is_main and checkpoints is None,
        trust_remote_code=inputs.options.trust_remote_code,
    ) as loaded:
        logger.info(
            "%s: %d decoder layers found under %s (%s)",
            type(loaded.model).__name__,
            len(loaded.layers),
            layer_list_name(loaded.layers),
            "streamed from disk one at a time" if inputs.streaming else "all loaded in memory",
        )
        yield loaded


def start_run(inputs: RunInputs, loaded: LoadedModel, staging: Path) -> RunContext:
    """The context the processors share, its report's run-wide fields filled in."""
    resolved, dist = inputs.resolved, inputs.dist
    config_text = resolved.text or yaml.safe_dump(
        resolved.config.model_dump(mode="json"), sort_keys=False
    )
    ctx = RunContext(
        loaded.model, inputs.model_dir, staging, inputs.backend, loaded.layers, config_text,
        inputs.options.progress and dist.is_main, streamed=loaded.streamed, spill=loaded.spill,
        dist=dist, experts=loaded.experts, checkpoint_names=loaded.checkpoint_names,
        msmodelslim_model_type=inputs.options.model_type,
    )  # fmt: skip
    start_report(ctx, resolved.config, inputs.samples, inputs.backend)
    return ctx


def run_layers(ctx: RunContext, inputs: RunInputs, checkpoints: RunCheckpoints | None) -> None:
    """The layer-wise run; in a ``dp_layer_wise`` group only process 0 runs the savers."""
    dist = inputs.dist
    processors = inputs.processors
    workers = processors if dist.is_main else [p for p in processors if p.stage != "save"]
    run_layer_wise(
        ctx,
        workers,
        inputs.samples,
        progress=inputs.options.progress and dist.is_main,
        checkpoints=checkpoints,
        media=inputs.media,
    )


def finish_run(
    ctx: RunContext, inputs: RunInputs, checkpoints: RunCheckpoints | None, started: float
) -> None:
    """Process 0 alone verifies the exports, evaluates the quantized model and writes the
    report, then the export marker (last: it lists every file)."""
    if not inputs.dist.is_main:
        return
    if inputs.options.verify:
        stored = None if checkpoints is None else checkpoints.store
        verify_exports(ctx, inputs.processors, stored)
    if inputs.evaluation is not None and inputs.eval_ids is not None:
        model = model_to_evaluate(ctx, inputs.processors, inputs.options.trust_remote_code)
        ctx.report.evaluation = inputs.evaluation.evaluate(model, inputs.eval_ids, inputs.backend)
    write_run_report(ctx, started)
    mark_export(ctx, inputs.processors)
