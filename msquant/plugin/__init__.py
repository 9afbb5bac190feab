"""msquant's API for extension authors: processors, quantization methods, export formats and
model adapters.

``msquant`` itself holds what a user of msquant needs (quantize, plan, verify, evaluate, configs,
errors; see docs/api.md). This facade holds the contracts a plugin implements or receives: the
processor, saver, method and format bases with their configs, registries and entry-point
groups, the run context, the model-adapter contract, the quantized weight and linear types with
the quantization settings, what a reader reports, the run report's records, and the errors a
plugin raises. The rest of the plugin API is in sub-namespaces, each with its own ``__all__``:

- :mod:`msquant.plugin.numerics`: the pure quantization, smoothing and rotation numerics;
- :mod:`msquant.plugin.model`: architecture knowledge (fused and expert linears, heads, MoE,
  name patterns, smoothing subgraphs, rotation layouts, norms, the adapter registry);
- :mod:`msquant.plugin.planning`: per-module plans, planning protocols, ``dynamic`` rules;
- :mod:`msquant.plugin.export`: the writers a saver uses;
- :mod:`msquant.plugin.reading`: the helpers a format's reader uses;
- :mod:`msquant.plugin.checks`: proofs that a transform keeps the model's function;
- :mod:`msquant.plugin.devices`: backends and device strings.

The built-in processors (``msquant.processors``) import nothing else from msquant, and neither
should a third-party plugin (a ruff rule bans the rest in ``processors/``): the names in these
``__all__`` lists are the promise (stable within a minor version; docs/api.md), everything
under them may change. The contracts live in the low package :mod:`msquant.contracts`, which
the engine imports; no engine module imports this package, so it adds no import cycle.
"""

from msquant.contracts.context import (
    RunContext,
)
from msquant.contracts.distributed import (
    SINGLE,
    Distributed,
)
from msquant.contracts.format import (
    FORMAT_ENTRY_POINT_GROUP,
    ExportFormat,
    FormatRegistry,
    default_formats,
)
from msquant.contracts.memory import (
    CalibrationSize,
)
from msquant.contracts.method import (
    METHOD_ENTRY_POINT_GROUP,
    CalibratedQuantizer,
    MethodOptions,
    MethodRegistry,
    QuantMethod,
    default_method_registry,
)
from msquant.contracts.processor import (
    OutputHeadUser,
    Processor,
    ProcessorConfig,
    ProcessorConfigList,
    ProcessorContainer,
)
from msquant.contracts.registry import (
    ENTRY_POINT_GROUP,
    ProcessorRegistry,
    default_registry,
)
from msquant.contracts.saver import (
    SAVER_STATE_FORMAT,
    NameSet,
    Saver,
    SaverConfig,
    SaverState,
)
from msquant.contracts.transforms import (
    TransformedExport,
    TransformLog,
)
from msquant.errors import (
    ConfigError,
    ConfigIssue,
    MsquantError,
    MsquantInputError,
    QuantizationError,
    RegistryError,
    TransformCheckError,
)
from msquant.model.adapter import (
    ModelAdapter,
)
from msquant.model.adapter_registry import (
    MODEL_ADAPTER_GROUP,
    adapter_for,
)
from msquant.model.layers import (
    DecoderLayer,
)
from msquant.quant.activation import (
    ActivationQuant,
)
from msquant.quant.qconfig import (
    ActQConfig,
    LinearQConfig,
    QDType,
    QScope,
    WeightQConfig,
)
from msquant.quant.quantized_linear import (
    QuantizedLinear,
)
from msquant.quant.quantized_weight import (
    QuantizedWeight,
)
from msquant.quant.rules import (
    BaseScheme,
    DynamicRule,
    ResolvedScheme,
)
from msquant.quant.value_types import (
    ValueType,
)
from msquant.report.run_report import (
    KVCacheReport,
    ModuleReport,
)
from msquant.run.checkpoint.layout import ResumeError
from msquant.verify import (
    LayerReport,
)
from msquant.verify.base import (
    ExportReader,
)
from msquant.verify.layer import (
    DecodedLayer,
)
from msquant.verify.report import (
    Findings,
)

__all__ = [
    # processors and their registry
    "Processor",
    "ProcessorConfig",
    "ProcessorConfigList",
    "ProcessorContainer",
    "OutputHeadUser",
    "ProcessorRegistry",
    "default_registry",
    "ENTRY_POINT_GROUP",
    # savers
    "Saver",
    "SaverConfig",
    "SaverState",
    "SAVER_STATE_FORMAT",
    "NameSet",
    # quantization methods and the schemes they are given
    "QuantMethod",
    "MethodOptions",
    "MethodRegistry",
    "CalibratedQuantizer",
    "default_method_registry",
    "METHOD_ENTRY_POINT_GROUP",
    "BaseScheme",
    "ResolvedScheme",
    "DynamicRule",
    # export formats: registry, reader contract, what a reader reports
    "ExportFormat",
    "FormatRegistry",
    "default_formats",
    "FORMAT_ENTRY_POINT_GROUP",
    "ExportReader",
    "DecodedLayer",
    "LayerReport",
    "Findings",
    # the run a processor takes part in, and the run report's records
    "RunContext",
    "CalibrationSize",
    "Distributed",
    "SINGLE",
    "TransformLog",
    "TransformedExport",
    "DecoderLayer",
    "ModuleReport",
    "KVCacheReport",
    # model adapters (architecture knowledge keyed by config.model_type)
    "ModelAdapter",
    "MODEL_ADAPTER_GROUP",
    "adapter_for",
    # the quantized representation and the quantization settings of a linear layer
    "QuantizedWeight",
    "QuantizedLinear",
    "ValueType",
    "LinearQConfig",
    "WeightQConfig",
    "ActQConfig",
    "QDType",
    "QScope",
    "ActivationQuant",
    # errors a plugin raises or reports (also in msquant, for users)
    "MsquantError",
    "MsquantInputError",
    "ConfigError",
    "ConfigIssue",
    "QuantizationError",
    "RegistryError",
    "TransformCheckError",
    "ResumeError",
]
