"""Writers for a saver: the staged output folder, sharded safetensors, the Hugging Face
config and model files, and the int32 / int4 packing of codes. Part of the plugin API
(docs/api.md).
"""

from msquant.export import (
    ShardedSafetensorsWriter,
    StagedOutputDir,
    copy_model_files,
    hf_weights_writer,
    pack_int4_pairs,
    pack_int32,
    packed_length,
    safe_file_stem,
    unique_state_items,
    write_hf_config,
)
from msquant.version import __version__

__all__ = [
    "StagedOutputDir",
    "ShardedSafetensorsWriter",
    "copy_model_files",
    "safe_file_stem",
    "hf_weights_writer",
    "unique_state_items",
    "write_hf_config",
    "pack_int32",
    "pack_int4_pairs",
    "packed_length",
    "__version__",
]
