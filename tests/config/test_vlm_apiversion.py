"""``apiversion: multimodal_vlm_modelslim_v1``: msModelSlim's vision-language schema (``spec``
plus ``default_text``), with unknown keys still refused at their exact path."""

from __future__ import annotations

import pytest

import msquant
from msquant.plugin import ProcessorRegistry, default_registry

VLM = """\
apiversion: multimodal_vlm_modelslim_v1
metadata: {config_id: qwen3_5_dense_w8a8, score: 90, verified_model_types: [Qwen3.5-27B]}
spec:
  process:
    - type: linear_quant
      qconfig:
        act: {scope: per_token, dtype: int8, symmetric: true, method: minmax}
        weight: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}
      include: ["*self_attn*", "*mlp*"]
      exclude: ["*visual*"]
  save:
    - {type: ascendv1_saver, part_file_size: 4}
  dataset: calibImages
"""


@pytest.fixture(scope="module")
def registry() -> ProcessorRegistry:
    return default_registry()


def issues(text: str, registry: ProcessorRegistry) -> list[tuple[str, str]]:
    with pytest.raises(msquant.ConfigError) as err:
        msquant.load_config_text(text, registry)
    return [(issue.path, issue.message) for issue in err.value.issues]


def test_vlm_config_validates_with_default_text(registry: ProcessorRegistry) -> None:
    config = msquant.load_config_text(VLM + '  default_text: "Describe it."\n', registry)
    assert config.apiversion == "multimodal_vlm_modelslim_v1"
    assert config.spec.default_text == "Describe it."  # type: ignore[attr-defined]
    assert [entry.type for entry in config.spec.process] == ["linear_quant"]
    default = msquant.load_config_text(VLM, registry)  # msModelSlim's default prompt
    assert default.spec.default_text == "Describe this image in detail."  # type: ignore[attr-defined]


def test_unknown_key_in_vlm_spec_is_refused_at_its_path(registry: ProcessorRegistry) -> None:
    found = issues(VLM + "  default_txt: x\n", registry)
    assert found == [
        (
            "spec.default_txt",
            "unknown key; valid keys here: runner, prior, process, save, dataset, default_text",
        )
    ]
    nested = issues(VLM.replace("part_file_size: 4", "part_file_size: 4, bogus: 1"), registry)
    assert [path for path, _ in nested] == ["spec.save[0].bogus"]


def test_blank_default_text_is_refused(registry: ProcessorRegistry) -> None:
    found = issues(VLM + '  default_text: "  "\n', registry)
    assert found[0][0] == "spec.default_text"
    assert "must not be empty" in found[0][1]


def test_default_text_belongs_to_the_vlm_apiversion(registry: ProcessorRegistry) -> None:
    """msModelSlim's modelslim_v1 parser refuses ``spec.default_text`` too."""
    text = VLM.replace("multimodal_vlm_modelslim_v1", "modelslim_v1") + "  default_text: x\n"
    assert [path for path, _ in issues(text, registry)] == ["spec.default_text"]


def test_unknown_apiversion_names_both(registry: ProcessorRegistry) -> None:
    found = issues(
        VLM.replace("multimodal_vlm_modelslim_v1", "multimodal_sd_modelslim_v1"), registry
    )
    assert found[0][0] == "apiversion"
    assert "'modelslim_v1'" in found[0][1] and "'multimodal_vlm_modelslim_v1'" in found[0][1]
