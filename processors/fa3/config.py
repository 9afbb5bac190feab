"""The config of ``fa3_quant`` (msModelSlim 26.1.0's ``FA3QuantProcessorConfig``) and its checks.

Fields as msModelSlim's: ``qconfig`` (default int8 ``per_head`` symmetric ``minmax``: static,
calibrated), ``include`` (default ``["*"]``), ``exclude``, and ``details`` (``fa_q`` / ``fa_k``
/ ``fa_v``, one qconfig per branch), exclusive with ``qconfig``. The globs select attention
modules by full name (``model.layers.3.self_attn``; GLM-5: its indexer,
``model.layers.3.self_attn.indexer``).

Implemented: int8 and fp8_e4m3 (float8 e4m3, as msModelSlim's DeepSeek-V3.1 / Kimi-K2.6
``c8`` practices), symmetric, ``per_head`` (static) and ``per_token`` (dynamic), branches free to
mix them (``fa_q`` fp8 per_token with ``fa_k`` / ``fa_v`` fp8 per_head). msModelSlim also knows
mxfp4 / mxfp8 ``per_block`` (dynamic, per block of 32 along the head dimension); those are refused
here, naming the YAML path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from msquant.plugin import ConfigIssue, ProcessorConfig, QDType, QScope
from msquant.plugin.model import pattern_problem

__all__ = ["BRANCHES", "FA3QConfig", "FA3Details", "FA3QuantConfig", "config_issues"]

BRANCHES = ("fa_q", "fa_k", "fa_v")
IMPLEMENTED_DTYPES = (QDType.INT8, QDType.FP8_E4M3)
IMPLEMENTED_SCOPES = (QScope.PER_HEAD, QScope.PER_TOKEN)
NOT_YET = (
    "fa3_quant implements int8 and fp8_e4m3, symmetric, per_head (static) and per_token "
    "(dynamic) with method minmax; {what} is not implemented (msModelSlim's mxfp4 / mxfp8 "
    "per_block attention values are not, msquant issue 26): use dtype int8 or fp8_e4m3 with "
    "scope per_head or per_token"
)


class FA3QConfig(BaseModel):
    """One FA3 branch's scheme (msModelSlim's ``QConfig``: every field required)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    dtype: QDType = Field(
        description="int8 or fp8_e4m3 (float8 e4m3, scale from max |x| / 448); mxfp4 / mxfp8 are "
        "not implemented."
    )
    scope: QScope = Field(
        description="per_head: static, one scale per head from calibration; per_token: dynamic, "
        "computed by the serving engine (no tensor exported)."
    )
    symmetric: bool = Field(description="Must be true.")
    method: str = Field(description="minmax (per_head observes a recall window, as msModelSlim).")
    ext: dict[str, Any] = Field(default_factory=dict, description="Unused (must be empty).")


class FA3Details(BaseModel):
    """Per-branch schemes: ``fa_q`` (query), ``fa_k`` (key), ``fa_v`` (value); a branch left
    out is not quantized."""

    model_config = ConfigDict(extra="forbid")

    fa_q: FA3QConfig | None = Field(None, description="Query branch.")
    fa_k: FA3QConfig | None = Field(None, description="Key branch.")
    fa_v: FA3QConfig | None = Field(None, description="Value branch.")


DEFAULT_QCONFIG = FA3QConfig(
    dtype=QDType.INT8, scope=QScope.PER_HEAD, symmetric=True, method="minmax"
)


class FA3QuantConfig(ProcessorConfig):
    """Config of ``fa3_quant``."""

    type: Literal["fa3_quant"] = "fa3_quant"
    qconfig: FA3QConfig | None = Field(
        None,
        description="The scheme of every branch; default int8 per_head symmetric minmax. "
        "Exclusive with details.",
    )
    include: list[str] = Field(
        default_factory=lambda: ["*"], description="Globs of the attention modules to quantize."
    )
    exclude: list[str] = Field(default_factory=list, description="Globs of those to leave alone.")
    details: FA3Details | None = Field(
        None, description="Per-branch schemes (fa_q, fa_k, fa_v); exclusive with qconfig."
    )

    def branch_configs(self) -> dict[str, FA3QConfig]:
        """Branch (``fa_q``...) -> its scheme; every branch takes ``qconfig`` (or the default)
        unless ``details`` is given."""
        if self.details is not None:
            return {b: c for b in BRANCHES if (c := getattr(self.details, b)) is not None}
        qconfig = self.qconfig or DEFAULT_QCONFIG
        return dict.fromkeys(BRANCHES, qconfig)


def config_issues(config: FA3QuantConfig) -> list[ConfigIssue]:
    """Semantic problems of an ``fa3_quant`` entry (paths relative to the entry)."""
    issues: list[ConfigIssue] = []
    if config.qconfig is not None and config.details is not None:
        issues.append(
            ConfigIssue(
                "details",
                "qconfig and details are exclusive (msModelSlim refuses both): give qconfig for "
                "every branch or details per branch",
            )
        )
        return issues
    if config.details is not None and not config.branch_configs():
        issues.append(ConfigIssue("details", "details sets no branch: give fa_q, fa_k and/or fa_v"))
    if config.details is not None:
        entries = [(f"details.{b}", c) for b, c in config.branch_configs().items()]
    else:
        entries = [("qconfig", config.qconfig)] if config.qconfig is not None else []
    for path, qconfig in entries:
        issues += _qconfig_issues(path, qconfig)
    for key in ("include", "exclude"):
        for index, pattern in enumerate(getattr(config, key)):
            problem = pattern_problem(pattern)
            if problem:
                issues.append(ConfigIssue(f"{key}[{index}]", problem))
    return issues


def _qconfig_issues(path: str, qconfig: FA3QConfig) -> list[ConfigIssue]:
    if qconfig.dtype not in IMPLEMENTED_DTYPES:
        what = f"dtype {qconfig.dtype.value}"
        return [ConfigIssue(f"{path}.dtype", NOT_YET.format(what=what))]
    issues = []
    if qconfig.scope not in IMPLEMENTED_SCOPES:
        what = f"scope {qconfig.scope.value}"
        issues.append(ConfigIssue(f"{path}.scope", NOT_YET.format(what=what)))
    if not qconfig.symmetric:
        issues.append(
            ConfigIssue(
                f"{path}.symmetric",
                "fa3_quant is symmetric only (msModelSlim computes no per_head offset and its "
                "saver writes zeros): set symmetric: true",
            )
        )
    if qconfig.method != "minmax":
        issues.append(
            ConfigIssue(
                f"{path}.method",
                f"method {qconfig.method!r} is not implemented for fa3_quant: use minmax",
            )
        )
    if qconfig.ext:
        issues.append(ConfigIssue(f"{path}.ext", "fa3_quant reads no ext option: remove it"))
    return issues
