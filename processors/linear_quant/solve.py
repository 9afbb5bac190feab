"""Solving the modules of one calibration pass of ``linear_quant`` (calibrated methods): the MoE
experts with too few tokens rounded instead, the solves shared out over the processes of a
``dp_layer_wise`` group and broadcast, each module's report entry with its output errors."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from torch import nn
from tqdm.auto import tqdm

from msquant.plugin import (
    DecoderLayer,
    ModuleReport,
    QuantizedWeight,
    QuantMethod,
    ResolvedScheme,
    RunContext,
)
from msquant.plugin.model import balanced_owners
from msquant.plugin.numerics import relative_output_errors
from msquant.processors.linear_quant.calibration import HessianCollector

__all__ = ["OUTPUT_ERROR_COPIES", "Selected", "solve_modules"]

logger = logging.getLogger(__name__)

#: A selected module: its name, the linear layer and its resolved scheme.
Selected = tuple[str, nn.Linear, ResolvedScheme]
#: Float32 copies of a module's weight the output-error check of its report entry holds at once:
#: the weight, the solved and the rounded weights dequantized, their two differences, and the
#: three stacked with their product with the Hessian (:func:`msquant.plugin.numerics.relative_output_errors`).
OUTPUT_ERROR_COPIES = 11
#: The scheme part of a module's report entry.
ReportOf = Callable[[str, ResolvedScheme], ModuleReport]


def solve_modules(
    ctx: RunContext,
    layer: DecoderLayer,
    modules: Sequence[Selected],
    method: QuantMethod,
    collector: HessianCollector,
    report_of: ReportOf,
) -> dict[str, tuple[QuantizedWeight, ModuleReport]]:
    """The solved weights of a pass's modules (their Hessians in ``collector``), by name, with
    their report entries (``report_of`` gives a module's scheme part).

    In a ``dp_layer_wise`` group the Hessians are first summed over the processes (each saw
    its share of the calibration batches); each module is then solved by one process (shared
    out by cost, ``out * in^2 + in^3 / 3``) and its result broadcast to the others.
    """
    dist = ctx.dist
    if dist.active:
        collector.all_reduce([name for name, _, _ in modules], dist.all_reduce_sum)
    solved: dict[str, tuple[QuantizedWeight, ModuleReport]] = {}
    for name, module, scheme in modules:
        reason = _expert_fallback(ctx, name, module, method, collector)
        if reason is not None:  # the same decision in every process (summed token counts)
            logger.info("%s: round-to-nearest instead of %s: %s", name, method.name, reason)
            solved[name] = (
                method.quantize_rtn(module.weight, scheme, name),
                replace(
                    report_of(name, scheme),
                    tokens=collector.quantizers[name].nsamples,
                    fallback=reason,
                ),
            )
    modules = [m for m in modules if m[0] not in solved]
    if dist.active:
        costs = [m.out_features * m.in_features**2 + m.in_features**3 / 3 for _, m, _ in modules]
        owners = balanced_owners(costs, dist.world_size)
    else:
        owners = [dist.rank] * len(modules)
    mine = [m for m, owner in zip(modules, owners, strict=True) if owner == dist.rank]
    for name, module, scheme in tqdm(
        mine,
        desc=layer.name,
        unit="linear",
        leave=False,
        disable=not ctx.progress or len(mine) < 2,
    ):
        solved[name] = _solve_module(ctx, name, module, scheme, method, collector, report_of)
    collector.clear()  # solved here or elsewhere: drop the Hessian references
    if dist.active:
        for (name, _, _), owner in zip(modules, owners, strict=True):
            mine_solved = solved.get(name)
            payload = None
            if mine_solved is not None:
                payload = (_on_cpu(mine_solved[0]), mine_solved[1])
            received = dist.broadcast_object(payload, owner)
            assert received is not None, f"{name}: process {owner} sent no result"
            solved[name] = received
    return solved


def _expert_fallback(
    ctx: RunContext,
    name: str,
    module: nn.Linear,
    method: QuantMethod,
    collector: HessianCollector,
) -> str | None:
    """Why an MoE expert's linear layer is rounded to nearest instead of solved (too few
    calibration tokens were routed to it: a Hessian of fewer rows than about twice its
    columns makes GPTQ fit the calibration tokens and do worse than rounding), or None."""
    if ctx.experts.expert_of(name) is None:
        return None
    tokens = collector.quantizers[name].nsamples
    if method.solves_expert(tokens, module.in_features):
        return None
    ratio = method.expert_min_tokens
    return (
        f"MoE expert received {tokens} calibration token(s), fewer than "
        f"{ratio:g} x in_features {module.in_features} (ext.expert_min_tokens)"
    )


def _solve_module(
    ctx: RunContext,
    name: str,
    module: nn.Linear,
    scheme: ResolvedScheme,
    method: QuantMethod,
    collector: HessianCollector,
    report_of: ReportOf,
) -> tuple[QuantizedWeight, ModuleReport]:
    """Solve ``module``; its report entry carries the method's statistics and the output
    errors (solved and round-to-nearest, on the calibration Hessian, read before the
    quantizer is dropped; the accumulator is not freed here since q/k/v or gate/up may
    share it)."""
    quantizer = collector.quantizers[name]
    qweight, stats = method.solve(quantizer, module.weight, ctx.backend)
    hessian, _ = quantizer.accumulator.raw_sum()
    rtn = method.rtn_baseline(module.weight, scheme, name, qweight, stats)
    errors = relative_output_errors(
        module.weight, [qweight.dequantize(), rtn.dequantize()], hessian
    )
    logger.debug("%s: output error %.4g (round-to-nearest %.4g)", name, errors[0], errors[1])
    report = replace(
        report_of(name, scheme),
        output_error=errors[0],
        rtn_output_error=errors[1],
        **stats,
    )
    return qweight, report


def _on_cpu(qweight: QuantizedWeight) -> QuantizedWeight:
    """The same weight with its tensors in host memory (to send it to the other processes)."""
    return replace(
        qweight, codes=qweight.codes.cpu(), scale=qweight.scale.cpu(), offset=qweight.offset.cpu()
    )
