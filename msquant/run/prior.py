"""``spec.prior``: stages that run over the whole model before ``spec.process``.

msModelSlim runs each prior stage as a run of its own: the stage's processors over every decoder
layer, on the stage's ``dataset`` (or ``spec.dataset`` when it names none), and only then the main
stage (``spec.process`` and ``spec.save``) on the model as the prior stages left it, on
``spec.dataset``. msquant does the same, layer by layer and streamed like the main stage:

* a prior stage has its own calibration flow: the inputs of the first decoder layer are captured
  from the stage's samples and pushed through every layer; the main stage captures its own later
  (so a prior stage costs one more capture and one more forward of every layer per calibration
  pass, on its own samples);
* what a prior stage changes in a layer is what the main stage sees: in a streamed run each layer
  the stage finished is written to the run's scratch folder (one copy of the decoder weights per
  stage, read back once by the main stage instead of the checkpoint); a ``model_wise`` run keeps
  the changed layers in memory;
* a prior stage's processors get every hook a run calls (``setup`` ... ``finalize``) and share
  ``ctx.extras`` with the main stage (msModelSlim passes prior results through its run context
  the same way); its layer times are logged, not added to the run report;
* a run with prior stages is not checkpointed (``--resume`` would have to replay the stages).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from msquant.load.streaming import StreamedWeights, TensorSource
from msquant.model.layers import DecoderLayer
from msquant.plugin.context import RunContext
from msquant.plugin.processor import Processor
from msquant.report.run_report import RunReport
from msquant.run.runner import run_layer_wise

__all__ = ["PriorStageRun", "PRIOR_CHECKPOINT_BLOCKER", "run_prior_stages"]

logger = logging.getLogger(__name__)

#: Why a run with ``spec.prior`` stages writes no checkpoints.
PRIOR_CHECKPOINT_BLOCKER = (
    "the config has spec.prior stages (a resumed run would have to replay them; not implemented)"
)


@dataclass(frozen=True)
class PriorStageRun:
    """One ``spec.prior`` stage, ready to run.

    :param index: its position in ``spec.prior``.
    :param processors: the processors of its ``process`` entries.
    :param samples: its tokenized calibration samples (None when no processor calibrates).
    :param dataset: where the samples came from, for the log.
    """

    index: int
    processors: list[Processor]
    samples: list[torch.Tensor] | None
    dataset: str


class KeptLayers(StreamedWeights):
    """The streamed weights of a run whose prior stage changed the layers: each layer released
    by the stage is written to ``folder`` and read back from there afterwards."""

    def __init__(self, base: StreamedWeights, folder: Path, layers: Sequence[DecoderLayer]) -> None:
        super().__init__(base.sources)  # the same mapping: the main stage reads the new sources
        self.base = base
        self.folder = folder
        self.names = {id(layer.module): layer.name for layer in layers}

    def materialize(self, module: nn.Module, prefix: str) -> None:
        self.base.materialize(module, prefix)

    def release(self, module: nn.Module) -> None:  # type: ignore[override]
        """Write the layer's tensors to the folder, point its sources there, then free it."""
        prefix = self.names[id(module)]
        tensors = {
            f"{prefix}.{name}": tensor.detach().to("cpu").contiguous()
            for name, tensor in _named_tensors(module)
        }
        path = self.folder / f"{prefix}.safetensors"
        save_file(tensors, str(path))
        for full in tensors:
            self.sources[full] = _reader(path, full)
        StreamedWeights.release(module)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers by relative name (tied tensors once)."""
    seen: set[int] = set()
    found = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name, tensor))
    return found


def _reader(path: Path, name: str) -> TensorSource:
    def read() -> torch.Tensor:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)

    return read


def run_prior_stages(
    ctx: RunContext, stages: Sequence[PriorStageRun], scratch: Path | None, progress: bool
) -> None:
    """Run every prior stage over the whole model, in order (see the module docstring).

    :param scratch: the streamed run's scratch folder (None for a ``model_wise`` run).
    """
    for stage in stages:
        started = time.perf_counter()
        logger.info(
            "spec.prior[%d]: %d processor(s) over every layer%s",
            stage.index,
            len(stage.processors),
            f", calibrated on {stage.dataset}" if stage.samples else "",
        )
        streamed = ctx.streamed
        if streamed is not None:
            assert scratch is not None
            folder = scratch / f"prior-{stage.index}"
            folder.mkdir(parents=True, exist_ok=True)
            streamed = KeptLayers(streamed, folder, ctx.layers)
        stage_ctx = dataclasses.replace(ctx, report=RunReport(), streamed=streamed, spill=None)
        run_layer_wise(stage_ctx, stage.processors, stage.samples, progress=progress)
        logger.info("spec.prior[%d] done in %.1f s", stage.index, time.perf_counter() - started)
