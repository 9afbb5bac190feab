"""The Python API of a run: ``quantize()`` does what ``msquant quant`` does, raising typed
exceptions.

A run is a short sequence of named steps:

1. :func:`~msquant.run.inputs.check_inputs`: every check that needs no weight, cheapest first
   (config, device, save path, calibration file, model folder and config, the processors' checks
   and the plan on a weightless copy of the model, memory);
2. :func:`~msquant.run.steps.hold_save_path`: the save path locked until the export is in place,
   and the checkpoint folder opened (fresh, resumed, or none);
3. :func:`~msquant.run.steps.load_model`: the model, whole or streamed layer by layer;
4. :func:`~msquant.run.save_path.output_folder`: the staging folder the savers write into;
5. :func:`~msquant.run.steps.start_run` and :func:`~msquant.run.steps.run_layers`: the run
   context and the layer-wise runner (:mod:`msquant.run.runner`); ``spec.prior`` stages are
   checked but not run, as they change nothing in msModelSlim's export
   (:mod:`msquant.run.prior_inputs`);
6. :func:`~msquant.run.steps.finish_run`: the exports read back and checked, the evaluation,
   the report and the export marker. The staging folder is moved into place only on success.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from msquant.config.resolve import ConfigLike
from msquant.contracts.context import RunContext
from msquant.contracts.registry import ProcessorRegistry
from msquant.evaluate.windows import DEFAULT_SEQLEN
from msquant.quant.quantized_linear import QuantizedLinear
from msquant.report.run_report import RunReport
from msquant.run.inputs import QuantizeOptions, RunInputs, check_inputs
from msquant.run.save_path import output_folder
from msquant.run.steps import finish_run, hold_save_path, load_model, run_layers, start_run

__all__ = ["QuantizeResult", "quantize"]


@dataclass(frozen=True)
class QuantizeResult:
    """Summary of a finished run."""

    save_path: Path
    model_type: str
    quantized_modules: tuple[str, ...]
    calibration_samples: int
    seconds: float
    report: RunReport


def quantize(
    model_path: str | Path,
    save_path: str | Path,
    config: ConfigLike,
    *,
    device: str = "cpu",
    calib_path: str | Path | None = None,
    trust_remote_code: bool = False,
    registry: ProcessorRegistry | None = None,
    max_calib_tokens: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    verify: bool = True,
    eval_data: str | Path | None = None,
    eval_seqlen: int = DEFAULT_SEQLEN,
    eval_stride: int | None = None,
    eval_max_samples: int | None = None,
    max_memory: int | None = None,
    resume: bool = False,
    checkpoints: bool = True,
    allow_float_export: bool = False,
    model_type: str | None = None,
) -> QuantizeResult:
    """Quantize a local Hugging Face causal LM as ``config`` says and write the export to ``save_path``.

    :param model_path: local model directory (config.json + safetensors + tokenizer).
    :param save_path: output directory; created (a previous export there is replaced only with
        ``overwrite``).
    :param config: YAML file path, parsed mapping, or :class:`QuantConfig`.
    :param device: ``cpu``, ``cuda[:N]`` or ``npu[:N]``.
    :param calib_path: calibration file overriding ``spec.dataset``.
    :param trust_remote_code: allow model code shipped inside the model directory.
    :param registry: processors to use (default: every installed ``msquant.processors`` plugin).
    :param max_calib_tokens: truncate each calibration sample to this many tokens.
    :param progress: show progress bars.
    :param overwrite: replace a previous export at ``save_path`` (only after the new one is
        complete); without it such a path is refused before any work starts.
    :param verify: read every export of a built-in format back with the independent readers of
        :mod:`msquant.verify` and compare it with the in-memory result before it is moved into
        place (a mismatch raises :class:`msquant.ExportVerificationError` and writes nothing).
    :param eval_data: a local text file (as for ``msquant eval``): after the export is verified,
        measure the quantized in-memory model's perplexity on it and record it in the report's
        ``evaluation`` (read and checked before any work starts).
    :param eval_seqlen: window length of that evaluation.
    :param eval_stride: distance between its window starts (default ``eval_seqlen``).
    :param eval_max_samples: evaluate at most this many windows.
    :param max_memory: bytes of host memory the run may use: a run whose estimate
        (:mod:`msquant.run.memory_estimate`) is larger is refused before weights load.
    :param resume: continue the interrupted run of ``save_path`` after its last finished layer
        (same inputs required; :mod:`msquant.run.checkpoint`); the result is the uninterrupted
        run's.
    :param checkpoints: write a checkpoint after every decoder layer, so that a killed run can be
        resumed (runs whose processors are all resumable; ``dp_layer_wise`` groups too).
    :param allow_float_export: write the export even when the config quantizes no linear layer
        (the float model, transformed by the config's rotations or smoothings if any); without
        it such a config is refused before any weight is loaded.
    :param model_type: msModelSlim's ``--model_type``: the name of its model adapter
        (``default``, ``Qwen3-8B``, ...), whose answers the processors that depend on it follow
        (the smoothing processors smooth the subgraph types that adapter names; see
        docs/smoothing.md); None: msquant's own rules.
    :raises msquant.MsquantInputError: (a subclass) for any problem with the inputs.
    """
    started = time.perf_counter()
    options = QuantizeOptions(
        device=device, calib_path=calib_path, trust_remote_code=trust_remote_code,
        registry=registry, max_calib_tokens=max_calib_tokens, progress=progress,
        overwrite=overwrite, verify=verify, eval_data=eval_data, eval_seqlen=eval_seqlen,
        eval_stride=eval_stride, eval_max_samples=eval_max_samples, max_memory=max_memory,
        resume=resume, checkpoints=checkpoints, allow_float_export=allow_float_export,
        model_type=model_type,
    )  # fmt: skip
    inputs = check_inputs(model_path, save_path, config, options)
    with (
        hold_save_path(inputs) as run_checkpoints,
        nullcontext() if run_checkpoints is None else run_checkpoints.guard(),
        load_model(inputs, run_checkpoints) as loaded,
        output_folder(inputs.target, overwrite, inputs.dist, run_checkpoints) as staging,
    ):
        ctx = start_run(inputs, loaded, staging)
        run_layers(ctx, inputs, run_checkpoints)
        finish_run(ctx, inputs, run_checkpoints, started)
    return _result(ctx, inputs, started)


def _result(ctx: RunContext, inputs: RunInputs, started: float) -> QuantizeResult:
    """What :func:`quantize` returns about a finished run."""
    modules = ctx.model.named_modules()
    quantized = tuple(name for name, module in modules if isinstance(module, QuantizedLinear))
    samples = inputs.samples
    return QuantizeResult(
        save_path=inputs.target,
        model_type=ctx.model_type,
        quantized_modules=quantized,
        calibration_samples=len(samples) if samples else 0,
        seconds=time.perf_counter() - started,
        report=ctx.report,
    )
