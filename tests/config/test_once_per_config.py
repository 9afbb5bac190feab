"""``Processor.once_per_config``: the engine refuses every entry after the first of such a
processor, wherever the entries sit, with the processor's reason; other processors may repeat."""

from __future__ import annotations

from typing import Literal

import pytest

import msquant
import msquant.plugin
from msquant import ConfigError
from msquant.plugin import Processor, ProcessorConfig


class _OnceConfig(ProcessorConfig):
    type: Literal["once_only"] = "once_only"


class _Once(Processor):
    type_name = "once_only"
    config_class = _OnceConfig
    once_per_config = "it ships one file per export"


@pytest.fixture
def registry() -> msquant.plugin.ProcessorRegistry:
    registry = msquant.plugin.default_registry()
    registry.register(_Once)
    return registry


def test_second_entry_is_refused_with_the_reason(
    registry: msquant.plugin.ProcessorRegistry,
) -> None:
    config = {
        "spec": {
            "prior": [{"process": [{"type": "once_only"}]}],
            "process": [{"type": "once_only"}],
        }
    }
    with pytest.raises(ConfigError) as caught:
        msquant.validate_config(config, registry)
    assert [str(issue) for issue in caught.value.issues] == [
        "spec.process[0]: once_only is listed more than once (spec.prior[0].process[0] and "
        "spec.process[0]): it ships one file per export"
    ]


def test_processors_without_it_may_repeat(registry: msquant.plugin.ProcessorRegistry) -> None:
    weight = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    entry = {"type": "linear_quant", "qconfig": {"weight": weight}, "include": ["*q_proj"]}
    config = {"spec": {"process": [{"type": "once_only"}, entry, dict(entry, include=["*k_proj"])]}}
    validated = msquant.validate_config(config, registry)
    assert [e.type for e in validated.spec.process] == ["once_only", "linear_quant", "linear_quant"]
