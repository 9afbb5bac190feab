"""Perplexity of a float model or of an msquant export on a local text file (``msquant eval``).

What is measured: the text file's samples (read like calibration files: ``.txt``, ``.jsonl``,
``.json``) are joined with blank lines and tokenized once; the token stream is cut into windows of
``seqlen`` tokens starting every ``stride`` tokens (default: ``stride = seqlen``, non-overlapping).
Each token is scored once, by the window where it first appears after the window's first token
(the Hugging Face sliding-window recipe): a window overlapping the previous one scores only its
new tokens, using the overlap as context. The perplexity is ``exp(total NLL / scored tokens)``,
the NLL summed in float64 over natural-log token probabilities.

Exports are read back through the dequantizing readers of :mod:`msquant.verify` (written from the
format specifications, independently of the savers): the float model is built from the export's
``config.json``, its float tensors are loaded as stored, and each quantized linear gets its
dequantized weight ``(codes - offset) * scale`` cast to the model dtype. What is evaluated is thus
exactly what a consumer that dequantizes the checkpoint computes, not msquant's in-memory result.

``msquant quant --eval_data`` measures the same perplexity on the run's in-memory quantized model
(:func:`prepare_evaluation`, :meth:`EvaluationData.evaluate`), which the run has just verified to
be identical to its export; both paths share :func:`measure_perplexity`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.backends import Backend, get_backend
from msquant.errors import CalibrationDataError, ModelLoadError, MsquantInputError
from msquant.load.calibration import read_calibration_texts
from msquant.load.model_folder import (
    check_model_dir,
    load_causal_lm,
    load_model_config,
    load_tokenizer,
)
from msquant.model.moe import checkpoint_names, unfuse_experts
from msquant.report.run_report import EvaluationReport
from msquant.verify.ascend import description_files
from msquant.verify.base import ExportReader
from msquant.verify.detect import detect_format, export_folders, open_reader
from msquant.verify.errors import ExportReadError
from msquant.verify.report import Findings

__all__ = [
    "EvaluationData",
    "EvaluationError",
    "PerplexityMeasurement",
    "PerplexityResult",
    "PerplexityComparison",
    "Window",
    "evaluate_perplexity",
    "compare_perplexity",
    "file_sha256",
    "load_model_for_eval",
    "measure_perplexity",
    "model_kind",
    "prepare_evaluation",
    "read_eval_tokens",
    "sliding_windows",
    "sliding_window_perplexity",
    "max_positions",
]

logger = logging.getLogger(__name__)

FLOAT_KIND = "float"
DEFAULT_SEQLEN = 512
SAMPLE_SEPARATOR = "\n\n"
MAX_LISTED_ERRORS = 5
PROGRESS_STEPS = 10  # log lines per evaluation


class EvaluationError(MsquantInputError):
    """The evaluation cannot run as asked: data file, window settings or model do not fit."""


@dataclass(frozen=True)
class Window:
    """One evaluation window: tokens ``[begin, end)`` run through the model, tokens
    ``[score_from, end)`` scored (each predicted from the tokens before it in the window)."""

    begin: int
    end: int
    score_from: int

    @property
    def scored(self) -> int:
        """How many tokens this window scores."""
        return self.end - self.score_from


@dataclass(frozen=True)
class PerplexityResult:
    """The perplexity of one model on one text file.

    :param model: the evaluated folder.
    :param kind: ``float`` or the export format (``ascend``, ``mindie``, ``gptq``,
        ``compressed-tensors``).
    :param data: the text file.
    :param ppl: ``exp(nll)``.
    :param nll: mean negative log-likelihood per scored token (natural log).
    :param tokens: scored tokens.
    :param windows: windows evaluated.
    :param text_tokens: tokens in the whole text (more than covered when ``max_samples`` cut it).
    :param seqlen: window length.
    :param stride: distance between window starts.
    :param dtype: the model dtype the forward passes ran in.
    :param seconds: time of the forward passes.
    :param load_seconds: time to load (and for exports dequantize) the model.
    """

    model: str
    kind: str
    data: str
    ppl: float
    nll: float
    tokens: int
    windows: int
    text_tokens: int
    seqlen: int
    stride: int
    dtype: str
    seconds: float
    load_seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable view."""
        return asdict(self)

    def summary(self) -> str:
        """One readable line."""
        return (
            f"perplexity {self.ppl:.4f} (nll {self.nll:.5f}, {self.tokens} tokens in "
            f"{self.windows} window(s) of {self.seqlen}, stride {self.stride}, {self.dtype}) "
            f"of {self.model} [{self.kind}] on {self.data} in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class PerplexityComparison:
    """Perplexities of an original model and its quantized export on the same tokens."""

    original: PerplexityResult
    quantized: PerplexityResult

    @property
    def relative_increase(self) -> float:
        """``quantized.ppl / original.ppl - 1`` (0.01 means +1 %)."""
        return self.quantized.ppl / self.original.ppl - 1.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable view."""
        return {
            "original": self.original.to_dict(),
            "quantized": self.quantized.to_dict(),
            "relative_increase": self.relative_increase,
            "relative_increase_percent": 100.0 * self.relative_increase,
        }

    def summary(self) -> str:
        """Readable lines: both perplexities and the relative increase."""
        width = max(len(self.original.model), len(self.quantized.model))
        lines = [
            f"original   {self.original.model:<{width}}  [{self.original.kind}]  "
            f"ppl {self.original.ppl:.4f}",
            f"quantized  {self.quantized.model:<{width}}  [{self.quantized.kind}]  "
            f"ppl {self.quantized.ppl:.4f}",
            f"relative increase {100.0 * self.relative_increase:+.3f} % "
            f"({self.original.tokens} tokens in {self.original.windows} window(s) of "
            f"{self.original.seqlen}, stride {self.original.stride}, on {self.original.data})",
        ]
        return "\n".join(lines)


# --- windows ---------------------------------------------------------------------------------


def sliding_windows(
    total: int, seqlen: int, stride: int | None = None, max_samples: int | None = None
) -> list[Window]:
    """The windows over ``total`` tokens; each token is scored at most once.

    Window ``k`` runs tokens ``[k*stride, min(k*stride + seqlen, total))`` and scores those not
    scored before, never its own first token (it has no context in the window): with overlapping
    windows every token but the very first is scored, with non-overlapping ones every token but
    each window's first. The last window ends at ``total``; windows scoring nothing are skipped.

    :param stride: default ``seqlen`` (non-overlapping); must be in ``[1, seqlen]``.
    :param max_samples: keep at most this many windows (the first ones).
    :raises EvaluationError: for settings out of range.
    """
    stride = seqlen if stride is None else stride
    if seqlen < 2:
        raise EvaluationError(f"seqlen must be at least 2 tokens, got {seqlen}")
    if not 1 <= stride <= seqlen:
        raise EvaluationError(
            f"stride must be between 1 and seqlen ({seqlen}), got {stride}: a stride longer than "
            "the window would leave tokens unscored"
        )
    if max_samples is not None and max_samples < 1:
        raise EvaluationError(f"max_samples must be a positive integer, got {max_samples}")
    windows: list[Window] = []
    scored_until, begin = 0, 0
    while max_samples is None or len(windows) < max_samples:
        end = min(begin + seqlen, total)
        window = Window(begin, end, max(scored_until, begin + 1))
        if window.scored > 0:
            windows.append(window)
        scored_until = end
        if end >= total:
            break
        begin += stride
    return windows


@torch.inference_mode()
def sliding_window_perplexity(
    model: nn.Module,
    input_ids: torch.Tensor,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
) -> tuple[float, int, int]:
    """Total NLL (float64 sum, natural log), scored tokens and windows of ``model`` on a token
    stream, one window per forward pass, on the model's device.

    :param input_ids: 1-D int64 token ids.
    :raises EvaluationError: when the windows score no token (fewer than 2 tokens).
    """
    ids = input_ids.reshape(-1).to(torch.long)
    windows = sliding_windows(int(ids.numel()), seqlen, stride, max_samples)
    if not windows:
        raise EvaluationError(
            f"the text has {ids.numel()} token(s): at least 2 are needed to score one"
        )
    device = next(model.parameters()).device
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64)
    every = max(1, len(windows) // PROGRESS_STEPS)
    started = time.perf_counter()
    for index, window in enumerate(windows):
        chunk = ids[window.begin : window.end].unsqueeze(0).to(device)
        logits = model(input_ids=chunk, use_cache=False).logits[0]
        # Position p predicts token p + 1: the scored tokens are predicted by the rows before them.
        first = window.score_from - window.begin - 1
        rows = logits[first : window.end - window.begin - 1].float()
        targets = ids[window.score_from : window.end].to(rows.device)
        log_probs = torch.log_softmax(rows, dim=-1).gather(1, targets.unsqueeze(1))
        total_nll -= log_probs.double().sum().cpu()
        if (index + 1) % every == 0 or index + 1 == len(windows):
            logger.info(
                "window %d/%d (tokens %d..%d), %.1f s",
                index + 1,
                len(windows),
                window.begin,
                window.end,
                time.perf_counter() - started,
            )
    scored = sum(window.scored for window in windows)
    return float(total_nll), scored, len(windows)


@dataclass(frozen=True)
class PerplexityMeasurement:
    """What :func:`measure_perplexity` found on a token stream.

    :param nll: mean negative log-likelihood per scored token (natural log).
    :param tokens: scored tokens.
    :param windows: windows evaluated.
    :param text_tokens: tokens in the whole stream.
    :param seconds: time of the forward passes.
    """

    nll: float
    tokens: int
    windows: int
    text_tokens: int
    seconds: float

    @property
    def ppl(self) -> float:
        """``exp(nll)``."""
        return math.exp(self.nll)


def measure_perplexity(
    model: nn.Module,
    input_ids: torch.Tensor,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
) -> PerplexityMeasurement:
    """The perplexity of an already loaded ``model`` (on its device) on a token stream: the core
    shared by ``msquant eval`` and the evaluation at the end of a quantization run.

    :raises EvaluationError: for window settings out of range or fewer than 2 tokens.
    """
    started = time.perf_counter()
    nll, tokens, windows = sliding_window_perplexity(model, input_ids, seqlen, stride, max_samples)
    return PerplexityMeasurement(
        nll=nll / tokens,
        tokens=tokens,
        windows=windows,
        text_tokens=int(input_ids.numel()),
        seconds=time.perf_counter() - started,
    )


# --- data ------------------------------------------------------------------------------------


def read_eval_tokens(data_path: str | Path, tokenizer: Any) -> torch.Tensor:
    """The token ids (1-D int64) of a text file's samples joined with blank lines.

    The file is read like a calibration file (:func:`msquant.load.calibration.read_calibration_texts`).

    :raises EvaluationError: when the file is missing, unreadable, malformed or yields no token.
    """
    path = Path(data_path)
    return _tokenize_texts(_read_eval_texts(path), tokenizer, path)


def _read_eval_texts(path: Path) -> list[str]:
    try:
        return read_calibration_texts(path, role="evaluation data")
    except CalibrationDataError as exc:
        raise EvaluationError(str(exc)) from exc


def _tokenize_texts(texts: Sequence[str], tokenizer: Any, path: Path) -> torch.Tensor:
    """The samples joined with blank lines, tokenized once; at least 2 tokens."""
    text = SAMPLE_SEPARATOR.join(texts)
    ids = tokenizer(text, return_tensors="pt", verbose=False)["input_ids"].reshape(-1)
    if ids.numel() < 2:
        raise EvaluationError(
            f"evaluation data file {path} yields {ids.numel()} token(s); at least 2 are needed"
        )
    return ids.to(torch.long)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (``sha256sum`` prints the same).

    :raises EvaluationError: when the file cannot be read.
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise EvaluationError(f"cannot read evaluation data file {path}: {exc.strerror}") from None
    return digest.hexdigest()


# --- models ----------------------------------------------------------------------------------


def model_kind(model_dir: str | Path) -> str:
    """``float`` for a plain Hugging Face model folder, else the export format.

    :raises ModelLoadError: when the folder is missing or holds neither a model nor an export.
    :raises ExportReadError: when it holds an export in a format msquant cannot read, or a
        several-saver save path (the message lists the subfolders to choose from).
    """
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a folder; pass a model folder or an export folder")
    if description_files(path) or _has_quantization_config(path):
        return detect_format(path)
    if (path / "config.json").is_file():
        return FLOAT_KIND
    try:
        folders = export_folders(path)
    except ExportReadError:
        raise ModelLoadError(
            f"{path} holds neither a Hugging Face model (config.json) nor an msquant export"
        ) from None
    names = ", ".join(str(folder) for folder in folders)
    raise ExportReadError(
        f"{path} holds the exports of several savers; evaluate one of them: {names}"
    )


def _has_quantization_config(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("quantization_config"), dict)


def max_positions(config: Any) -> int | None:
    """The model's longest sequence (``max_position_embeddings``, also under ``text_config``)."""
    for holder in (config, getattr(config, "text_config", None)):
        value = getattr(holder, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model_for_eval(
    model_dir: str | Path, trust_remote_code: bool = False
) -> tuple[nn.Module, str]:
    """The model of a folder on CPU in eval mode, and its kind (``float`` or the export format).

    A float folder is loaded with ``from_pretrained`` (safetensors only); an export is rebuilt
    from its ``config.json`` with its float tensors and dequantized linear weights.

    :raises ModelLoadError: for a missing or unloadable folder.
    :raises ExportReadError: for an export that cannot be read back consistently.
    """
    kind = model_kind(model_dir)
    path = Path(model_dir)
    if kind == FLOAT_KIND:
        return load_causal_lm(check_model_dir(path), trust_remote_code), kind
    return _load_export(path, trust_remote_code), kind


def _load_export(path: Path, trust_remote_code: bool) -> nn.Module:
    findings = Findings()
    reader = open_reader(path, findings)
    try:
        _raise_on_errors(path, reader, findings)
        model = _empty_model(path, trust_remote_code)
        unfuse_experts(model)  # MoE exports hold one quantized Linear per expert projection
        names = checkpoint_names(model)  # the export uses the checkpoint's names (Mixtral)
        tensor_of = {disk: mine for mine, disk in names.tensors.items()}
        module_of = {disk: mine for mine, disk in names.modules.items()}
        assert reader.store is not None
        dtype = next(model.parameters()).dtype
        covered = _load_float_tensors(model, reader, path, tensor_of)
        for stored_name in reader.quantized_modules():
            layer = reader.decode(stored_name)
            _raise_on_errors(path, reader, findings)
            assert layer is not None
            module_name = module_of.get(stored_name, stored_name)
            weight = _linear_weight(model, module_name, path)
            if tuple(weight.shape) != layer.shape:
                raise ExportReadError(
                    f"{path}: {module_name} decodes to shape {list(layer.shape)} but the model "
                    f"built from config.json has {list(weight.shape)}"
                )
            with torch.no_grad():
                weight.copy_(layer.dequantize().to(dtype))
            covered.add(f"{module_name}.weight")
    finally:
        if reader.store is not None:
            reader.store.close()
    _check_covered(model, covered, path)
    model.eval()
    return model


def _raise_on_errors(path: Path, reader: ExportReader, findings: Findings) -> None:
    if reader.store is None and not findings.errors:
        findings.error("no weights found")
    if not findings.errors:
        return
    listed = "; ".join(findings.errors[:MAX_LISTED_ERRORS])
    more = len(findings.errors) - MAX_LISTED_ERRORS
    extra = f" (and {more} more)" if more > 0 else ""
    raise ExportReadError(
        f"{reader.format_name} export {path} cannot be read back: {listed}{extra}; "
        f"run `msquant verify {path}` for the full report"
    )


def _empty_model(path: Path, trust_remote_code: bool) -> nn.Module:
    """The model class of the export's config with freshly initialized weights (overwritten next)."""
    from transformers import AutoModelForCausalLM

    config = load_model_config(path, trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are dequantized here: build the float model
    dtype = getattr(config, "dtype", None) or torch.float32
    try:
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except (ValueError, KeyError, ImportError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot build the model of {path} from its config.json: {exc} "
            "(pass --trust_remote_code for models with custom code)"
        ) from exc
    return model


def _load_float_tensors(
    model: nn.Module, reader: ExportReader, path: Path, tensor_of: Mapping[str, str]
) -> set[str]:
    """Copy the stored float tensors into the model; the names of the parameters set.

    :param tensor_of: stored name -> the model's name, where they differ.
    """
    assert reader.store is not None
    state = model.state_dict()
    covered: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for stored_name in reader.float_tensors():
            name = tensor_of.get(stored_name, stored_name)
            if name not in state:
                unexpected.append(stored_name)
                continue
            tensor = reader.store.get(stored_name)
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ExportReadError(
                    f"{path}: {name} is stored with shape {list(tensor.shape)} but the model "
                    f"built from config.json has {list(state[name].shape)}"
                )
            state[name].copy_(tensor)
            covered.add(name)
    if unexpected:
        logger.warning(
            "%s: %d stored tensor(s) the model does not have were ignored: %s",
            path,
            len(unexpected),
            ", ".join(unexpected[:MAX_LISTED_ERRORS]),
        )
    return covered


def _linear_weight(model: nn.Module, name: str, path: Path) -> torch.Tensor:
    """The weight of the quantized layer ``name`` in the rebuilt model."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ExportReadError(
            f"{path}: quantized layer {name} is not a module of the model built from config.json"
        ) from None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ExportReadError(f"{path}: quantized layer {name} has no weight in the model")
    return weight


def _check_covered(model: nn.Module, covered: set[str], path: Path) -> None:
    """Every parameter (tied ones once) must come from the export, none left at its random init."""
    missing = [name for name, _ in model.named_parameters() if name not in covered]
    if missing:
        raise ExportReadError(
            f"{path}: the export holds no value for {len(missing)} parameter(s) of the model: "
            f"{', '.join(missing[:MAX_LISTED_ERRORS])}"
        )


# --- evaluation ------------------------------------------------------------------------------


def evaluate_perplexity(
    model_dir: str | Path,
    data_path: str | Path,
    *,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> PerplexityResult:
    """The perplexity of a float model folder or an msquant export on a local text file.

    :param model_dir: a Hugging Face model folder or one export folder (Ascend, MindIE naming,
        GPTQ, compressed-tensors); for a several-saver save path pass one of its subfolders.
    :param data_path: ``.txt`` (samples separated by blank lines), ``.jsonl`` or ``.json``.
    :param seqlen: window length in tokens (at most the model's ``max_position_embeddings``).
    :param stride: distance between window starts (default ``seqlen``: non-overlapping).
    :param max_samples: evaluate at most this many windows.
    :param tokenizer_dir: where the tokenizer is (default ``model_dir``; exports carry a copy).
    :raises MsquantInputError: (subclasses) for a missing folder or file, settings that do not
        fit the model, or text without tokens.
    """
    sliding_windows(2, seqlen, stride, max_samples)  # validate the settings before loading
    backend = get_backend(device)
    model_kind(model_dir)  # a clear message for a missing folder or a several-saver save path
    config = load_model_config(Path(model_dir), trust_remote_code)
    _check_seqlen(seqlen, config, model_dir)
    tokenizer = load_tokenizer(Path(tokenizer_dir or model_dir), trust_remote_code)
    ids = read_eval_tokens(data_path, tokenizer)
    started = time.perf_counter()
    model, kind = load_model_for_eval(model_dir, trust_remote_code)
    model = backend.to_device(model)
    loaded = time.perf_counter()
    logger.info("evaluating %s [%s] on %s (%d tokens)", model_dir, kind, data_path, ids.numel())
    measured = measure_perplexity(model, ids, seqlen, stride, max_samples)
    return PerplexityResult(
        model=str(model_dir),
        kind=kind,
        data=str(data_path),
        ppl=measured.ppl,
        nll=measured.nll,
        tokens=measured.tokens,
        windows=measured.windows,
        text_tokens=measured.text_tokens,
        seqlen=seqlen,
        stride=seqlen if stride is None else stride,
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        seconds=measured.seconds,
        load_seconds=loaded - started,
    )


def _check_seqlen(seqlen: int, config: Any, model_dir: str | Path, flag: str = "--seqlen") -> None:
    """Refuse windows longer than the model's positions; ``flag`` names the option to fix."""
    limit = max_positions(config)
    if limit is not None and seqlen > limit:
        raise EvaluationError(
            f"{flag.lstrip('-').replace('_', ' ')} {seqlen} is longer than the model's "
            f"max_position_embeddings ({limit}) in {model_dir}; pass {flag} {limit} or less"
        )


def compare_perplexity(
    original_dir: str | Path,
    quantized_dir: str | Path,
    data_path: str | Path,
    *,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> PerplexityComparison:
    """Perplexities of an original model and its export on the same tokens (both tokenized with
    the original's tokenizer), and the relative increase.

    :raises MsquantInputError: (subclasses) as :func:`evaluate_perplexity`, checked for both
        folders before either model is evaluated.
    """
    for folder in (original_dir, quantized_dir):
        model_kind(folder)
        _check_seqlen(seqlen, load_model_config(Path(folder), trust_remote_code), folder)
    options: dict[str, Any] = dict(
        seqlen=seqlen,
        stride=stride,
        max_samples=max_samples,
        device=device,
        trust_remote_code=trust_remote_code,
        tokenizer_dir=original_dir,
    )
    original = evaluate_perplexity(original_dir, data_path, **options)
    quantized = evaluate_perplexity(quantized_dir, data_path, **options)
    return PerplexityComparison(original, quantized)


# --- the evaluation of a quantization run ----------------------------------------------------


@dataclass(frozen=True)
class EvaluationData:
    """An evaluation text file read and checked before a quantization run starts
    (``quant --eval_data``), measured on the run's in-memory model once the export is verified.

    :param path: the text file.
    :param sha256: sha256 of its bytes.
    :param texts: its samples.
    :param seqlen: window length in tokens.
    :param stride: distance between window starts.
    :param max_samples: evaluate at most this many windows (None: the whole text).
    """

    path: Path
    sha256: str
    texts: tuple[str, ...]
    seqlen: int
    stride: int
    max_samples: int | None

    def settings(self) -> dict[str, Any]:
        """What makes two evaluations comparable (and the file), keyed as in the report's
        ``evaluation``."""
        return {
            "data": str(self.path),
            "data_sha256": self.sha256,
            "seqlen": self.seqlen,
            "stride": self.stride,
            "max_samples": self.max_samples,
        }

    def check_model(self, config: Any, model_dir: str | Path) -> None:
        """Refuse a ``seqlen`` longer than the model's positions (from its config, no weights).

        :raises EvaluationError: naming the longest allowed value.
        """
        _check_seqlen(self.seqlen, config, model_dir, flag="--eval_seqlen")

    def tokens(self, tokenizer: Any) -> torch.Tensor:
        """The token ids of the text, as ``msquant eval`` tokenizes it.

        :raises EvaluationError: when the text yields fewer than 2 tokens.
        """
        return _tokenize_texts(self.texts, tokenizer, self.path)

    def evaluate(
        self, model: nn.Module, input_ids: torch.Tensor, backend: Backend | None = None
    ) -> EvaluationReport:
        """The perplexity of ``model`` on the tokens, for the run report.

        With a ``backend`` the whole model is moved to its device for the forward passes and
        back to host memory afterwards (as ``msquant eval`` runs it: the model must fit).
        """
        if backend is not None:
            model = backend.to_device(model)
        try:
            logger.info(
                "evaluating the quantized model on %s (%d tokens)", self.path, input_ids.numel()
            )
            measured = measure_perplexity(
                model, input_ids, self.seqlen, self.stride, self.max_samples
            )
        finally:
            if backend is not None:
                backend.offload(model)
        logger.info(
            "perplexity %.4f on %s (%d tokens in %d window(s) of %d, stride %d) in %.1f s",
            measured.ppl,
            self.path,
            measured.tokens,
            measured.windows,
            self.seqlen,
            self.stride,
            measured.seconds,
        )
        return EvaluationReport(
            data=str(self.path),
            data_sha256=self.sha256,
            seqlen=self.seqlen,
            stride=self.stride,
            max_samples=self.max_samples,
            windows=measured.windows,
            tokens=measured.tokens,
            text_tokens=measured.text_tokens,
            nll=measured.nll,
            ppl=measured.ppl,
            seconds=measured.seconds,
        )


def prepare_evaluation(
    data_path: str | Path,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
) -> EvaluationData:
    """Check the window settings and read the text file, before any model is loaded.

    :raises EvaluationError: for settings out of range or a missing, unreadable or empty file.
    """
    sliding_windows(2, seqlen, stride, max_samples)  # validates the settings
    path = Path(data_path)
    texts = _read_eval_texts(path)
    return EvaluationData(
        path=path,
        sha256=file_sha256(path),
        texts=tuple(texts),
        seqlen=seqlen,
        stride=seqlen if stride is None else stride,
        max_samples=max_samples,
    )
