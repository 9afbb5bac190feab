"""The Python API: ``quantize()`` does what ``msquant quant`` does, raising typed exceptions.

Checks run cheapest first and all of them before model weights are loaded: config, device, save
path, calibration file, model directory and config, then every processor's model-dependent checks
on a weightless copy of the model. Output is staged and moved into place only on success.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from msquant.backends import Backend, get_backend
from msquant.config.processors import build_processors
from msquant.config.resolve import ConfigLike, ResolvedConfig, resolve_config
from msquant.config.spec import QuantConfig, RunnerType
from msquant.distributed import Distributed, from_environment
from msquant.errors import ConfigError, ConfigIssue, OutputPathError, QuantizationError
from msquant.evaluate import DEFAULT_SEQLEN, load_model_for_eval, prepare_evaluation
from msquant.export.files import copied_model_files
from msquant.export.marker import write_export_marker
from msquant.export.recovery import (
    SCRATCH_INFIX,
    SavePathLock,
    recover_save_path,
    sibling,
)
from msquant.export.staging import StagedOutputDir, check_save_path
from msquant.load.calibration import (
    default_dataset_path,
    read_calibration_texts,
    resolve_dataset_path,
    tokenize_samples,
)
from msquant.load.model_folder import (
    build_meta_model,
    check_model_dir,
    load_model_config,
    load_tokenizer,
)
from msquant.memory_estimate import check_memory, checkpoint_size, estimate_memory
from msquant.model.layers import find_decoder_layers, layer_list_name
from msquant.model.placement import load_for_run, streams
from msquant.planning import check_plan
from msquant.plugin.context import RunContext
from msquant.plugin.processor import Processor
from msquant.plugin.registry import ProcessorRegistry, default_registry
from msquant.quant.quantized_linear import QuantizedLinear
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.quant.spill import MergedWeights
from msquant.report.hashes import calibration_sha256, config_sha256
from msquant.report.run_report import REPORT_FILE, RunReport, write_report
from msquant.report.table import render_report
from msquant.resume import (
    RunCheckpoints,
    agree,
    checkpoint_blocker,
    open_checkpoints,
    run_fingerprint,
)
from msquant.runner import needs_calibration, run_layer_wise
from msquant.version import __version__

__all__ = ["QuantizeResult", "quantize"]

logger = logging.getLogger(__name__)


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
        (:mod:`msquant.memory_estimate`) is larger is refused before weights load.
    :param resume: continue the interrupted run of ``save_path`` after its last finished layer
        (same inputs required; :mod:`msquant.resume`); the result is the uninterrupted run's.
    :param checkpoints: write a checkpoint after every decoder layer, so that a killed run can be
        resumed (runs whose processors are all resumable; ``dp_layer_wise`` groups too).
    :raises msquant.MsquantInputError: (a subclass) for any problem with the inputs.
    """
    started = time.perf_counter()
    registry = registry if registry is not None else default_registry()
    resolved = resolve_config(config, registry)
    processors = build_processors(resolved.config, registry)
    backend = get_backend(device)
    dist = from_environment(backend.spec.kind, backend.device)
    _log_runner(resolved.config.spec.runner, dist)
    if dist.is_main:
        _recover_early(Path(save_path).expanduser().absolute())
    target = check_save_path(save_path, overwrite, model_path)
    texts = _calibration_texts(resolved, calib_path, needs_calibration(processors))
    evaluation = (
        None
        if eval_data is None
        else prepare_evaluation(eval_data, eval_seqlen, eval_stride, eval_max_samples)
    )

    model_dir = check_model_dir(model_path)
    copied_model_files(model_dir)  # a link out of the model folder is refused before any work
    model_config = load_model_config(model_dir, trust_remote_code)
    if evaluation is not None:
        evaluation.check_model(model_config, model_dir)
    meta_model = build_meta_model(model_config, trust_remote_code)
    _check_model(processors, meta_model)
    if evaluation is not None and streams(resolved.config.spec.runner):
        _check_evaluable_export(processors)

    samples = eval_ids = None
    if texts is not None or evaluation is not None:
        tokenizer = load_tokenizer(model_dir, trust_remote_code)
    if texts is not None:
        samples = tokenize_samples(texts, tokenizer, max_calib_tokens)
        logger.info("calibration: %d sample(s)", len(samples))
        _warn_long_samples(samples, model_config)
    if evaluation is not None:
        eval_ids = evaluation.tokens(tokenizer)
    streaming = streams(resolved.config.spec.runner)
    if max_memory is not None:
        _check_memory(meta_model, model_dir, streaming, samples, processors, dist, max_memory)
    fingerprint = _fingerprint(resolved.config, samples, model_dir, backend, meta_model)
    with (
        _locked_save_path(  # held until the export is in place
            target,
            overwrite,
            model_path,
            dist,
            lambda: open_checkpoints(
                target,
                fingerprint,
                resume=resume,
                overwrite=overwrite,
                blocker=checkpoint_blocker(processors, checkpoints),
                dist=dist,
            ),
        ) as run_checkpoints,
        nullcontext() if run_checkpoints is None else run_checkpoints.guard(),
        load_for_run(
            model_dir,
            meta_model,
            streaming=streaming,
            scratch_parent=(
                target.parent
                if run_checkpoints is None
                else run_checkpoints.directory  # a killed run's scratch goes with its work
            ),
            scratch_prefix=(
                sibling(target, SCRATCH_INFIX).name if run_checkpoints is None else None
            ),
            # a checkpointed run's layer store is the reference of the released layers
            keep_reference=verify and dist.is_main and run_checkpoints is None,
            trust_remote_code=trust_remote_code,
        ) as loaded,
    ):
        del meta_model
        model, layers = loaded.model, loaded.layers
        logger.info(
            "%s: %d decoder layers found under %s (%s)",
            type(model).__name__,
            len(layers),
            layer_list_name(layers),
            "streamed from disk one at a time" if streaming else "all loaded in memory",
        )
        with _output_folder(target, overwrite, dist, run_checkpoints) as staging:
            config_text = resolved.text or yaml.safe_dump(
                resolved.config.model_dump(mode="json"), sort_keys=False
            )
            ctx = RunContext(
                model, model_dir, staging, backend, layers, config_text, progress and dist.is_main,
                streamed=loaded.streamed, spill=loaded.spill, dist=dist, experts=loaded.experts,
                checkpoint_names=loaded.checkpoint_names,
            )  # fmt: skip
            _start_report(ctx, resolved.config, samples, backend)
            workers = processors if dist.is_main else [p for p in processors if p.stage != "save"]
            run_layer_wise(
                ctx,
                workers,
                samples,
                progress=progress and dist.is_main,
                checkpoints=run_checkpoints,
            )
            # process 0 alone verifies, evaluates and writes the report
            if dist.is_main and verify:
                stored = None if run_checkpoints is None else run_checkpoints.store
                _verify_exports(ctx, processors, stored)
            if dist.is_main and evaluation is not None and eval_ids is not None:
                ctx.report.evaluation = evaluation.evaluate(
                    _model_to_evaluate(ctx, processors, trust_remote_code), eval_ids, backend
                )
            if dist.is_main:
                _write_report(ctx, started)
                _write_export_marker(ctx, processors)  # last: it lists every file
    quantized = tuple(n for n, m in model.named_modules() if isinstance(m, QuantizedLinear))
    return QuantizeResult(
        save_path=target,
        model_type=ctx.model_type,
        quantized_modules=quantized,
        calibration_samples=len(samples) if samples else 0,
        seconds=time.perf_counter() - started,
        report=ctx.report,
    )


