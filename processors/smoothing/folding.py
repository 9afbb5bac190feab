"""Apply one smoothing subgraph's scales to the model's modules (the glue around the pure
numerics of :mod:`msquant.quant.smoothing`).

A :class:`ScaleRule` says how a processor turns statistics into scales (``iter_smooth`` and
``smooth_quant``: fixed ``alpha``; ``flex_smooth_quant``: ``alpha`` / ``beta``, searched when not
given; ``flex_awq_ssz``: ``alpha`` given or searched under the entry's quantization, ``beta`` 0);
:func:`smooth_subgraph` computes the subgraph's weight statistic, asks the rule for the scales and
folds them, in msModelSlim's order of operations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from msquant.plugin.model import SmoothingSubgraph
from msquant.plugin.numerics import (
    abs_column_max,
    flex_scales,
    fold_into_linear_columns,
    fold_into_linear_rows,
    fold_into_norm,
    iter_scales,
    iter_weight_stat,
    ov_scales_max,
    ov_scales_mean,
    search_alpha_beta,
)
from msquant.processors.smoothing.awq_search import WeightFakeQuant, search_alpha

__all__ = ["MAX_SEARCH_TOKENS", "ScaleRule", "smooth_subgraph"]

logger = logging.getLogger(__name__)

#: The alpha/beta search evaluates its objective on at most this many calibration tokens (evenly
#: spaced over all of them); the activation maxima of the scales use every token.
MAX_SEARCH_TOKENS = 1024


@dataclass(frozen=True)
class ScaleRule:
    """How scales follow from statistics.

    :param kind: ``"iter"`` (``a^alpha / w^(1-alpha)`` floored at ``scale_min``; o/v scales
        averaged over the query heads of a key/value head; signed weight maxima for linear ->
        linear pairs), ``"flex"`` (``a^alpha / w^beta`` floored at 1e-5; o/v statistics
        reduced by their maximum; ``alpha`` / ``beta`` searched when either is None) or
        ``"awq"`` (the flex formulas with ``beta`` 0, the activation statistic a mean; ``alpha``
        searched by :func:`~msquant.processors.smoothing.awq_search.search_alpha` under
        ``fake_quant`` when None).
    :param fake_quant: the awq rule's weight quantization (its entry's ``qconfig.weight``).
    """

    kind: str
    alpha: float | None
    beta: float | None = None
    scale_min: float = 1e-5
    fake_quant: WeightFakeQuant | None = None

    def alpha_beta(
        self, rows: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[float, float]:
        """The flex and awq rules' ``(alpha, beta)``: as given, or searched on ``rows`` (the
        smoothing processor passes at most :data:`MAX_SEARCH_TOKENS` of them, evenly spaced);
        ``bias`` is the consumer's, which the awq objective adds to the quantized product."""
        if self.kind == "awq":
            return self._awq_alpha(rows, weight, bias), 0.0
        if self.alpha is not None and self.beta is not None:
            return self.alpha, self.beta
        if rows is None:
            raise ValueError("flex_smooth_quant: no calibration rows to search alpha and beta on")
        alpha, beta, error = search_alpha_beta(rows.to(weight.dtype), weight)
        logger.debug("alpha %.2f beta %.2f (relative error %.5f)", alpha, beta, error)
        return alpha, beta

    def _awq_alpha(
        self, rows: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> float:
        if self.alpha is not None:
            return self.alpha
        if rows is None or self.fake_quant is None:
            raise ValueError("flex_awq_ssz: no calibration rows or quantizer to search alpha with")
        alpha, error = search_alpha(rows.to(weight.dtype), weight, bias, self.fake_quant)
        logger.debug("alpha %.2f (relative error %.5f)", alpha, error)
        return alpha


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.data


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.data if isinstance(bias, torch.Tensor) else None


@torch.no_grad()
def smooth_subgraph(
    model: nn.Module,
    subgraph: SmoothingSubgraph,
    rule: ScaleRule,
    act_max: torch.Tensor,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """Compute ``subgraph``'s scales from ``act_max`` (the per-channel statistic of its first
    target's input: the absolute maximum, or for the awq rule the mean absolute value) and fold
    them into its modules in place; returns the scales.

    :param rows: the first target's input rows, for the flex rule's search (else unused).
    """
    source = model.get_submodule(subgraph.source)
    targets = [model.get_submodule(name) for name in subgraph.targets]
    weights = [_weight(t) for t in targets]
    act_max = act_max.to(weights[0].device)
    if subgraph.kind == "norm-linear":
        if rule.kind == "iter":
            assert rule.alpha is not None
            scales = iter_scales(act_max, abs_column_max(weights), rule.alpha, rule.scale_min)
        else:
            # flex_awq_ssz measures its search on the first two linears of a norm feeding more
            # than three (all of them otherwise), as msModelSlim does
            searched = weights[:2] if rule.kind == "awq" and len(weights) > 3 else weights
            alpha, beta = rule.alpha_beta(rows, torch.cat(searched, dim=0))
            scales = flex_scales(act_max, abs_column_max(weights), alpha, beta)
        for weight in weights:
            fold_into_linear_columns(weight, scales)
        fold_into_norm(_weight(source), _bias(source), scales, subgraph.norm_offset or 0.0)
        return scales
    (weight,) = weights
    if subgraph.kind == "ov":
        assert subgraph.heads is not None
        heads, kv_heads = subgraph.heads
        if rule.kind == "iter":
            assert rule.alpha is not None
            scales = iter_scales(
                act_max, iter_weight_stat([weight], signed=True), rule.alpha, rule.scale_min
            )
            o_scales, v_scales = ov_scales_mean(scales, heads, kv_heads)
        else:
            alpha, beta = rule.alpha_beta(rows, weight, _bias(targets[0]))
            o_scales, v_scales = ov_scales_max(
                act_max, abs_column_max([weight]), alpha, beta, heads, kv_heads
            )
        fold_into_linear_columns(weight, o_scales)
        fold_into_linear_rows(_weight(source), _bias(source), v_scales)
        return v_scales
    # up-down, linear-linear: the source's outputs are the target's inputs, channel by channel
    if rule.kind == "iter":
        assert rule.alpha is not None
        scales = iter_scales(
            act_max, iter_weight_stat([weight], signed=True), rule.alpha, rule.scale_min
        )
    else:
        alpha, beta = rule.alpha_beta(rows, weight, _bias(targets[0]))
        scales = flex_scales(act_max, abs_column_max([weight]), alpha, beta)
    fold_into_linear_columns(weight, scales)
    fold_into_linear_rows(_weight(source), _bias(source), scales)
    return scales
