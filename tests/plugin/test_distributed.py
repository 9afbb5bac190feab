"""dp_layer_wise: several processes (gloo on the CPU) quantize one model together, and the export
equals the single-process one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import CALIB_TXT, CliResult

from msquant import MsquantInputError
from msquant.cli.quant_options import process_devices
from msquant.plugin import SINGLE
from msquant.plugin.model import balanced_owners
from msquant.plugin.numerics import HessianAccumulator

SAVE = [{"type": "ascendv1_saver"}, {"type": "gptq_saver"}]


def _config(tmp_path: Path, method: str = "gptq") -> Path:
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": "dp_layer_wise",
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {
                        "weight": {
                            "scope": "per_group",
                            "dtype": "int4",
                            "symmetric": True,
                            "method": method,
                            "ext": {"group_size": 32},
                        }
                    },
                    "lm_head": True,
                }
            ],
            "save": SAVE,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _quant_args(model: Path, save: Path, config: Path) -> list[str | Path]:
    return [
        "quant", "--model_path", model, "--save_path", save, "--config_path", config,
        "--calib_path", CALIB_TXT, "--max_calib_tokens", "24", "--no_progress",
    ]  # fmt: skip


def _export(root: Path) -> dict[str, bytes]:
    """The export's files but the run report and the config copies."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "quant_report.json" and not p.name.endswith(".yaml")
    }


def _modules(root: Path) -> list[dict[str, Any]]:
    """The report's module entries without times; floats compared to 1e-6 (the Hessian sums, and
    the output errors computed from them, are added up in another order)."""
    report = json.loads((root / "quant_report.json").read_text())
    return [
        {
            k: pytest.approx(v, rel=1e-6) if isinstance(v, float) else v
            for k, v in module.items()
            if not k.endswith("seconds")
        }
        for module in report["modules"]
    ]


@pytest.fixture(scope="module")
def untied_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", num_layers=3)


@pytest.fixture(scope="module")
def single_run(untied_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from msquant.cli import main

    work = tmp_path_factory.mktemp("single")
    config = _config(work)
    assert main([str(a) for a in _quant_args(untied_llama, work / "out", config)]) == 0
    return config, work / "out"


def test_two_spawned_processes_give_the_single_process_export(
    untied_llama: Path,
    single_run: tuple[Path, Path],
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    config, single = single_run
    result = run_cli(*_quant_args(untied_llama, tmp_path / "out", config), "--nproc", "2")
    assert result.code == 0, result.err
    assert _export(tmp_path / "out") == _export(single)
    assert _modules(tmp_path / "out") == _modules(single)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no scratch left behind


def test_torchrun_gives_the_single_process_export(
    untied_llama: Path, single_run: tuple[Path, Path], tmp_path: Path
) -> None:
    config, single = single_run
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--standalone", "-m", "msquant",
        *map(str, _quant_args(untied_llama, tmp_path / "out", config)),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "process 1 of 2" in done.stderr
    assert _export(tmp_path / "out") == _export(single)
    assert _modules(tmp_path / "out") == _modules(single)


def test_too_few_batches_for_the_processes_is_a_clear_error(
    untied_llama: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from msquant.cli import main

    calib = tmp_path / "one.txt"
    calib.write_text("a single calibration sample of a few words\n")
    args = _quant_args(untied_llama, tmp_path / "out", _config(tmp_path))
    args[args.index(CALIB_TXT)] = calib
    code = main([str(a) for a in (*args, "--nproc", "2")])
    err = capfd.readouterr().err  # the processes' own stderr
    assert code == 2
    assert err.count("dp_layer_wise: 2 processes but only 1 calibration batch(es)") == 1
    assert not (tmp_path / "out").exists()


def testprocess_devices() -> None:
    assert process_devices("cpu", None) == ["cpu"]
    assert process_devices("cpu", 3) == ["cpu"] * 3
    assert process_devices("npu:0,1,2", None) == ["npu:0", "npu:1", "npu:2"]
    assert process_devices("cuda:1,0", 2) == ["cuda:1", "cuda:0"]
    with pytest.raises(MsquantInputError, match="--nproc 3 does not match the 2 devices"):
        process_devices("npu:0,1", 3)
    with pytest.raises(MsquantInputError, match="name the devices instead, e.g. --device cuda:0,1"):
        process_devices("cuda", 2)


def test_process_devices_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert process_devices("npu:1", None) == ["npu:1"]
    with pytest.raises(MsquantInputError, match="under torchrun each process takes one device"):
        process_devices("npu:0,1", None)


def test_balanced_owners_spread_the_largest_first() -> None:
    assert balanced_owners([9.0, 1.0, 1.0, 8.0, 2.0], 2) == [0, 0, 0, 1, 1]  # loads 11 and 10
    assert balanced_owners([5.0, 5.0, 5.0], 1) == [0, 0, 0]
    assert balanced_owners([], 4) == []
    owners = balanced_owners([3.0] * 8, 4)
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_hessian_all_reduce_sums_the_peers() -> None:
    """Two accumulators reduced together hold the Hessian of all their rows (float64 reference)."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 48, generator=generator) for n in (40, 7, 300, 5)]
    peers = [HessianAccumulator(48, name="peer0"), HessianAccumulator(48, name="peer1")]
    for index, block in enumerate(rows):
        peers[index % 2].add_batch(block)
    empty = HessianAccumulator(48, name="empty")
    totals: list[torch.Tensor] = []

    def reduce_sum(tensor: torch.Tensor) -> None:  # stands in for all_reduce over the peers
        totals.append(tensor)

    for accumulator in (*peers, empty):
        accumulator.all_reduce(reduce_sum)
    sum_matrix = totals[0] + totals[2] + totals[4]
    count = totals[1] + totals[3] + totals[5]
    x = torch.cat(rows).double()
    torch.testing.assert_close(sum_matrix.double(), x.T @ x, rtol=1e-5, atol=1e-4)
    assert int(count.item()) == sum(r.shape[0] for r in rows)
    assert torch.equal(empty.raw_sum()[0] if empty.n else totals[4], torch.zeros(48, 48))


def test_a_single_process_exchanges_nothing() -> None:
    tensor = torch.ones(3)
    SINGLE.all_reduce_sum(tensor)
    assert torch.equal(tensor, torch.ones(3))
    assert SINGLE.broadcast_object({"a": 1}, 0) == {"a": 1}
    assert SINGLE.all_gather_object({"a": 1}) == [{"a": 1}]
    assert SINGLE.shard([1, 2, 3]) == [1, 2, 3] and SINGLE.is_main and not SINGLE.active
