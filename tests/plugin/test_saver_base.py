"""The Saver base's typed checkpoint state: what a saver records survives a checkpoint's JSON
unchanged, is stored deterministically, and a state of another layout is refused clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from msquant.plugin import SAVER_STATE_FORMAT, SaverConfig, SaverState
from msquant.processors.formats.ascend.saver import (
    AscendSaverState,
    AscendV1Saver,
    AscendV1SaverConfig,
)
from msquant.processors.formats.autoawq.saver import AutoAWQSaverConfig
from msquant.processors.formats.compressed_tensors.config import WeightScheme
from msquant.processors.formats.compressed_tensors.saver import (
    CompressedTensorsSaverConfig,
    CompressedTensorsSaverState,
)
from msquant.processors.formats.gptq.config import RuleUnit
from msquant.processors.formats.gptq.saver import GPTQSaverConfig, GPTQSaverState
from msquant.processors.formats.gptq.scheme import GPTQScheme


def _through_json(state: SaverState) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(state.model_dump(mode="json")))
    return data


UNIT = RuleUnit(
    "model.layers.0",
    "self_attn\\.(?:q_proj|k_proj|v_proj|qkv_proj)",
    GPTQScheme(4, 32, True),
    "model.layers.0.self_attn.qkv_proj",
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"),
    192,
    64,
)
FLOAT_UNIT = RuleUnit("model.layers.0", "mlp\\.down_proj", None, "d", ("d",), 64, 128)


@pytest.mark.parametrize(
    "state",
    [
        GPTQSaverState(
            written={"b.qweight", "a.qweight"},
            quantized={"b", "a"},
            head="lm_head",
            units=[UNIT, FLOAT_UNIT],
            methods={"minmax", "gptq"},
            head_unit=UNIT,
            checkpoint_format="gptq_v2",
        ),
        CompressedTensorsSaverState(
            schemes={"a": WeightScheme(4, False, 32, "weight"), "b": WeightScheme(8, True, None)},
        ),
        AscendSaverState(types={"z.weight": "W4A16", "a.bias": "FLOAT"}, group_sizes={128, 32}),
    ],
    ids=["gptq", "compressed_tensors", "ascend"],
)
def test_saver_states_survive_a_checkpoint(state: SaverState) -> None:
    data = _through_json(state)
    assert type(state).model_validate(data) == state
    assert data["written"] == sorted(data["written"]) and data["quantized"] == sorted(
        data["quantized"]
    )


def test_checkpointed_sets_are_sorted_and_dicts_keep_their_order() -> None:
    """Deterministic checkpoint files; the Ascend description is written in the types' order."""
    data = _through_json(
        AscendSaverState(written={"c", "a", "b"}, types={"z.weight": "W8A16", "a.weight": "FLOAT"})
    )
    assert data["written"] == ["a", "b", "c"]
    assert list(data["types"]) == ["z.weight", "a.weight"]
    restored = GPTQSaverState.model_validate(_through_json(GPTQSaverState(units=[UNIT])))
    assert restored.units[0].members == UNIT.members and isinstance(
        restored.units[0].members, tuple
    )
    assert restored.units[0].scheme == GPTQScheme(4, 32, True)


def test_a_state_of_the_older_layout_is_refused(tmp_path: Path) -> None:
    """A checkpoint written before the Saver base (no ``format``, untyped keys) is refused with
    a message the run turns into "--resume: <saver> cannot take up its checkpoint (...)"."""
    saver = AscendV1Saver(AscendV1SaverConfig())
    old = {"writer": {}, "types": {"a.weight": "W8A16"}, "group_sizes": [], "head": None}
    with pytest.raises(
        ValueError, match="saver state has layout None, this msquant reads layout 1"
    ):
        saver.restore(None, old)  # type: ignore[arg-type]
    assert SAVER_STATE_FORMAT == 1


def test_a_state_with_unknown_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="extra_key"):
        GPTQSaverState.model_validate({"extra_key": 1})


@pytest.mark.parametrize(
    "config_class",
    [GPTQSaverConfig, CompressedTensorsSaverConfig, AutoAWQSaverConfig],
    ids=["gptq", "compressed_tensors", "autoawq"],
)
def test_savers_take_part_file_size_from_the_base(config_class: type[SaverConfig]) -> None:
    """One definition of the shard size (``msquant.plugin.SaverConfig``), not one copy per saver."""
    assert "part_file_size" not in config_class.__annotations__
    assert config_class().part_file_size == 4 and config_class(part_file_size=0).part_file_size == 0
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        config_class(part_file_size=-1)