# Savers whose output the readers in msquant.verify understand.
VERIFIABLE_SAVERS = frozenset(
    {"ascendv1_saver", "mindie_format_saver", "gptq_saver", "compressed_tensors"}
)


def _verify_exports(
    ctx: RunContext,
    processors: list[Processor],
    stored: Mapping[str, QuantizedWeight] | None = None,
) -> None:
    """Read each export back and compare it with the quantized modules still in memory (and
    those of ``stored``: a checkpointed run's layer store).

    The report's consumer notes (what a named serving engine refuses or treats differently in the
    export as written) are logged as warnings: they describe the files, which is what a user
    deploys, and the reader found them independently of the saver's own warnings.
    """
    from msquant.verify import ExportVerificationError, verify_export

    reference = _reference(ctx, stored)
    for saver in processors:
        if saver.stage != "save":
            continue
        if saver.type_name not in VERIFIABLE_SAVERS:
            logger.info("verify: skipping %s (no reader for its format)", saver.type_name)
            continue
        started = time.perf_counter()
        report = verify_export(saver.output_dir(ctx), reference=reference)
        for warning in report.warnings:
            logger.warning("verify: %s export: %s", saver.type_name, warning)
        if not report.ok:
            raise ExportVerificationError(report)
        logger.info(
            "verify: %s export read back, %d quantized layer(s) identical to the in-memory result "
            "(%.1f s)",
            saver.type_name,
            len(report.layers),
            time.perf_counter() - started,
        )


