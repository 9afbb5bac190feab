"""``mindie_format_saver``: the Ascend export under the file names MindIE looks for.

Sample yaml::

    spec:
      save:
        - type: mindie_format_saver
          part_file_size: 4      # GiB per shard; shards only when the weights exceed it
          ext:
            json_append:         # optional keys merged into the description JSON
              model_quant_type: W8A16

Same tensors, description and copied files as ``ascendv1_saver``, named after the model's quant
type: ``quant_model_weight_w8a16.safetensors`` and ``quant_model_description_w8a16.json`` (one file
unless the weights exceed ``part_file_size``; then ``quant_model_weight_w8a16-0000i-of-0000N``
shards plus an index). msModelSlim writes unsuffixed names unless ``ext.json_append`` sets
``model_quant_type``, which left users renaming files by hand; here the suffix is always present
and ``json_append.model_quant_type`` only overrides the type the weights imply.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from msquant.plugin import ConfigIssue, ProcessorConfig, SaverConfig
from msquant.processors.formats.ascend.config import QUANT_TYPE_PRIORITY
from msquant.processors.formats.ascend.saver import AscendV1Saver

__all__ = ["MindIEFormatSaverConfig", "MindIEFormatSaver"]

WEIGHT_STEM = "quant_model_weight"
DESCRIPTION_STEM = "quant_model_description"


class MindIEFormatSaverConfig(SaverConfig):
    """Config of ``mindie_format_saver``."""

    type: Literal["mindie_format_saver"] = "mindie_format_saver"
    part_file_size: int = Field(
        4, ge=0, description="Shard size in GiB (shards only when exceeded); 0 = always one file."
    )
    ext: dict[str, Any] = Field(
        default_factory=dict,
        description="json_append: mapping merged into the description (msModelSlim).",
    )


class MindIEFormatSaver(AscendV1Saver):
    """Writes ``quant_model_weight_<type>.safetensors`` + ``quant_model_description_<type>.json``."""

    type_name = "mindie_format_saver"
    config_class = MindIEFormatSaverConfig
    weights_prefix = WEIGHT_STEM
    plain_when_single = True
    #: msModelSlim's mindie_format_saver refuses W8A8_MIX (pd_mix) and the C8 KV cache, naming
    #: ascendv1_saver; so does this one.
    activation_schemes = ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC")
    tensor_kinds = ()

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, MindIEFormatSaverConfig)
        unknown = sorted(set(config.ext) - {"json_append"})
        issues = [ConfigIssue(f"ext.{key}", "unknown key; valid: json_append") for key in unknown]
        append = config.ext.get("json_append", {})
        if not isinstance(append, dict):
            issues.append(ConfigIssue("ext.json_append", "must be a mapping of description keys"))
        elif "model_quant_type" in append and append["model_quant_type"] not in QUANT_TYPE_PRIORITY:
            issues.append(
                ConfigIssue(
                    "ext.json_append.model_quant_type",
                    f"unknown type {append['model_quant_type']!r}; valid: "
                    + ", ".join(QUANT_TYPE_PRIORITY),
                )
            )
        return issues

    @property
    def json_append(self) -> dict[str, Any]:
        """Keys merged into the description JSON."""
        return dict(self.config.ext.get("json_append", {}))

    def model_quant_type(self) -> str:
        return str(self.json_append.get("model_quant_type", super().model_quant_type()))

    def _suffix(self) -> str:
        return self.model_quant_type().lower()

    def close_writer(self) -> None:
        self.writer.close(prefix=f"{WEIGHT_STEM}_{self._suffix()}")

    def description_file(self) -> str:
        return f"{DESCRIPTION_STEM}_{self._suffix()}.json"

    def description_globals(self) -> dict[str, Any]:
        return {**super().description_globals(), **self.json_append}
