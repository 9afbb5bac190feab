"""Proofs that a transform keeps the model's function (docs/smoothing.md#self-checks): the
probe, data-flow pairs, layer fingerprints and snapshots, tolerances, and the hash a
transforming processor records for ``msquant verify``. Part of the plugin API (docs/api.md).
"""

from msquant.check.compare import (
    function_tolerance,
    max_relative_error,
)
from msquant.check.flow import (
    FlowPair,
    ov_channel_map,
    prove_flow,
)
from msquant.check.function import (
    FunctionCheck,
    layer_fingerprint,
)
from msquant.check.sharing import (
    shared_weight_problems,
)
from msquant.check.snapshot import (
    LayerSnapshot,
)
from msquant.check.upcast import (
    in_float32,
)
from msquant.contracts.transforms import (
    tensor_sha256,
)
from msquant.run.probe import (
    TransformProbe,
)

__all__ = [
    "TransformProbe",
    "FlowPair",
    "prove_flow",
    "ov_channel_map",
    "FunctionCheck",
    "layer_fingerprint",
    "LayerSnapshot",
    "shared_weight_problems",
    "function_tolerance",
    "max_relative_error",
    "in_float32",
    "tensor_sha256",
]
