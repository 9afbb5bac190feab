"""The run report: machine-readable evidence of what a quantization run did and what it cost.

Every run writes ``quant_report.json`` at the top of the save path (see :func:`write_report`).
Processors record their modules through :meth:`RunReport.add_module`, the runner records the
decoder-layer times, and :func:`msquant.quantize` fills in the run-wide fields.

The records are pydantic dataclasses: validated when built, read back from a checkpoint by
pydantic (:meth:`RunReport.restore_layer_records`).

Deterministic by design: two identical runs give identical reports apart from the fields whose
names end in ``seconds`` (every timing lives in such a field), so scripts can diff reports across
runs after dropping those keys (:func:`msquant.strip_timings`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
from collections.abc import Mapping
from dataclasses import asdict, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import torch
from pydantic import TypeAdapter
from pydantic.dataclasses import dataclass

__all__ = [
    "REPORT_FILE",
    "REPORT_FORMAT",
    "ModuleReport",
    "LayerTiming",
    "TransformCheck",
    "KVCacheReport",
    "EvaluationReport",
    "RunReport",
    "write_report",
]


REPORT_FILE = "quant_report.json"
REPORT_FORMAT = 1  # bumped when a field changes meaning or disappears


@dataclass(frozen=True)
class ModuleReport:
    """One quantized linear module.

    :param name: full module name.
    :param method: ``gptq`` or ``minmax`` (round-to-nearest).
    :param bits: weight bit width.
    :param group_size: group width over input columns; None per-channel.
    :param symmetric: symmetric (no zero point) or asymmetric scheme.
    :param gptq_loss: GPTQ's own loss (see :class:`msquant.plugin.numerics.GPTQResult`); None for ``minmax``.
    :param percdamp: damping finally used, relative to ``mean(diag H)``; None for ``minmax``.
    :param damp_retries: times damping was raised after a failed Cholesky; None for ``minmax``.
    :param dead_columns: input columns never activated by the calibration set; None for ``minmax``.
    :param output_error: ``||X W^T - X W_hat^T|| / ||X W^T||`` on the calibration inputs
        (:func:`msquant.quant.output_error.relative_output_errors`); None without calibration.
    :param rtn_output_error: the same for the round-to-nearest weight of the same scheme, for
        comparison; None without calibration.
    :param solve_seconds: wall time of the GPTQ solve; None for ``minmax``.
    :param tokens: calibration tokens in the module's Hessian (all processes); None for
        ``minmax``. An MoE expert sees only the tokens routed to it.
    :param fallback: why the module was rounded to nearest although ``gptq`` was asked for (an
        MoE expert with too few calibration tokens); None otherwise.
    :param value_type: what the codes are (``int8``, ``mxfp8``).
    """

    name: str
    method: str
    bits: int
    group_size: int | None
    symmetric: bool
    gptq_loss: float | None = None
    percdamp: float | None = None
    damp_retries: int | None = None
    dead_columns: int | None = None
    output_error: float | None = None
    rtn_output_error: float | None = None
    solve_seconds: float | None = None
    tokens: int | None = None
    fallback: str | None = None
    #: The codes' value type (``int8``, ``mxfp4``; :mod:`msquant.quant.value_types`); None in
    #: reports written before it was recorded.
    value_type: str | None = None


@dataclass(frozen=True)
class LayerTiming:
    """Wall time of one decoder layer (load, every processor's hooks, offload).

    :param check_seconds: of ``seconds``, the time of the transform checks on the probe tokens
        (their forwards of the layer and the probe's push to the next layer); None when the run
        transforms no weight.
    """

    index: int
    name: str
    seconds: float
    check_seconds: float | None = None


@dataclass(frozen=True)
class TransformCheck:
    """What one processor's function-preserving transform (smoothing, rotation) proved on one
    decoder layer, on the run's probe tokens (:mod:`msquant.check`).

    :param layer: the decoder layer's index.
    :param processor: the processor's YAML type.
    :param flow_checks: data-flow comparisons made (a reader's input against its producer's
        scaled output, and the layer's output with every producer scaled).
    :param flow_error: the worst of them (relative; the proof's bound is 1e-4); None when none.
    :param function_checks: comparisons of the layer's output before and after a transform step.
    :param function_error: the worst of them, relative to what the layer adds to its input.
    :param function_tolerance: the bound they were held to (by the weights' dtype).
    """

    layer: int
    processor: str
    flow_checks: int
    flow_error: float | None
    function_checks: int
    function_error: float | None
    function_tolerance: float | None


@dataclass(frozen=True)
class KVCacheReport:
    """One attention whose KV cache the run quantizes (an int8 cache, e.g. ``C8``).

    :param name: the attention module's full name.
    :param scheme: the cache's type as the export describes it (``C8``).
    :param tensors: the export's tensors holding its parameters (scales and offsets of keys and
        values, e.g. ``<attention>.k_proj.kv_cache_scale``).
    :param channels: channels of the keys (and of the values) with a scale each
        (``kv_heads * head_dim``).
    :param tokens: calibration tokens whose keys and values set the range.
    :param key_absmax: the largest ``|key|`` observed (the widest channel's range).
    :param value_absmax: the largest ``|value|`` observed.
    """

    name: str
    scheme: str
    tensors: list[str]
    channels: int
    tokens: int
    key_absmax: float
    value_absmax: float


@dataclass(frozen=True)
class EvaluationReport:
    """Perplexity of the quantized model on a text file (``quant --eval_data``).

    :param data: the text file as given.
    :param data_sha256: sha256 of the file's bytes (what the regression gate matches on).
    :param seqlen: window length in tokens.
    :param stride: distance between window starts.
    :param max_samples: window limit asked for; None for the whole text.
    :param windows: windows evaluated.
    :param tokens: scored tokens.
    :param text_tokens: tokens in the whole text.
    :param nll: mean negative log-likelihood per scored token (natural log).
    :param ppl: ``exp(nll)``.
    :param seconds: time of the forward passes.
    """

    data: str
    data_sha256: str
    seqlen: int
    stride: int
    max_samples: int | None
    windows: int
    tokens: int
    text_tokens: int
    nll: float
    ppl: float
    seconds: float


@dataclass
class RunReport:
    """Everything ``quant_report.json`` holds; run-wide fields are set by :func:`msquant.quantize`.

    ``calibration_sha256`` hashes the token ids (:func:`calibration_sha256`), ``config_sha256`` the
    validated config (:func:`config_sha256`); ``capture_seconds`` is the time spent running the
    model's embeddings to capture the first decoder layer's inputs (None without calibration),
    ``total_seconds`` the whole run up to writing the report. ``evaluation`` is the quantized
    model's perplexity when the run was asked for one (``eval_data``), else None.
    ``transform_checks`` records what every function-preserving transform proved on each layer,
    on ``probe_tokens`` tokens (None when the run transforms no weight; the checks' time is in
    each layer's ``check_seconds``). ``kv_caches`` lists the attentions whose KV cache is
    quantized (empty when the run leaves the cache in float).

    Fields that grow as layers finish are lists (``modules``, ``layers``): a checkpoint records
    them (:meth:`layer_records`) and a resumed run takes them up (:meth:`restore_layer_records`);
    every other field is run-wide, set again by the resumed run.
    """

    msquant_version: str = ""
    torch_version: str = field(default_factory=lambda: torch.__version__)
    transformers_version: str = field(default_factory=lambda: _version_of("transformers"))
    python_version: str = field(default_factory=platform.python_version)
    config_sha256: str | None = None
    calibration_sha256: str | None = None
    calibration_samples: int = 0
    calibration_tokens: int = 0
    model_path: str = ""
    model_type: str = ""
    device: str = ""
    modules: list[ModuleReport] = field(default_factory=list)
    layers: list[LayerTiming] = field(default_factory=list)
    transform_checks: list[TransformCheck] = field(default_factory=list)
    kv_caches: list[KVCacheReport] = field(default_factory=list)
    probe_tokens: int | None = None
    evaluation: EvaluationReport | None = None
    capture_seconds: float | None = None
    total_seconds: float = 0.0

    def add_module(self, module: ModuleReport) -> None:
        """Record a quantized module (processors call this once per module they quantize)."""
        self.modules.append(module)

    def add_transform_check(self, check: TransformCheck) -> None:
        """Record what a transform proved on a decoder layer (the run's probe calls this)."""
        self.transform_checks.append(check)

    def add_kv_cache(self, cache: KVCacheReport) -> None:
        """Record an attention whose KV cache is quantized (a KV-cache processor calls this)."""
        self.kv_caches.append(cache)

    def add_layer(self, layer: LayerTiming) -> None:
        """Record a finished decoder layer (the runner calls this)."""
        self.layers.append(layer)

    def layer_records(self) -> dict[str, list[Any]]:
        """Every list field as JSON-able data, floats as they are (NaN included), for a
        checkpoint of a run."""
        return {
            f.name: [_record(item) for item in value]
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), list)
        }

    def restore_layer_records(self, records: Mapping[str, Any]) -> None:
        """Replace the list fields by those :meth:`layer_records` returned (unknown keys are an
        error: the records come from this msquant version)."""
        hints = get_type_hints(type(self))
        for name, value in records.items():
            if name not in hints or get_origin(hints[name]) is not list:
                raise ValueError(f"run report has no list field {name!r}")
            setattr(self, name, TypeAdapter(hints[name]).validate_python(value))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (non-finite floats become null: JSON has no NaN or Infinity)."""
        data = {"format": REPORT_FORMAT, **asdict(self)}
        return _finite(data)

    def to_json(self) -> str:
        """The document as written to disk: indented, keys in declaration order, final newline."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


def write_report(report: RunReport, directory: Path) -> Path:
    """Write ``quant_report.json`` into ``directory`` and return its path."""
    path = Path(directory) / REPORT_FILE
    path.write_text(report.to_json(), encoding="utf-8")
    return path


def _finite(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


def _record(item: Any) -> Any:
    """A report record as JSON-able data (dataclass instances as dicts)."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return asdict(item)
    return item


def _version_of(package: str) -> str:
    """Installed version of ``package`` (``"unknown"`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"
