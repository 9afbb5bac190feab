"""The device seam: parsing, presence checks, and no device-specific code outside msquant/backends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from msquant import DeviceError
from msquant.backends import BACKENDS
from msquant.backends.cpu import CpuBackend
from msquant.backends.device import DeviceSpec
from msquant.plugin.devices import get_backend, parse_device

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "kind", "indices", "primary"),
    [
        ("cpu", "cpu", (), "cpu"),
        ("CPU", "cpu", (), "cpu"),
        ("npu", "npu", (), "npu:0"),
        ("npu:3", "npu", (3,), "npu:3"),
        ("npu:0,1,2,3", "npu", (0, 1, 2, 3), "npu:0"),
        ("cuda", "cuda", (), "cuda:0"),
        ("cuda:1", "cuda", (1,), "cuda:1"),
    ],
)
def test_parse_device(text: str, kind: str, indices: tuple[int, ...], primary: str) -> None:
    spec = parse_device(text)
    assert (spec.kind, spec.indices, spec.primary) == (kind, indices, primary)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tpu", "unknown device type 'tpu'"),
        ("cuda:x", "malformed device"),
        ("npu:", "malformed device"),
        ("cpu:1", "takes no index"),
        ("npu:1,1", "repeats"),
        ("", "malformed"),
    ],
)
def test_bad_device_strings(text: str, match: str) -> None:
    with pytest.raises(DeviceError, match=match):
        parse_device(text)


def test_cpu_backend_seam_operations() -> None:
    backend = get_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.device == torch.device("cpu")
    module = torch.nn.Linear(3, 3)
    assert backend.to_device(module) is module and backend.offload(module) is module
    backend.synchronize()
    backend.empty_cache()
    assert backend.memory_allocated() == 0
    a = torch.randn(6, 6, dtype=torch.float64)
    h = a @ a.T + 6 * torch.eye(6, dtype=torch.float64)
    lower = backend.cholesky(h)
    torch.testing.assert_close(lower @ lower.T, h)
    b = torch.randn(6, 2, dtype=torch.float64)
    x = backend.solve_triangular(lower, b, upper=False)
    torch.testing.assert_close(lower @ x, b)


def test_absent_devices_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BACKENDS["cuda"], "is_available", classmethod(lambda cls: False))
    with pytest.raises(DeviceError, match="no cuda device is available"):
        get_backend("cuda:0")
    monkeypatch.setattr("msquant.backends.import_torch_npu", lambda: None)
    with pytest.raises(DeviceError, match="torch_npu is not installed"):
        get_backend("npu:0")
    with pytest.raises(DeviceError, match=r"names 2 devices, but one process drives one device"):
        get_backend("npu:0,1")


def test_device_index_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = BACKENDS["cuda"]
    monkeypatch.setattr(cuda, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(cuda, "device_count", classmethod(lambda cls: 2))
    with pytest.raises(DeviceError, match=r"only 2 cuda device\(s\) exist \(valid indices 0..1\)"):
        get_backend("cuda:5")
    assert get_backend(DeviceSpec("cuda", (1,))).device == torch.device("cuda:1")


FORBIDDEN_ATTRS = {("torch", "cuda"), ("torch", "npu")}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN_ATTRS:
                found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] == "torch_npu" for n in names):
                found.append(f"{path}:{node.lineno}: imports torch_npu")
        if isinstance(node, ast.Constant) and node.value == "torch_npu":
            found.append(f"{path}:{node.lineno}: names torch_npu")
    return found


def test_device_specific_calls_live_only_in_backends() -> None:
    files = [p for p in (REPO / "msquant").rglob("*.py") if "backends" not in p.parts]
    files += list((REPO / "processors").rglob("*.py"))
    violations = [v for f in files for v in _violations(f)]
    assert violations == []
    # the lint itself catches what it should
    probe = REPO / "tests" / "data" / "device_lint_probe.py.txt"
    assert len(_violations(probe)) == 3


def test_torch_npu_is_not_imported_by_msquant() -> None:
    import subprocess
    import sys

    code = "import sys, msquant, msquant.cli; msquant.plugin.default_registry(); print('torch_npu' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
