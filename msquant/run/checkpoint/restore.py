"""Taking up a checkpoint when a killed run resumes: the finished layers rebuilt from the layer
store (their float tensors too, in a run that transforms weights), the hidden states entering the
next layer (the transform probe's too), the report's layer records, the transforms recorded and
the processors' states (:meth:`RunCheckpoints.restore`, :meth:`RunCheckpoints.restore_finished`).

What a transform changes outside the decoder layers (quarot's rotated embedding and head, its
matrices) is not in the checkpoint: the resumed run's ``setup`` derives it again, from the same
model and seed. That it did is checked here: every fingerprint ``setup`` recorded must be the one
the interrupted run recorded (:func:`take_up_transforms`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from msquant.contracts.context import RunContext
from msquant.export.marker import sha256_file
from msquant.export.shards import WriterStateError, remove_temporaries
from msquant.run.checkpoint.layout import OUTSIDE_KEY, PROBE_KEY, WORLD_SIZE_HINT, ResumeError
from msquant.run.checkpoint.progress import layer_key

if TYPE_CHECKING:
    from msquant.contracts.processor import Processor
    from msquant.run.capture import CalibrationActivations
    from msquant.run.checkpoint.folder import RunCheckpoints

__all__ = ["take_up_finished", "take_up_layers", "take_up_transforms"]

logger = logging.getLogger(__name__)


def take_up_layers(
    checkpoints: RunCheckpoints,
    ctx: RunContext,
    processors: Sequence[Processor],
    activations: CalibrationActivations | None,
) -> int:
    """Take up a checkpoint taken after a layer (this process's share of it): rebuild the finished
    layers, load the hidden states entering the next one, restore the report's layer records and
    every processor's state.

    :returns: the index of the first layer still to run.
    :raises ResumeError: when the checkpoint does not fit this run or its files are damaged.
    """
    progress = checkpoints.progress
    assert progress is not None and not checkpoints.finished
    ranks = progress["ranks"]
    if len(ranks) != checkpoints.dist.world_size:  # the fingerprint says so first
        raise ResumeError(
            f"--resume: the checkpoint was taken by {len(ranks)} process(es), this run has "
            f"{checkpoints.dist.world_size}; {WORLD_SIZE_HINT}"
        )
    mine = ranks[checkpoints.dist.rank]
    recorded = [entry["type"] for entry in mine["processors"]]
    if recorded != [p.type_name for p in processors]:
        raise ResumeError(
            f"--resume: the checkpoint's processors {recorded} are not this run's "
            f"{[p.type_name for p in processors]}"
        )
    done = int(progress["layers_done"])
    take_up_transforms(ctx, progress)
    _rebuild(checkpoints, ctx, done)
    if activations is not None or ctx.probe is not None:
        _load_hidden(checkpoints, ctx, activations, mine["hidden"], done)
    ctx.report.restore_layer_records(progress["report"])
    for processor, entry in zip(processors, mine["processors"], strict=True):
        try:
            processor.restore(ctx, entry["state"])
        except (WriterStateError, OSError, KeyError, TypeError, ValueError) as error:
            raise ResumeError(
                f"--resume: {processor.type_name} cannot take up its checkpoint ({error}); "
                "start over with --overwrite (without --resume)"
            ) from error
    return done


def take_up_finished(
    checkpoints: RunCheckpoints, ctx: RunContext, progress: Mapping[str, Any]
) -> None:
    """Take up a ``finished`` checkpoint (process 0): the export files must be there; the
    quantized modules (the head's too) and the report's layer records are restored.

    :raises ResumeError: when the export files are missing.
    """
    if not checkpoints.export_dir.is_dir() or not any(checkpoints.export_dir.iterdir()):
        raise ResumeError(
            f"--resume: the export files of the checkpoint in {checkpoints.directory} are missing; "
            "start over with --overwrite (without --resume)"
        )
    # a kill may have come before commit_finished did
    removed = remove_temporaries(checkpoints.export_dir)
    if removed:
        logger.debug("checkpoint: %d temporary file(s) of the writers removed", removed)
    _rebuild(checkpoints, ctx, len(ctx.layers))
    checkpoints.store.rebuild(ctx.model, OUTSIDE_KEY, weightless=False)
    ctx.report.restore_layer_records(progress["report"])
    ctx.report.probe_tokens = progress.get("probe_tokens")
    ctx.transforms.restore(progress.get("transforms") or {"processors": [], "tensors": {}})


def take_up_transforms(ctx: RunContext, progress: Mapping[str, Any]) -> None:
    """Replace what the resumed run's ``setup`` recorded of its transforms (``ctx.transforms``)
    by the checkpoint's records (those of the finished layers too), once ``setup`` is shown to
    have derived again what the interrupted run's did: the same parameters, and the same values
    of every tensor it set (the checkpoint does not hold those tensors, only their fingerprints).

    :raises ResumeError: when ``setup`` derived something else.
    """
    recorded = progress.get("transforms") or {"processors": [], "tensors": {}}
    fresh = ctx.transforms.state()
    problems = []
    if recorded["processors"][: len(fresh["processors"])] != fresh["processors"]:
        problems.append(
            f"parameters {fresh['processors']}, the interrupted run's {recorded['processors']}"
        )
    for name, entry in fresh["tensors"].items():
        then = recorded["tensors"].get(name)
        if then is None or (then["by"] == entry["by"] and then != entry):
            problems.append(f"{name} set to sha256 {entry['sha256'][:12]}... by {entry['by']}")
    if problems:
        raise ResumeError(
            "--resume: the processors' setup did not derive again what the interrupted run's did "
            f"({'; '.join(problems)}): the transform is not deterministic, or the model changed; "
            "start over with --overwrite (without --resume)"
        )
    ctx.transforms.restore(recorded)


def _rebuild(checkpoints: RunCheckpoints, ctx: RunContext, count: int) -> None:
    """The first ``count`` layers as a run leaves them: quantized linears in place (process 0
    only: the others run no saver and check nothing), and in a streamed run every tensor
    released to the meta device."""
    streamed = ctx.streamed
    for layer in ctx.layers[:count]:
        if checkpoints.dist.is_main:
            key = layer_key(layer.index)
            checkpoints.store.rebuild(ctx.model, key, weightless=streamed is not None)
        loaded = any(not t.is_meta for t in layer.module.state_dict().values())
        if streamed is not None and loaded:  # capture loads the first layer
            streamed.release(layer.module)


def _load_hidden(
    checkpoints: RunCheckpoints,
    ctx: RunContext,
    activations: CalibrationActivations | None,
    info: Mapping[str, Any] | None,
    done: int,
) -> None:
    """The hidden states entering layer ``done`` (this process's share, recorded as
    ``info``; the transform probe's too), in place of the captured ones."""
    path = None if info is None else checkpoints.directory / info["file"]
    whose = f" of process {checkpoints.dist.rank}" if checkpoints.dist.active else ""
    probed = None if ctx.probe is None else ctx.probe.activations
    if any(a is not None and a.takes_state_from_before(done) for a in (activations, probed)):
        raise ResumeError(
            f"--resume: layer {done} takes what an earlier decoder layer returned beside its "
            "hidden states (as GLM-5's indexer hands on its top-k token indices), which a "
            "checkpoint does not hold; start over with --overwrite (without --resume)"
        )
    if (
        info is None
        or path is None
        or not path.is_file()
        or path.stat().st_size != info["bytes"]
        or sha256_file(path) != info.get("sha256")
        or (ctx.probe is not None and not info.get("probe"))
    ):
        raise ResumeError(
            f"--resume: the hidden states{whose} of the checkpoint in {checkpoints.directory} are "
            "missing or damaged; start over with --overwrite (without --resume)"
        )
    with safe_open(str(path), framework="pt") as handle:
        hidden = [handle.get_tensor(layer_key(i)) for i in range(int(info["batches"]))]
        probe = handle.get_tensor(PROBE_KEY) if ctx.probe is not None else None
    if probe is not None and ctx.probe is not None:
        try:
            ctx.probe.resume_at(done, probe)
        except ValueError as error:
            raise ResumeError(f"--resume: {error}{whose}") from error
    if activations is None:
        return
    captured = activations.hidden
    shapes = [(tuple(h.shape), h.dtype) for h in hidden]
    if shapes != [(tuple(h.shape), h.dtype) for h in captured]:
        raise ResumeError(
            f"--resume: the checkpoint's hidden states{whose} {shapes} do not match the "
            "calibration batches of this run"
        )
    activations.hidden = [h.to(c.device) for h, c in zip(hidden, captured, strict=True)]
    activations.next_layer = done
