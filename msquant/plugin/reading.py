"""Helpers of a format's reader (``ExportReader``): detecting a format, opening an export's
tensors, reading its JSON files, and unpacking the packed code streams. Part of the plugin API
(docs/api.md).
"""

from msquant.verify.base import (
    module_of,
    read_json,
    ties_word_embeddings,
)
from msquant.verify.detect import (
    detect_format,
    hf_export_format,
    hf_quant_method,
    read_model_config,
)
from msquant.verify.layer import (
    trivial_g_idx,
)
from msquant.verify.tensors import (
    TensorStore,
    open_weights,
    weight_files_present,
)
from msquant.verify.unpack import (
    unpack_int4_pairs,
    unpack_int32_stream,
    words_needed,
)

__all__ = [
    "detect_format",
    "TensorStore",
    "trivial_g_idx",
    "read_json",
    "module_of",
    "ties_word_embeddings",
    "read_model_config",
    "hf_quant_method",
    "hf_export_format",
    "open_weights",
    "weight_files_present",
    "unpack_int32_stream",
    "unpack_int4_pairs",
    "words_needed",
]
