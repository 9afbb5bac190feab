"""``msquant verify --model_path``: does the export compute what the original model computes?

Comparing tensors one by one says nothing about an export whose float weights were transformed
(a rotation, a smoothing: every tensor differs from the original by design), and little about a
norm or a scale that was changed consistently. This check runs both models on a few fixed
tokens and compares their logits:

* the original: loaded from its folder (safetensors; no remote code);
* the export: rebuilt as a float model by the reader of its format, every quantized linear
  dequantized (:func:`msquant.verify.rebuild.load_export`, as ``msquant eval`` does) but its
  activations kept in float: what is compared is what the stored weights compute. Activation
  quantization is the scheme's own error (on SmolLM2-135M it alone moves an honest W8A8 export's
  logits by 0.17 to 0.30), and would hide a changed norm under it.

The error is the relative Frobenius distance of the logits, each centred per token (softmax
ignores a constant per token): ``||c(L_export) - c(L_float)|| / ||c(L_float)||``. Quantization
makes it nonzero; the bound depends on the scheme (:func:`logits_error_bound`), set from
measurements of every example config on tiny random models and SmolLM2-135M
(``bench/verify_forward.py``, docs/reliability.md). The top-1 agreement is reported too.

Memory: the two models are loaded one after the other, each whole, in the original's dtype;
the peak is one float copy of the model (like ``msquant eval``), not a layer at a time as
``msquant quant`` streams it.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.contracts.format import FormatRegistry
from msquant.errors import ModelLoadError
from msquant.load.model_folder import check_model_dir, load_causal_lm, load_tokenizer
from msquant.quant.int_quant import dequantize, minmax_qparams, quantize
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.quant.value_types import ValueType, value_type_named
from msquant.verify.errors import ExportReadError
from msquant.verify.rebuild import load_export
from msquant.verify.report import Findings, LayerReport

__all__ = [
    "FORWARD_TEXT",
    "FORWARD_TOKENS",
    "ForwardCheck",
    "compare_forward",
    "logits_error",
    "logits_error_bound",
]

logger = logging.getLogger(__name__)

#: The text both models read (tokenized by the original's tokenizer; seeded token ids when it
#: has none), cut to :data:`FORWARD_TOKENS` tokens.
FORWARD_TEXT = (
    "The capital of France is Paris, and the capital of Germany is Berlin. def add(a, b):\n"
    "    return a + b\nOnce upon a time, in a small village near the mountains, there lived"
)
FORWARD_TOKENS = 32


@dataclass
class ForwardCheck:
    """The logits comparison of an export with its original model.

    :param tokens: how many tokens both models read.
    :param scheme: what the bound was chosen for (``"W4 weights"``: the narrowest quantized
        weights; activations are compared in float).
    :param relative_error: ``||c(L_export) - c(L_float)|| / ||c(L_float)||``, logits centred
        per token.
    :param bound: the largest relative error accepted (:func:`logits_error_bound`).
    :param rounded_error: the original's error once rounded to nearest at the export's narrowest
        weight width, which the bound is a multiple of.
    :param top1_agreement: the fraction of tokens whose most likely next token is the same.
    :param seconds: the wall time of the check (both loads and forwards).
    """

    tokens: int
    scheme: str
    relative_error: float
    bound: float
    rounded_error: float
    top1_agreement: float
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether the error is within the bound."""
        return self.relative_error <= self.bound


def logits_error(export: torch.Tensor, original: torch.Tensor) -> tuple[float, float]:
    """``(relative error, top-1 agreement)`` of ``[tokens, vocab]`` logits (see the module doc)."""
    a = export.to(torch.float64)
    b = original.to(torch.float64)
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    norm = float(b.norm())
    error = float((a - b).norm())
    relative = error / norm if norm > 0 else (0.0 if error == 0 else float("inf"))
    agreement = float((export.argmax(-1) == original.argmax(-1)).to(torch.float64).mean())
    return relative, agreement


#: How many times the logits error of the original model rounded to nearest (per channel,
#: symmetric, at the export's narrowest weight width) an export's error may be, by that width.
ROUNDING_FACTOR = {8: 8.0, 4: 2.0}
#: The smallest bound (a float or 16-bit export: the error of the float arithmetic alone).
MIN_BOUND = 0.02


def logits_error_bound(weight_bits: int | None, rounded_error: float) -> float:
    """The largest accepted logits error for an export whose narrowest quantized weights have
    ``weight_bits`` bits (None: none quantized), compared with activations kept in float, given
    ``rounded_error``: the error of the original model with its linears rounded to nearest at
    that width (:func:`rounded_logits_error`), this model's own scale of weight rounding noise.

    8 times it for 8 or more bits, twice it below, at least :data:`MIN_BOUND`. Measured with
    ``bench/verify_forward.py`` (docs/reliability.md): on SmolLM2-135M rounding costs 0.046 at 8
    bits, honest exports of every example measured at most 0.172 (3.7 times; a smoothed export:
    smoothing moves the activations' outliers into the weights, whose rounding then costs
    more), a tampered norm, scales folded twice or permuted input columns 0.63 to 1.18 (14 to 26
    times); on tiny random Llamas honest exports stayed within 1.5 times, tampers 10 times and
    more. 4-bit methods (per group, GPTQ, ssz) do no worse than rounding per channel; twice that
    catches only gross changes. Activations are not simulated: their quantization error is the
    scheme's, not the export's (0.17 to 0.30 on honest W8A8 exports of SmolLM2-135M), and would
    hide a changed norm.
    """
    bits = weight_bits or 16
    factor = ROUNDING_FACTOR[8] if bits >= 8 else ROUNDING_FACTOR[4]
    return max(factor * rounded_error, MIN_BOUND)


