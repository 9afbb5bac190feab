"""An Omni checkpoint (Qwen2.5-Omni, Qwen3-Omni): the model msquant loads is its thinker, as
msModelSlim's adapters load it; the log names the parts that are not exported."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tiny_models import build_tiny_vlm

from msquant.load.model_folder import load_causal_lm, load_model_config


@pytest.mark.parametrize(
    ("arch", "thinker", "others"),
    [
        ("qwen2_5_omni", "qwen2_5_omni_thinker", "talker, token2wav"),
        ("qwen3_omni_moe", "qwen3_omni_moe_thinker", "code2wav, talker"),
    ],
)
def test_the_thinker_is_the_model_msquant_loads(
    arch: str, thinker: str, others: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = build_tiny_vlm(tmp_path / "model", arch)
    with caplog.at_level(logging.INFO, logger="msquant.load.model_folder"):
        config = load_model_config(folder)
    assert config.model_type == thinker
    assert f"its thinker ({thinker})" in caplog.text
    assert f"other parts ({others}) are not written" in caplog.text
    model = load_causal_lm(folder)
    assert type(model).__name__.endswith("ThinkerForConditionalGeneration")
    assert {"audio_tower", "visual", "language_model"} <= {
        n for n, _ in model.model.named_children()
    }
