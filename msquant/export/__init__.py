"""Writing outputs: atomic output directories, sharded safetensors and model file copies."""

from msquant.export.files import copy_model_files
from msquant.export.shards import ShardedSafetensorsWriter
from msquant.export.staging import StagedOutputDir, check_save_path

__all__ = ["StagedOutputDir", "check_save_path", "ShardedSafetensorsWriter", "copy_model_files"]