@torch.no_grad()
def rounded_logits_error(
    model: nn.Module,
    ids: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    values: ValueType | None = None,
) -> float:
    """The logits error of ``model`` once every linear but its output head is rounded to
    nearest at ``bits`` bits (per channel, symmetric; in place: the model is spent), or, for a
    value type computing its own scales (``values``: MX), quantized by it (a linear whose
    ``in_features`` it cannot block stays float)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not head:
            weight = module.weight
            if values is not None and values.self_scaled:
                if weight.shape[1] % (values.block_size or 1) == 0:
                    rounded = QuantizedWeight.self_scaled(weight, values).dequantize()
                    weight.copy_(rounded.to(weight.dtype))
                continue
            scale, offset = minmax_qparams(weight, bits, True, None)
            codes = quantize(weight, scale, offset, bits, None)
            weight.copy_(dequantize(codes, scale, offset, None).to(weight.dtype))
    return logits_error(_logits(model, ids), reference)[0]


def _scheme(weight_bits: int | None, values: ValueType | None = None) -> str:
    if values is not None and values.self_scaled:
        return f"{values.name} weights"
    return f"W{weight_bits} weights" if weight_bits else "float weights"


def _loosest(layers: list[LayerReport]) -> ValueType | None:
    """The layers' value type with the largest error bound (the export's most lossy), or None."""
    found = {value_type_named(e.value_type) for e in layers if e.value_type is not None}
    return max(found, key=lambda v: v.error_bound(), default=None)


def forward_tokens(model_path: Path, vocab_size: int) -> torch.Tensor:
    """``[1, FORWARD_TOKENS]`` token ids: :data:`FORWARD_TEXT` through the original's tokenizer,
    or seeded ids below ``vocab_size`` when it has none."""
    try:
        tokenizer = load_tokenizer(model_path)
        ids = tokenizer(FORWARD_TEXT, return_tensors="pt")["input_ids"][:, :FORWARD_TOKENS]
        if ids.numel() and int(ids.max()) < vocab_size:
            return ids.to(torch.long)
    except (ModelLoadError, KeyError, TypeError, ValueError):
        pass
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, FORWARD_TOKENS), generator=generator)


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits[0].to(torch.float32)


def compare_forward(
    path: Path,
    model_path: Path,
    layers: list[LayerReport],
    findings: Findings,
    formats: FormatRegistry | None = None,
) -> ForwardCheck | None:
    """Run the original and the export on the same tokens; an error in ``findings`` when the
    logits differ by more than the scheme's bound.

    :param layers: the export's quantized layers as verified (their bits choose the bound).
    :returns: the comparison, or None when it could not run: the original cannot be run (a
        warning) or the export cannot be rebuilt into a model (an error).
    """
    started = time.perf_counter()
    bits = [entry.bits for entry in layers if entry.bits is not None]
    weight_bits = min(bits) if bits else None
    try:
        original = load_causal_lm(check_model_dir(model_path))
    except ModelLoadError as exc:
        findings.warn(
            f"the forward check was skipped: the original model cannot be run ({exc}); only its "
            "tensors were compared"
        )
        return None
    config: Any = original.config  # a vision-language model's vocabulary is in its text_config
    text_config = getattr(config, "text_config", None)
    vocab = int(getattr(config, "vocab_size", 0) or getattr(text_config, "vocab_size", 0) or 0)
    ids = forward_tokens(model_path, vocab)
    reference = _logits(original, ids)
    values = _loosest(layers)
    rounded = rounded_logits_error(original, ids, reference, min(weight_bits or 8, 8), values)
    del original
    gc.collect()
    try:
        exported = load_export(
            path, trust_remote_code=False, formats=formats, simulate_activations=False
        )
    except (ModelLoadError, ExportReadError) as exc:
        findings.error(f"the export cannot be run for the forward check: {exc}")
        return None
    logits = _logits(exported, ids)
    del exported
    gc.collect()
    if tuple(logits.shape) != tuple(reference.shape):
        findings.error(
            f"the export's logits have shape {list(logits.shape)}, the original's "
            f"{list(reference.shape)}: the export does not compute the original's outputs"
        )
        return None
    relative, agreement = logits_error(logits, reference)
    check = ForwardCheck(
        tokens=int(ids.shape[1]),
        scheme=_scheme(weight_bits, values),
        relative_error=relative,
        bound=logits_error_bound(weight_bits, rounded),
        rounded_error=rounded,
        top1_agreement=agreement,
        seconds=time.perf_counter() - started,
    )
    if not check.ok:
        findings.error(
            f"the export does not compute what the original model computes: on {check.tokens} "
            f"tokens its logits differ from the original's by {relative:.3g} (relative, centred "
            f"per token), more than {check.bound:.3g} for {check.scheme} (the original rounded to "
            f"nearest per channel at that width: {rounded:.3g}; top-1 agreement "
            f"{agreement:.0%}); a weight, norm, scale or rotation was changed or mis-applied"
        )
    logger.debug(
        "forward check of %s: relative logits error %.4f (bound %.2f, %s), top-1 %.3f, %.1f s",
        path,
        relative,
        check.bound,
        check.scheme,
        agreement,
        check.seconds,
    )
    return check
