"""The checkpoint folder of one run: held for the whole run, written after each layer, taken up
when the run resumes.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from msquant.contracts.context import RunContext
from msquant.contracts.distributed import SINGLE, Distributed, PeerLostError
from msquant.errors import OutputPathError
from msquant.export.marker import sha256_file
from msquant.export.recovery import (
    OWNER_FILE,
    is_owned_dir,
    make_owned_dir,
    mark_owned,
    owned_dir_problem,
)
from msquant.export.shards import remove_temporaries
from msquant.export.staging import CommitRefusedError
from msquant.model.layers import DecoderLayer
from msquant.run.agree import agree
from msquant.run.checkpoint.durable import save_tensors_atomically, write_json_atomically
from msquant.run.checkpoint.layout import (
    EXPORT_DIR,
    HIDDEN_PREFIX,
    LAYERS_DIR,
    OUTSIDE_KEY,
    PROBE_KEY,
    PROGRESS_FILE,
    PROGRESS_FORMAT,
    SCRATCH_PREFIX,
    STAGE_FINISHED,
    STAGE_LAYERS,
    ResumeError,
)
from msquant.run.checkpoint.progress import describe_progress, hidden_name, layer_key
from msquant.run.checkpoint.restore import take_up_finished, take_up_layers
from msquant.run.checkpoint.store import LayerStore

if TYPE_CHECKING:
    from msquant.contracts.processor import Processor
    from msquant.run.capture import CalibrationActivations

__all__ = ["RunCheckpoints"]

logger = logging.getLogger(__name__)


class RunCheckpoints:
    """The checkpoint folder of one run: what the runner calls after each layer and on resume.

    :param directory: the folder (:func:`partial_path`).
    :param fingerprint: the run's :func:`run_fingerprint`.
    :param progress: the checkpoint to resume from, or None for a fresh run (the folder is then
        emptied when the run starts).
    :param dist: this process's place in a ``dp_layer_wise`` group (process 0 owns the folder;
        every process writes its own hidden states).
    """

    def __init__(
        self,
        directory: Path,
        fingerprint: Mapping[str, Any],
        progress: Mapping[str, Any] | None,
        dist: Distributed = SINGLE,
    ) -> None:
        self.directory = directory
        self.fingerprint = dict(fingerprint)
        self.progress = progress
        self.dist = dist
        self.store = LayerStore(directory / LAYERS_DIR)
        #: Whether each finished layer's float tensors are kept with its quantized linears (and
        #: at the end those outside the layers): the runner sets it for a run whose processors
        #: transform float weights and keep the model in memory (a streamed run releases its
        #: finished layers, whose tensors are in the export files already).
        self.keeps_floats = False

    @property
    def export_dir(self) -> Path:
        """The staging folder of the export (moved to the save path at the end)."""
        return self.directory / EXPORT_DIR

    @property
    def resuming(self) -> bool:
        """Whether this run continues from a checkpoint."""
        return self.progress is not None

    @property
    def finished(self) -> bool:
        """Whether the checkpoint resumed from was taken after every saver finalised."""
        return self.progress is not None and self.progress.get("stage") == STAGE_FINISHED

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Hold the folder for the whole run (enter it before the model is loaded: a streamed
        run's scratch folder goes in it): created, emptied for a fresh run, rid of the scratch
        folders of killed runs when resuming; removed after success or an error, kept (with a
        hint) when the run is interrupted after a checkpoint, when the checkpoint cannot be taken
        up (:class:`ResumeError`: nothing is changed, ``--overwrite`` discards it) and when the
        finished export could not be moved into place
        (:class:`~msquant.export.staging.CommitRefusedError`: ``--resume`` moves it later).

        The caller holds the save path's lock (:class:`~msquant.export.recovery.SavePathLock`).
        In a ``dp_layer_wise`` group process 0 does all of that; the others wait until the folder
        is ready (every process must enter), and leave it alone afterwards. Losing another
        process (:class:`~msquant.contracts.distributed.PeerLostError`) counts as an interruption."""
        main = self.dist.is_main
        error: Exception | None = None
        if main:
            try:
                self._prepare()
            except Exception as caught:  # the others wait for the folder: tell them
                error = caught
        agree(self.dist, error)
        try:
            yield
        except PeerLostError:
            if main:
                self._keep_or_remove()  # another process was killed: as if this one were
            raise
        except (ResumeError, CommitRefusedError):
            raise  # the folder is kept, as the message says
        except Exception:
            if main:
                self._remove()  # a failed run leaves nothing behind, checkpointed or not
            raise
        except BaseException:
            if main:
                self._keep_or_remove()
            raise
        else:
            if main:
                self._remove()

    def _prepare(self) -> None:
        """Create the folder (marked as msquant's); empty it for a fresh run, or drop the scratch
        folders a killed run left (of every process) when resuming."""
        problem = owned_dir_problem(self.directory, "msquant's checkpoint folder of this save path")
        if problem is not None:
            raise OutputPathError(problem)
        if not os.path.lexists(self.directory):
            make_owned_dir(self.directory, "checkpoints of a run (msquant --resume)")
        elif not is_owned_dir(self.directory):  # empty: a kill came before it was marked
            mark_owned(self.directory, "checkpoints of a run (msquant --resume)")
        elif self.progress is None:
            self._empty()
        else:
            for stale in self.directory.glob(f"{SCRATCH_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _keep_or_remove(self) -> None:
        """After an interruption (Ctrl-C, ``SystemExit``, a lost process), keep what has been
        checkpointed, saying how to continue."""
        if not (self.directory / PROGRESS_FILE).is_file():
            self._remove()
            return
        logger.warning(
            "interrupted: the finished work (%s) is kept in %s; run the same command with "
            "--resume to continue, or with --overwrite to start over",
            describe_progress(self.directory),
            self.directory,
        )

    def _empty(self) -> None:
        """Remove everything but the owner file (the folder is msquant's: checked first)."""
        for child in self.directory.iterdir():
            if child.name == OWNER_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def _remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- after each layer ---------------------------------------------------------------------

    def keep_layer(self, layer: DecoderLayer) -> None:
        """Store the finished layer's quantized linears, and its float tensors when
        :attr:`keeps_floats` (before a streamed run releases it; process 0 alone: every process
        holds the same results)."""
        if self.dist.is_main:
            key = layer_key(layer.index)
            self.store.save(key, layer.module, layer.name, floats=self.keeps_floats)

    def commit_layer(
        self,
        ctx: RunContext,
        processors: Sequence[Processor],
        layer: DecoderLayer,
        activations: CalibrationActivations | None,
    ) -> None:
        """Write the checkpoint after ``layer``: every process's hidden states (the calibration
        batches' and the transform probe's, ``ctx.probe``), then (process 0, once all are on
        disk) the progress file; then each process drops its older ones."""
        done = layer.index + 1
        batches = [] if activations is None else activations.hidden
        probe = None if ctx.probe is None else ctx.probe.entering()
        hidden = None
        if activations is not None or probe is not None:
            hidden = self._save_hidden(done, batches, probe)
        states = [{"type": p.type_name, "state": p.resume_state(ctx)} for p in processors]
        ranks = self.dist.all_gather_object({"hidden": hidden, "processors": states})
        if self.dist.is_main:
            self._write_progress(ctx, stage=STAGE_LAYERS, layers_done=done, ranks=ranks)
        self.dist.barrier()  # committed: the files of the previous checkpoint are not needed
        self._remove_hidden(keep=None if hidden is None else hidden["file"])
        logger.debug("checkpoint: %d of %d layers", done, len(ctx.layers))

    def commit_finished(self, ctx: RunContext) -> None:
        """The last checkpoint, once every saver has finalised: a resumed run then only checks,
        evaluates and reports. The hidden files the writers kept for earlier checkpoints go.

        Every process calls it: the others write nothing in the folder after it (process 0 may
        remove the folder once it is done)."""
        if self.dist.is_main:
            layers = [layer.name for layer in ctx.layers]
            self.store.save(OUTSIDE_KEY, ctx.model, "", exclude=layers, floats=self.keeps_floats)
            self._write_progress(ctx, stage=STAGE_FINISHED, layers_done=len(ctx.layers), ranks=[])
        self.dist.barrier()
        self._remove_hidden(keep=None)
        if self.dist.is_main:
            removed = remove_temporaries(self.export_dir)
            logger.debug("checkpoint: finished (%d temporary file(s) removed)", removed)

    def _write_progress(
        self, ctx: RunContext, *, stage: str, layers_done: int, ranks: list[dict[str, Any]]
    ) -> None:
        """``progress.json``: ``ranks`` holds each process's hidden-state file and processor
        states, by rank; ``transforms`` what the processors recorded of their weight transforms
        (``ctx.transforms``), ``probe_tokens`` the report's."""
        progress = {
            "format": PROGRESS_FORMAT,
            "stage": stage,
            "fingerprint": self.fingerprint,
            "layers_done": layers_done,
            "report": ctx.report.layer_records(),
            "probe_tokens": ctx.report.probe_tokens,
            "transforms": ctx.transforms.state(),
            "ranks": ranks,
        }
        write_json_atomically(self.directory / PROGRESS_FILE, progress)

    def _save_hidden(
        self, done: int, hidden: Sequence[torch.Tensor], probe: torch.Tensor | None
    ) -> dict[str, Any]:
        name = hidden_name(done, self.dist.rank)
        tensors = {layer_key(i): h.detach().to("cpu").contiguous() for i, h in enumerate(hidden)}
        if probe is not None:
            tensors[PROBE_KEY] = probe.detach().to("cpu").contiguous()
        path = self.directory / name
        save_tensors_atomically(tensors, path)
        return {
            "file": name,
            "batches": len(hidden),
            "probe": probe is not None,
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        }

    def _remove_hidden(self, keep: str | None) -> None:
        """Remove this process's hidden-state files (and temporaries) but ``keep``."""
        for path in self.directory.glob(f"{HIDDEN_PREFIX}*-rank{self.dist.rank}.safetensors*"):
            if path.name != keep:
                path.unlink(missing_ok=True)

    # -- resuming ----------------------------------------------------------------------------

    def restore(
        self,
        ctx: RunContext,
        processors: Sequence[Processor],
        activations: CalibrationActivations | None,
    ) -> int:
        """Take up the checkpoint (after ``setup`` and the capture): rebuild the finished layers,
        restore the hidden states, the report and the processors (in a ``dp_layer_wise`` group,
        each process its own; every process must call this).

        :returns: the index of the first layer still to run.
        :raises ResumeError: when the checkpoint does not fit this run or its files are damaged
            (in every process, when any process finds that).
        """
        done = 0
        error: ResumeError | None = None
        try:
            done = take_up_layers(self, ctx, processors, activations)
        except ResumeError as caught:
            error = caught
        agree(self.dist, error)
        logger.info(
            "resuming after layer %d of %d (checkpoint in %s)",
            done,
            len(ctx.layers),
            self.directory,
        )
        return done

    def restore_finished(self, ctx: RunContext) -> None:
        """Take up a ``finished`` checkpoint: the quantized modules and the report (the export
        files are complete in :attr:`export_dir`). Process 0 alone has anything to take up; the
        others only learn whether it could."""
        assert self.progress is not None and self.finished
        error: ResumeError | None = None
        if self.dist.is_main:
            try:
                take_up_finished(self, ctx, self.progress)
            except ResumeError as caught:
                error = caught
        agree(self.dist, error)
        logger.info(
            "resuming after the export files were written (checkpoint in %s)", self.directory
        )
