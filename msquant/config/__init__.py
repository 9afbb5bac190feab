"""Config files: safe YAML loading and the msModelSlim-v1-compatible spec schema."""

from msquant.config.spec import (
    Metadata,
    QuantConfig,
    RunnerType,
    SpecBody,
    build_config_model,
    config_json_schema,
    load_config,
    load_config_text,
    validate_config,
)
from msquant.config.yaml_loader import load_yaml_file, load_yaml_text

__all__ = [
    "Metadata",
    "QuantConfig",
    "RunnerType",
    "SpecBody",
    "build_config_model",
    "config_json_schema",
    "load_config",
    "load_config_text",
    "validate_config",
    "load_yaml_file",
    "load_yaml_text",
]
