"""Bad inputs through ``msquant quant``: exit code 2, one clear message, no traceback, nothing written.

Every case runs twice: with a save path that does not exist (it must still not exist afterwards, and
no staging folder may be left beside it) and with a save path holding a previous export (it must be
byte-for-byte unchanged).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import msquant
import msquant.plugin
from msquant import (
    CalibrationDataError,
    ConfigError,
    DeviceError,
    ModelLoadError,
    MsquantInputError,
    OutputPathError,
    QuantizationError,
)

CALIB_TXT = Path(__file__).parents[1] / "data" / "calib.txt"

GOOD_YAML = """\
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {method: minmax}
  save:
    - type: ascendv1_saver
      part_file_size: 0
"""

GROUP48_YAML = """\
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {method: minmax, scope: per_group, ext: {group_size: 48}}
"""

GPTQ_YAML = """\
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {method: gptq, ext: {percdamp: 0.01, block_size: 128}}
"""

HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None

RunCli = Callable[..., Any]


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Relative path -> bytes of every file under ``path`` (None when it does not exist)."""
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def leftovers(directory: Path) -> list[str]:
    """Staging or backup folders a run may have left beside its save path."""
    return sorted(p.name for p in directory.iterdir() if ".msquant-" in p.name)


@pytest.fixture(scope="module")
def previous_export(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished export of the tiny model (copied before each test that uses it)."""
    out = tmp_path_factory.mktemp("prev") / "export"
    msquant.quantize(
        tiny_llama,
        out,
        msquant.load_config_text(GOOD_YAML, msquant.plugin.default_registry()),
        progress=False,
    )
    assert (out / "quant_model_description.json").is_file()
    return out


@pytest.fixture(scope="module")
def model_copies(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """Copies of the tiny model (one per name, shared in this module) that tests may damage."""
    root = tmp_path_factory.mktemp("copies")

    def copy(name: str) -> Path:
        target = root / name
        if not target.exists():
            shutil.copytree(tiny_llama, target)
        return target

    return copy


@dataclass
class Case:
    """One bad invocation: the arguments after ``quant``, and what stderr must say."""

    expect: list[str]
    model: Path | None = None  # default: the tiny model
    config: Path | str | None = None  # a path, or YAML text written to a file; default GOOD_YAML
    extra: list[str] = field(default_factory=list)
    save: Path | None = None  # default: the save path chosen by the test
    argparse: bool = False  # rejected by argparse (SystemExit 2, usage on stderr)
    no_config: bool = False


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def edit_config_json(model: Path, **changes: Any) -> Path:
    data = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (model / "config.json").write_text(json.dumps(data))
    return model


def nan_model(copy: Callable[[str], Path]) -> Path:
    model = copy("nan_weight")
    file = model / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.q_proj.weight"][3, 5] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return model


def pickle_only_model(tmp: Path, tiny: Path) -> Path:
    model = tmp / "pickled"
    model.mkdir()
    shutil.copy(tiny / "config.json", model)
    shutil.copy(tiny / "tokenizer.json", model)
    torch.save({"w": torch.zeros(2)}, model / "pytorch_model.bin")
    return model


def no_config_json_model(tmp: Path, tiny: Path) -> Path:
    model = tmp / "no_config"
    model.mkdir()
    shutil.copy(tiny / "model.safetensors", model)
    return model


# Each builder gets (scratch dir, tiny model, model-copy factory) and returns a Case.
CASES: dict[str, Callable[[Path, Path, Callable[[str], Path]], Case]] = {
    # --- config ---
    "yaml_syntax": lambda t, m, c: Case(
        ["not valid YAML", "line 3"], config="spec:\n  process: [\n"
    ),
    "yaml_duplicate_key": lambda t, m, c: Case(
        ["duplicate key 'spec'"], config="spec: {}\nspec: {}\n"
    ),
    "unknown_key": lambda t, m, c: Case(
        ["spec.process[0].qconfig.weight.bogus: unknown key", "symmetric"],
        config=GOOD_YAML.replace("{method: minmax}", "{method: minmax, bogus: 1}"),
    ),
    "wrong_type": lambda t, m, c: Case(
        ["spec.process[0].qconfig.weight.symmetric", "boolean"],
        config=GOOD_YAML.replace("{method: minmax}", "{method: minmax, symmetric: maybe}"),
    ),
    "negative_part_file_size": lambda t, m, c: Case(
        ["spec.save[0].part_file_size", "greater than or equal to 0"],
        config=GOOD_YAML.replace("part_file_size: 0", "part_file_size: -1"),
    ),
    "unknown_processor_type": lambda t, m, c: Case(
        ["unknown processor type 'autoround_quant'", "linear_quant"],
        config="spec:\n  process:\n    - type: autoround_quant\n",
    ),
    "unknown_method": lambda t, m, c: Case(
        ["unknown method 'awq'", "minmax"],
        config=GOOD_YAML.replace("method: minmax", "method: awq"),
    ),
    "per_tensor_not_implemented": lambda t, m, c: Case(
        ["(dtype int8, scope per_tensor) is not implemented"],
        config=GOOD_YAML.replace("{method: minmax}", "{method: minmax, scope: per_tensor}"),
    ),
    "config_not_mapping": lambda t, m, c: Case(["must be a mapping"], config="- linear_quant\n"),
    "config_not_utf8": lambda t, m, c: Case(
        ["cannot read config file"], config=write(t / "latin1.yaml", b"spec: {}\n# \xe9\n")
    ),
    "missing_config_file": lambda t, m, c: Case(
        [str(t / "missing.yaml"), "does not exist"], config=t / "missing.yaml"
    ),
    "config_is_directory": lambda t, m, c: Case(["is a directory", "pass a .yaml file"], config=t),
    "no_config_and_no_quant_type": lambda t, m, c: Case(
        ["--config_path", "--quant_type"], no_config=True
    ),
    "unknown_quant_type": lambda t, m, c: Case(
        ["unknown quant_type 'w3a5'", "w4a8, w8a16, w8a8"],
        no_config=True,
        extra=["--quant_type", "w3a5"],
    ),
    "unimplemented_quant_type": lambda t, m, c: Case(
        ["quant_type 'w4a4' is one of msModelSlim's", "implemented: w4a8, w8a16, w8a8"],
        no_config=True,
        extra=["--quant_type", "w4a4"],
    ),
    "prior_stage_unknown_processor": lambda t, m, c: Case(
        ["spec.prior[0].process[0].type", "unknown processor type 'flatquant'"],
        config=GPTQ_YAML + "  prior:\n    - process: [{type: flatquant}]\n",
    ),
    # --- model ---
    "missing_model_dir": lambda t, m, c: Case(
        ["model path", "does not exist"], model=t / "no_model"
    ),
    "model_path_is_file": lambda t, m, c: Case(
        ["is not a directory"], model=write(t / "model.safetensors", b"x")
    ),
    "model_without_config_json": lambda t, m, c: Case(
        ["has no config.json"], model=no_config_json_model(t, m)
    ),
    "model_with_only_pickles": lambda t, m, c: Case(
        ["pytorch_model.bin", "does not load pickles", "safetensors"], model=pickle_only_model(t, m)
    ),
    "corrupt_safetensors": lambda t, m, c: Case(
        ["model.safetensors", "not a readable safetensors file"],
        model=write(
            c("corrupt") / "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{junk"
        ).parent,
    ),
    "config_json_not_json": lambda t, m, c: Case(
        ["cannot read the model config"], model=write(c("bad_json") / "config.json", "{").parent
    ),
    "unknown_model_type": lambda t, m, c: Case(
        ["cannot read the model config", "frobnicator"],
        model=edit_config_json(c("unknown_arch"), model_type="frobnicator"),
    ),
    "group_size_does_not_divide": lambda t, m, c: Case(
        [
            "model.layers.0.self_attn.q_proj: group_size 48 does not divide in_features 64",
            "valid group sizes: 1, 2, 4, 8, 16, 32, 64",
            "model.layers.1.mlp.down_proj: group_size 48 does not divide in_features 128",
            "1, 2, 4, 8, 16, 32, 64, 128",
        ],
        model=c("group48"),
        config=GROUP48_YAML,
    ),
    "nan_weight": lambda t, m, c: Case(
        ["model.layers.0.self_attn.q_proj", "NaN"], model=nan_model(c)
    ),
    # --- calibration ---
    "missing_calib_file": lambda t, m, c: Case(
        ["calibration file", "missing.jsonl", "does not exist"],
        extra=["--calib_path", t / "missing.jsonl"],
    ),
    "calib_is_directory": lambda t, m, c: Case(
        ["calibration file", "is a directory"], extra=["--calib_path", t]
    ),
    "calib_unreadable": lambda t, m, c: Case(
        ["cannot read calibration file", "utf-8"],
        extra=["--calib_path", write(t / "binary.txt", b"\xff\xfe\x00\x81 text")],
    ),
    "calib_unsupported_extension": lambda t, m, c: Case(
        ["unsupported extension '.csv'", ".jsonl, .json, .txt"],
        extra=["--calib_path", write(t / "calib.csv", "text\nhello\n")],
    ),
    "calib_malformed_jsonl_line": lambda t, m, c: Case(
        ["calib.jsonl line 3: not valid JSON"],
        extra=[
            "--calib_path",
            write(t / "calib.jsonl", '{"text": "a"}\n\n{"text": oops}\n{"text": "b"}\n'),
        ],
    ),
    "calib_jsonl_without_text": lambda t, m, c: Case(
        ["line 2", "inputs_pretokenized"],
        extra=["--calib_path", write(t / "calib.jsonl", '{"text": "a"}\n{"prompt": "b"}\n')],
    ),
    "calib_empty": lambda t, m, c: Case(
        ["contains no text samples"], extra=["--calib_path", write(t / "empty.txt", "\n\n  \n")]
    ),
    "calib_json_not_list": lambda t, m, c: Case(
        ["must hold a list of strings"],
        extra=["--calib_path", write(t / "calib.json", '{"text": "a dict, not a list"}')],
    ),
    "calib_json_invalid": lambda t, m, c: Case(
        ["not valid JSON"], extra=["--calib_path", write(t / "calib.json", '["a", ')]
    ),
    "max_calib_tokens_zero": lambda t, m, c: Case(
        ["--max_calib_tokens", "positive integer"], extra=["--max_calib_tokens", "0"], argparse=True
    ),
    # --- devices ---
    "device_unknown": lambda t, m, c: Case(
        ["unknown device type 'tpu'", "cpu, cuda"], extra=["--device", "tpu"]
    ),
    "device_malformed": lambda t, m, c: Case(
        ["malformed device 'cuda:x'"], extra=["--device", "cuda:x"]
    ),
    "device_repeated_index": lambda t, m, c: Case(
        ["repeats a device index"], extra=["--device", "npu:1,1"]
    ),
    "device_multi_npu": lambda t, m, c: Case(
        ["device npu requested but torch_npu is not installed"], extra=["--device", "npu:0,1"]
    ),
    "nproc_on_cuda": lambda t, m, c: Case(
        ["--nproc 2 on cuda: name the devices instead"], extra=["--device", "cuda", "--nproc", "2"]
    ),
    "device_cpu_index": lambda t, m, c: Case(["CPU takes no index"], extra=["--device", "cpu:1"]),
    # --- save path ---
    "save_path_is_file": lambda t, m, c: Case(
        ["exists and is a file"], save=write(t / "save_here.txt", "precious\n")
    ),
    "save_path_unrelated_dir": lambda t, m, c: Case(
        ["non-empty directory", "does not hold a previous export"],
        save=write(t / "my_docs" / "notes.md", "# keep me\n").parent,
    ),
    "save_path_below_a_file": lambda t, m, c: Case(
        ["is a file"], save=write(t / "plain_file", "x") / "sub" / "out"
    ),
    # --- argparse ---
    "trust_remote_code_maybe": lambda t, m, c: Case(
        ["--trust_remote_code", "expected True or False", "'maybe'"],
        extra=["--trust_remote_code", "maybe"],
        argparse=True,
    ),
    "config_and_quant_type": lambda t, m, c: Case(
        ["not allowed with argument"], extra=["--quant_type", "w8a16"], argparse=True
    ),
}

DEVICE_CASES: dict[str, Callable[[Path, Path, Callable[[str], Path]], Case]] = {
    "device_cuda_absent": lambda t, m, c: Case(
        ["no cuda device is available"], extra=["--device", "cuda"]
    ),
    "device_cuda_index_out_of_range": lambda t, m, c: Case(
        ["cuda:4096 requested but only"], extra=["--device", "cuda:4096"]
    ),
    "device_npu_without_torch_npu": lambda t, m, c: Case(
        ["torch_npu", "not installed"], extra=["--device", "npu"]
    ),
}


def invoke(
    case: Case,
    run_cli: RunCli,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    save: Path,
    tiny: Path,
) -> None:
    """Run the case's command line and check: exit 2, the expected message, no traceback."""
    args = _args(case, tmp_path, save, tiny)
    if case.argparse:
        with pytest.raises(SystemExit) as info:
            run_cli(*args)
        code, err = info.value.code, capsys.readouterr().err
        assert "usage: msquant" in err
    else:
        result = run_cli(*args)
        code, err = result.code, result.err
        assert "msquant: error:" in err
    assert code == 2, err
    assert "Traceback" not in err
    for needle in case.expect:
        assert needle in err, f"{needle!r} not in stderr:\n{err}"


ALL_CASES = {**CASES, **DEVICE_CASES}


def skip_unavailable(name: str) -> None:
    if name == "device_cuda_absent" and HAS_CUDA:
        pytest.skip("CUDA is present here")
    if name == "device_cuda_index_out_of_range" and not HAS_CUDA:
        pytest.skip("needs CUDA")
    if name == "device_npu_without_torch_npu" and HAS_TORCH_NPU:
        pytest.skip("torch_npu is installed here")


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_bad_input_new_save_path(
    name: str,
    tmp_path: Path,
    tiny_llama: Path,
    model_copies: Callable[[str], Path],
    run_cli: RunCli,
    capsys: pytest.CaptureFixture[str],
) -> None:
    skip_unavailable(name)
    case = ALL_CASES[name](tmp_path, tiny_llama, model_copies)
    save = case.save or tmp_path / "out" / "export"
    before = snapshot(save)
    model_before = snapshot(case.model or tiny_llama)
    invoke(case, run_cli, capsys, tmp_path, save, tiny_llama)
    assert snapshot(save) == before, "the save path was modified"
    if before is None:
        assert not save.exists()
    if save.parent.exists():
        assert leftovers(save.parent) == []
    assert snapshot(case.model or tiny_llama) == model_before, "the model directory was modified"


@pytest.mark.parametrize(
    "name",
    sorted(n for n in ALL_CASES if not n.startswith("save_path")),
)
def test_bad_input_keeps_previous_export(
    name: str,
    tmp_path: Path,
    tiny_llama: Path,
    model_copies: Callable[[str], Path],
    previous_export: Path,
    run_cli: RunCli,
    capsys: pytest.CaptureFixture[str],
) -> None:
    skip_unavailable(name)
    case = ALL_CASES[name](tmp_path, tiny_llama, model_copies)
    save = tmp_path / "exports" / "model-w8a16"
    shutil.copytree(previous_export, save)
    before = snapshot(save)
    assert before and "quant_model_description.json" in before
    # --overwrite: the run must reach the bad input (a previous export alone is refused first)
    case = dataclasses.replace(case, extra=[*case.extra, "--overwrite"])
    invoke(case, run_cli, capsys, tmp_path, save, tiny_llama)
    assert snapshot(save) == before
    assert leftovers(save.parent) == []


def _args(case: Case, tmp_path: Path, save: Path, tiny: Path) -> list[str | Path]:
    config = case.config if case.config is not None else GOOD_YAML
    if isinstance(config, str):
        config = write(tmp_path / "config.yaml", config)
    args: list[str | Path] = ["quant", "--model_path", case.model or tiny, "--save_path", save]
    if not case.no_config:
        args += ["--config_path", config]
    return [*args, "--no_progress", *case.extra]


def test_cases_are_many_and_distinct(
    tmp_path: Path, tiny_llama: Path, model_copies: Callable[[str], Path]
) -> None:
    expected = []
    for name, build in ALL_CASES.items():
        scratch = tmp_path / name
        scratch.mkdir()
        expected.append(tuple(build(scratch, tiny_llama, model_copies).expect))
    assert len(CASES) >= 22
    assert len(set(expected)) == len(expected), "two cases expect the same message"


def test_good_invocation_succeeds(tmp_path: Path, tiny_llama: Path, run_cli: RunCli) -> None:
    """The control for every case above: the same command line with good inputs works."""
    save = tmp_path / "out" / "export"
    config = write(tmp_path / "config.yaml", GOOD_YAML)
    result = run_cli(
        "quant",
        "--model_path",
        tiny_llama,
        "--save_path",
        save,
        "--config_path",
        config,
        "--calib_path",
        CALIB_TXT,
        "--no_progress",
    )
    assert result.code == 0, result.err
    assert (save / "quant_model_description.json").is_file()
    assert (save / "quant_model_weights.safetensors").is_file()
    assert leftovers(save.parent) == []


def test_previous_export_is_replaced_on_success(
    tmp_path: Path, tiny_llama: Path, previous_export: Path, run_cli: RunCli
) -> None:
    """The counterpart of the 'unchanged' checks: a good run does replace a previous export,
    files of it the new one does not write included."""
    save = tmp_path / "export"
    shutil.copytree(previous_export, save)
    stale = "quant_model_weights.safetensors"  # the preset shards as quant_model_weights-0000*
    result = run_cli(
        "quant",
        "--model_path",
        tiny_llama,
        "--save_path",
        save,
        "--quant_type",
        "w8a16",
        "--no_progress",
        "--overwrite",
    )
    assert result.code == 0, result.err
    assert not (save / stale).exists()
    assert (save / "quant_model_description.json").is_file()


# --- the CLI's mapping of other failures ---------------------------------------------------------


def test_internal_error_exits_1(
    tmp_path: Path, tiny_llama: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("simulated engine bug")

    monkeypatch.setattr("msquant.cli.quant.quantize", boom)
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "o", "--quant_type", "w8a16"
    )
    assert result.code == 1
    assert "internal error" in result.err and "simulated engine bug" in result.err


def test_interrupt_exits_130(
    tmp_path: Path, tiny_llama: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("msquant.cli.quant.quantize", interrupted)
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "o", "--quant_type", "w8a16"
    )
    assert result.code == 130
    assert "interrupted" in result.err and "Traceback" not in result.err


def test_a_lost_peer_is_one_line_with_the_way_on(
    tmp_path: Path, tiny_llama: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dp_layer_wise process whose group lost a member says so and how to continue."""
    from msquant.contracts.distributed import PeerLostError

    def peer_lost(*args: Any, **kwargs: Any) -> None:
        raise PeerLostError("dp_layer_wise: all_reduce failed, another process of the group ended")

    monkeypatch.setattr("msquant.cli.quant.quantize", peer_lost)
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "o", "--quant_type", "w8a16"
    )
    assert result.code == 1
    assert "Traceback" not in result.err and "internal error" not in result.err
    assert "msquant: error: dp_layer_wise: all_reduce failed" in result.err
    assert "rerun the same command with --resume" in result.err


@pytest.mark.parametrize(
    "argv",
    [
        ["quant", "--save_path", "out", "--quant_type", "w8a16"],  # no --model_path
        ["quant", "--model_path", "m", "--quant_type", "w8a16"],  # no --save_path
        ["frobnicate"],
        [],
        ["quant", "--model_path", "m", "--save_path", "o", "--max_calib_tokens", "many"],
        ["--log_level", "LOUD", "schema"],
    ],
    ids=[
        "no_model_path",
        "no_save_path",
        "unknown_command",
        "no_command",
        "max_tokens_text",
        "log_level",
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], run_cli: RunCli, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run_cli(*argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: msquant" in err and "error:" in err and "Traceback" not in err


# --- the Python API raises the typed exceptions --------------------------------------------------


API_CASES: list[tuple[str, type[MsquantInputError], str]] = [
    ("config", ConfigError, "unknown key"),
    ("model", ModelLoadError, "does not exist"),
    ("pickles", ModelLoadError, "does not load pickles"),
    ("calibration", CalibrationDataError, "line 1"),
    ("device", DeviceError, "unknown device type"),
    ("save_path", OutputPathError, "exists and is a file"),
    ("group_size", QuantizationError, "14 problems"),
    ("nan", ModelLoadError, "NaN"),
    ("multi_device", DeviceError, "one process drives one device"),
]


@pytest.mark.parametrize(("what", "exc_type", "needle"), API_CASES, ids=[c[0] for c in API_CASES])
def test_api_raises_typed_exceptions(
    what: str,
    exc_type: type[MsquantInputError],
    needle: str,
    tmp_path: Path,
    tiny_llama: Path,
    model_copies: Callable[[str], Path],
) -> None:
    registry = msquant.plugin.default_registry()
    good = msquant.load_config_text(GOOD_YAML, registry)
    kwargs: dict[str, Any] = {
        "model_path": tiny_llama,
        "save_path": tmp_path / "out",
        "config": good,
    }
    if what == "config":
        kwargs["config"] = {
            "spec": {"process": [{"type": "linear_quant", "bogus": 1, "qconfig": {}}]}
        }
    elif what == "model":
        kwargs["model_path"] = tmp_path / "nowhere"
    elif what == "pickles":
        kwargs["model_path"] = pickle_only_model(tmp_path, tiny_llama)
    elif what == "calibration":
        kwargs["calib_path"] = write(tmp_path / "c.jsonl", "not json\n")
    elif what == "device":
        kwargs["device"] = "tpu"
    elif what == "save_path":
        kwargs["save_path"] = write(tmp_path / "file", "x")
    elif what == "group_size":
        kwargs["config"] = write(tmp_path / "g.yaml", GROUP48_YAML)
    elif what == "nan":
        kwargs["model_path"] = nan_model(model_copies)
    elif what == "multi_device":
        kwargs["device"] = "npu:0,1"
    save_before = snapshot(Path(kwargs["save_path"]))
    with pytest.raises(exc_type) as info:
        msquant.quantize(**kwargs, progress=False)
    assert type(info.value) is exc_type
    assert isinstance(info.value, MsquantInputError)
    assert needle in str(info.value)
    assert snapshot(Path(kwargs["save_path"])) == save_before
    assert leftovers(tmp_path) == []


def test_api_config_error_carries_issues(tmp_path: Path, tiny_llama: Path) -> None:
    config = {
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"weight": {"method": "minmax", "x": 1}}}
            ]
        }
    }
    with pytest.raises(ConfigError) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False)
    assert [i.path for i in info.value.issues] == ["spec.process[0].qconfig.weight.x"]


def test_api_checks_config_before_device_and_paths(tmp_path: Path) -> None:
    """Cheapest first: a bad config is reported even when device, model and save path are bad too."""
    with pytest.raises(ConfigError):
        msquant.quantize(
            tmp_path / "no_model", write(tmp_path / "f", "x"), {"spec": {"bogus": 1}}, device="tpu"
        )
    with pytest.raises(DeviceError):
        msquant.quantize(
            tmp_path / "no_model", write(tmp_path / "f", "x"), {"spec": {}}, device="tpu"
        )
    with pytest.raises(OutputPathError):
        msquant.quantize(tmp_path / "no_model", tmp_path / "f", {"spec": {}})
    with pytest.raises(ModelLoadError):
        msquant.quantize(tmp_path / "no_model", tmp_path / "out", {"spec": {}})
    assert not (tmp_path / "out").exists()
