"""A plan as a plain-text table followed by a summary, the errors and the warnings."""

from __future__ import annotations

from msquant.planning.model import ModelPlan

__all__ = ["render_plan"]


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _kv_cache_lines(result: ModelPlan) -> list[str]:
    """One line per KV-cache entry: the scheme, how many attentions get it, and those left
    float (named; the quantized ones are every other attention the entry considers)."""
    lines = []
    for entry in dict.fromkeys(cache.decided_by for cache in result.kv_caches):
        caches = [cache for cache in result.kv_caches if cache.decided_by == entry]
        schemes = sorted({c.scheme for c in caches if c.scheme is not None})
        quantized = sum(c.scheme is not None for c in caches)
        line = (
            f"KV cache ({entry}): {'/'.join(schemes) or 'float'} on {quantized} of "
            f"{len(caches)} attention(s)"
        )
        floats = [c.module for c in caches if c.scheme is None]
        if floats:
            line += f"; left in float: {', '.join(floats)}"
        lines.append(line)
    return lines


def render_plan(result: ModelPlan) -> str:
    """A plain-text table of the plan followed by a summary, the errors and the warnings."""
    # an "act" column only when a module quantizes its activations (weight-only plans unchanged)
    with_act = any(row.act is not None for row in result.rows)
    header: tuple[str, ...] = ("module", "bits", "group", "sym", "method", "skipped", "decided by")
    # the "bits" column names the value type when a module's codes are not integers (mxfp8)
    typed = any(row.value_type not in (None, f"int{row.bits}") for row in result.rows)
    if with_act:
        header = (*header[:5], "act", *header[5:])
    table: list[tuple[str, ...]] = [header]
    for row in result.rows:
        group = "channel" if row.group_size == -1 else _cell(row.group_size)
        cells: tuple[str, ...] = (
            row.module,
            _cell(row.value_type if typed and row.value_type is not None else row.bits),
            group,
            _cell(row.sym),
            _cell(row.method),
            _cell(row.skipped),
            row.decided_by,
        )
        if with_act:
            cells = (*cells[:5], _cell(row.act), *cells[5:])
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]
    quantized = [row for row in result.rows if not row.skipped]
    lines.append(
        f"{result.model_type}: {len(result.rows)} linear layer(s), {len(quantized)} quantized, "
        f"{len(result.rows) - len(quantized)} left in float"
    )
    lines += _kv_cache_lines(result)
    for kind, messages in (("error", result.errors), ("warning", result.warnings)):
        if messages:
            lines.append(f"{len(messages)} {kind}(s):")
            lines += [f"  - {message}" for message in messages]
    lines.append("OK" if result.ok else "FAILED: the config cannot be applied to this model")
    return "\n".join(lines)
