"""msquant: YAML-driven quantization of large language models for Ascend NPUs and CUDA GPUs.

The API for users of msquant, the Python side of the ``msquant`` command: :func:`quantize`
(``msquant quant``), :func:`plan` (``msquant plan``), :func:`verify_export` (``msquant verify``),
:func:`evaluate_perplexity` (``msquant eval``), loading and validating configs, reading and
comparing run reports, and the typed exceptions to catch. Processor, method, format and
model-adapter authors import from :mod:`msquant.plugin`. The names in ``__all__`` are the promise
(docs/api.md); modules under ``msquant`` are not. Nothing here prints; everything logs through
``logging`` under ``msquant``.
"""

# ``import msquant`` also loads the plugin facade (``msquant.plugin``); no engine module imports
# it (they import ``msquant.contracts`` and the modules behind it), so the order is free.
from msquant import plugin as plugin  # isort: skip
from msquant.config import (
    QuantConfig,
    config_json_schema,
    load_config,
    load_config_text,
    validate_config,
)
from msquant.errors import (
    CalibrationDataError,
    ConfigError,
    ConfigIssue,
    DeviceError,
    ModelLoadError,
    MsquantError,
    MsquantInputError,
    NotImplementedYetError,
    OutputPathError,
    QuantizationError,
    RegistryError,
    TransformCheckError,
)
from msquant.evaluate.errors import (
    EvaluationError,
)
from msquant.evaluate.perplexity import (
    compare_perplexity,
    evaluate_perplexity,
)
from msquant.evaluate.results import (
    PerplexityComparison,
    PerplexityResult,
)
from msquant.planning.build import (
    plan,
)
from msquant.planning.model import (
    PlanRow,
)
from msquant.report.document import (
    load_report,
)
from msquant.report.regression import (
    RegressionResult,
    compare_reports,
    load_baseline_report,
)
from msquant.report.run_report import (
    RunReport,
)
from msquant.run.checkpoint.layout import (
    ResumeError,
)
from msquant.run.quantize import (
    QuantizeResult,
    quantize,
)
from msquant.verify import (
    ExportReadError,
    ExportVerificationError,
    VerifyReport,
    check_export,
    verify_export,
)
from msquant.version import (
    __version__,
)

__all__ = [
    "__version__",
    # running and planning
    "quantize",
    "QuantizeResult",
    "plan",
    "PlanRow",
    # configs
    "QuantConfig",
    "load_config",
    "load_config_text",
    "validate_config",
    "config_json_schema",
    # checking an export
    "verify_export",
    "check_export",
    "VerifyReport",
    # evaluation
    "evaluate_perplexity",
    "compare_perplexity",
    "PerplexityResult",
    "PerplexityComparison",
    # run reports and the regression gate
    "RunReport",
    "load_report",
    "compare_reports",
    "load_baseline_report",
    "RegressionResult",
    # errors (every one a MsquantError; MsquantInputError ones mean bad input, exit 2 in the CLI)
    "MsquantError",
    "MsquantInputError",
    "ConfigError",
    "ConfigIssue",
    "ModelLoadError",
    "CalibrationDataError",
    "DeviceError",
    "OutputPathError",
    "QuantizationError",
    "TransformCheckError",
    "NotImplementedYetError",
    "RegistryError",
    "ResumeError",
    "ExportReadError",
    "ExportVerificationError",
    "EvaluationError",
]