def _check_memory(
    meta_model: torch.nn.Module,
    model_dir: Path,
    streaming: bool,
    samples: Sequence[torch.Tensor] | None,
    processors: list[Processor],
    dist: Distributed,
    limit: int,
) -> None:
    """Refuse, before weights load, a run whose estimated peak memory exceeds ``limit``."""
    tokens = sum(int(s.numel()) for s in samples) if samples else 0
    layers = find_decoder_layers(meta_model)
    estimate = estimate_memory(
        meta_model,
        layers,
        checkpoint_size(model_dir),
        streaming=streaming,
        calibration_tokens=-(-tokens // dist.world_size),
        gptq=needs_calibration(processors),
        gptq_passes=max(
            (p.calibration_passes(layer) for p in processors for layer in layers), default=1
        ),
    )
    logger.info("estimated peak memory: %.2f GiB (%s)", estimate.total / 2**30, estimate.describe())
    check_memory(estimate, limit, streaming)


def _reference(
    ctx: RunContext, stored: Mapping[str, QuantizedWeight] | None = None
) -> Mapping[str, QuantizedWeight]:
    """The run's quantized weights: those still in memory and, in a streamed run, those the
    runner kept on disk when it released their layers (its spill, or the checkpoints' store).
    Keyed by the checkpoint's module names, as the exports are."""
    in_memory = {
        name: module.qweight
        for name, module in ctx.model.named_modules()
        if isinstance(module, QuantizedLinear) and not module.weight.is_meta
    }
    on_disk = [part for part in (ctx.spill, stored) if part is not None]
    return ctx.disk_keyed(MergedWeights(in_memory, *on_disk) if on_disk else in_memory)


def _check_evaluable_export(processors: list[Processor]) -> None:
    """A streamed run evaluates its export read back from disk: one must be readable."""
    if not any(p.stage == "save" and p.type_name in VERIFIABLE_SAVERS for p in processors):
        raise ConfigError(
            [
                ConfigIssue(
                    "spec.save",
                    "--eval_data in a streamed run (spec.runner auto or layer_wise) evaluates the "
                    "export read back from disk, and none of the configured savers writes a format "
                    f"msquant reads ({', '.join(sorted(VERIFIABLE_SAVERS))}); add one, or set "
                    "spec.runner: model_wise to evaluate the quantized model in memory",
                )
            ]
        )


def _model_to_evaluate(
    ctx: RunContext, processors: list[Processor], trust_remote_code: bool
) -> torch.nn.Module:
    """The quantized model in memory, or in a streamed run the first readable export, rebuilt
    from the staging folder (identical to the in-memory result: it was just verified)."""
    if ctx.streamed is None:
        return ctx.model
    saver = next(p for p in processors if p.stage == "save" and p.type_name in VERIFIABLE_SAVERS)
    model, _ = load_model_for_eval(saver.output_dir(ctx), trust_remote_code)
    return model


def _write_export_marker(ctx: RunContext, processors: list[Processor]) -> None:
    """``msquant_export.json`` at the top of the save path: what wrote this folder and how, and
    every file of it with its sha256 (:mod:`msquant.export.marker`).

    It marks the folder as an msquant export (so ``--overwrite`` may replace it, whatever its
    format, as long as it holds nothing else) and records where each saver's files are.
    Deterministic: no timestamps.
    """
    savers = [
        {"type": p.type_name, "path": p.output_subdir or "."}
        for p in processors
        if p.stage == "save"
    ]
    marker = {
        "msquant_version": __version__,
        "model_path": str(ctx.model_path),
        "model_type": ctx.model_type,
        "savers": savers,
    }
    write_export_marker(ctx.output_dir, marker)


def _start_report(
    ctx: RunContext,
    config: QuantConfig,
    samples: Sequence[torch.Tensor] | None,
    backend: Backend,
) -> None:
    """Fill the run-wide fields of ``ctx.report`` (versions, hashes, model, device)."""
    report = ctx.report
    report.msquant_version = __version__
    report.config_sha256 = config_sha256(config.model_dump(mode="json"))
    report.calibration_sha256 = calibration_sha256(samples)
    report.calibration_samples = len(samples) if samples else 0
    report.calibration_tokens = sum(int(s.numel()) for s in samples) if samples else 0
    report.model_path = str(ctx.model_path)
    report.model_type = ctx.model_type
    report.device = str(backend.device)


def _write_report(ctx: RunContext, started: float) -> None:
    """``quant_report.json`` beside ``msquant_export.json`` (staged, moved with the export) and
    the same as a table at INFO. Written before the marker, which lists it."""
    ctx.report.total_seconds = time.perf_counter() - started
    write_report(ctx.report, ctx.output_dir)
    logger.info("run report (%s):\n%s", REPORT_FILE, render_report(ctx.report))


def _log_runner(runner: RunnerType, dist: Distributed) -> None:
    """Say how ``runner`` is executed (results never depend on it, up to float summation order
    across processes)."""
    if dist.active:
        logger.info(
            "dp_layer_wise: process %d of %d shares the calibration batches and the GPTQ solves",
            dist.rank,
            dist.world_size,
        )
    elif runner is RunnerType.DP_LAYER_WISE:
        logger.warning(
            "runner dp_layer_wise with one process: launch with torchrun --nproc_per_node N, or "
            "give several devices (--device npu:0,1,2,3) to share the work out"
        )
    if runner is RunnerType.MODEL_WISE:
        logger.info("runner model_wise: every weight is loaded before the layer-wise run")
    else:
        logger.info("runner %s: decoder layers are streamed from disk one at a time", runner.value)


def _recover_early(target: Path) -> None:
    """Finish or undo what a killed run left beside the save path before it is checked, so that
    the check sees the save path as the killed run should have left it (a previous export put
    back, a finished export's stale checkpoint folder gone). Skipped while another run holds
    the save path (the check refuses this run then anyway)."""
    if not target.parent.is_dir():
        return
    try:
        with SavePathLock(target):
            recover_save_path(target)
    except OutputPathError:
        return


@contextmanager
def _locked_save_path(
    target: Path,
    overwrite: bool,
    model_path: str | Path,
    dist: Distributed,
    open_run_checkpoints: Callable[[], RunCheckpoints | None],
) -> Iterator[RunCheckpoints | None]:
    """Hold the save path's lock for the rest of the run (process 0 of a ``dp_layer_wise``
    group; every process learns whether it got it): recover what a killed run left beside the
    save path, check the save path again (recovery may have put a previous export back), then
    decide how the run uses its checkpoint folder (``open_run_checkpoints``), which it yields."""
    lock = SavePathLock(target) if dist.is_main else None
    error: Exception | None = None
    if lock is not None:
        try:
            lock.__enter__()
        except Exception as caught:
            error, lock = caught, None
    try:
        if lock is not None:
            try:
                recover_save_path(target)
                check_save_path(target, overwrite, model_path)
            except Exception as caught:
                error = caught
        agree(dist, error)
        yield open_run_checkpoints()
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


@contextmanager
def _output_folder(
    target: Path,
    overwrite: bool,
    dist: Distributed,
    checkpoints: RunCheckpoints | None = None,
) -> Iterator[Path]:
    """Process 0 writes into the staging folder of the save path; the other processes of a
    ``dp_layer_wise`` group run no saver and get an empty scratch folder. A checkpointed run
    stages in its checkpoint folder, kept when the run is killed (:mod:`msquant.resume`)."""
    if checkpoints is not None and dist.is_main:
        with StagedOutputDir(
            target,
            overwrite,
            staging=checkpoints.export_dir,
            checkpoint_dir=checkpoints.directory,
        ) as staging:
            yield staging
    elif dist.is_main:
        with StagedOutputDir(target, overwrite) as staging:
            yield staging
    else:
        with tempfile.TemporaryDirectory(prefix=".msquant-worker-") as scratch:
            yield Path(scratch)


def _fingerprint(
    config: QuantConfig,
    samples: Sequence[torch.Tensor] | None,
    model_dir: Path,
    backend: Backend,
    meta_model: torch.nn.Module,
) -> dict[str, Any]:
    """What a resumed run must share with the run it continues (:func:`run_fingerprint`)."""
    return run_fingerprint(
        config_sha256=config_sha256(config.model_dump(mode="json")),
        calibration_sha256=calibration_sha256(samples),
        model_dir=model_dir,
        device_kind=backend.spec.kind,
        num_layers=len(find_decoder_layers(meta_model)),
    )


def _calibration_texts(
    resolved: ResolvedConfig, calib_path: str | Path | None, required: bool
) -> list[str] | None:
    """Read the calibration file when one is given (always validated) or required."""
    if calib_path is not None:
        path = Path(calib_path)
    elif resolved.config.spec.dataset is not None:
        path = resolve_dataset_path(resolved.config.spec.dataset, resolved.directory)
    elif required:
        path = default_dataset_path()
        logger.info("no spec.dataset or --calib_path: calibrating on the shipped default set")
    else:
        return None
    texts = read_calibration_texts(path)
    return texts if required else None


def _warn_long_samples(samples: Sequence[torch.Tensor], model_config: Any) -> None:
    """Warn about calibration samples longer than the context the model was trained for: its
    activations there are not the ones it serves, and attention memory grows with the square of
    the length."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    lengths = [int(s.shape[-1]) for s in samples]
    longer = [n for n in lengths if n > limit]
    if longer:
        logger.warning(
            "%d of %d calibration sample(s) are longer than the model's max_position_embeddings "
            "(%d; the longest has %d tokens): pass --max_calib_tokens %d (Python: "
            "max_calib_tokens=%d) to truncate them",
            len(longer), len(lengths), limit, max(longer), limit, limit,
        )  # fmt: skip


def _check_model(processors: list[Processor], meta_model: Any) -> None:
    layers = find_decoder_layers(meta_model)
    problems = [msg for p in processors for msg in p.check_model(meta_model, layers)]
    problems += check_plan(processors, meta_model, layers)  # across entries: overlaps, fused splits
    if problems:
        count = len(problems)
        raise QuantizationError(
            f"the config cannot be applied to this model ({count} problem{'s' if count > 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
