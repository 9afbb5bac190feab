"""A run report as a plain-text table (the run's INFO log, ``msquant report``)."""

from __future__ import annotations

from msquant.report.run_report import ModuleReport, RunReport

__all__ = ["render_report"]


def render_report(report: RunReport) -> str:
    """A human-readable table of the modules and the run totals (for the INFO log)."""
    headers = ("module", "method", "bits", "group", "sym", "loss", "damp", "err", "rtn err", "s")
    rows = [headers] + [_module_row(m) for m in report.modules]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    errors = [m.output_error for m in report.modules if m.output_error is not None]
    rtn = [m.rtn_output_error for m in report.modules if m.rtn_output_error is not None]
    summary = f"{len(report.modules)} module(s), {len(report.layers)} layer(s)"
    if errors and rtn:
        summary += (
            f", mean output error {sum(errors) / len(errors):.4g} "
            f"(round-to-nearest {sum(rtn) / len(rtn):.4g})"
        )
    summary += f", {report.total_seconds:.1f} s"
    if report.kv_caches:
        schemes = "/".join(sorted({cache.scheme for cache in report.kv_caches}))
        summary += f"\nKV cache {schemes} on {len(report.kv_caches)} attention(s)"
    evaluation = report.evaluation
    if evaluation is not None:
        summary += (
            f"\nperplexity {evaluation.ppl:.4f} on {evaluation.data} ({evaluation.tokens} tokens in "
            f"{evaluation.windows} window(s) of {evaluation.seqlen}, stride {evaluation.stride})"
        )
    return "\n".join([*lines, summary])


def _module_row(module: ModuleReport) -> tuple[str, ...]:
    seconds = module.solve_seconds
    return (
        module.name,
        module.method,
        str(module.bits)
        if module.value_type in (None, f"int{module.bits}")
        else str(module.value_type),
        "channel" if module.group_size is None else str(module.group_size),
        "yes" if module.symmetric else "no",
        _fmt(module.gptq_loss),
        _fmt(module.percdamp),
        _fmt(module.output_error),
        _fmt(module.rtn_output_error),
        "-" if seconds is None else f"{seconds:.2f}",
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
