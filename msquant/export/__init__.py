"""Writing outputs: atomic output directories, sharded safetensors, packing and model file copies."""

from msquant.export.files import copy_model_files, safe_file_stem
from msquant.export.hf_checkpoint import hf_weights_writer, unique_state_items, write_hf_config
from msquant.export.packing import pack_int4_pairs, pack_int32, packed_length
from msquant.export.shards import ShardedSafetensorsWriter
from msquant.export.staging import StagedOutputDir, check_save_path

__all__ = [
    "StagedOutputDir",
    "check_save_path",
    "ShardedSafetensorsWriter",
    "copy_model_files",
    "safe_file_stem",
    "hf_weights_writer",
    "unique_state_items",
    "write_hf_config",
    "pack_int32",
    "pack_int4_pairs",
    "packed_length",
]
