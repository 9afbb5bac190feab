"""Fetch serving engines' released wheels and import their pure-Python modules on a CPU machine.

The consumer tests run the engines' own configuration and name-matching code (vLLM, SGLang,
vLLM-Ascend) against msquant's exports. Those engines cannot be installed here (CUDA / NPU
builds), but the code that decides how a checkpoint is read is plain Python. This module:

* downloads a wheel once with ``pip download --no-deps`` into a cache outside the repository
  (``$MSQUANT_CONSUMER_CACHE``, default ``~/.cache/msquant/consumers``);
* extracts, on first use, only the ``.py`` files that get imported (cached beside the wheel);
* imports them under their real module names through :class:`EngineImporter`, where every module
  of the engine is either *real* (its file from the wheel, executed unchanged) or *stubbed*
  (a small documented stand-in for what needs CUDA / NPU: custom ops, kernels, platform
  detection, distributed state, layer classes used only in ``isinstance`` checks). A module that
  is neither is an ``ImportError`` naming it, so nothing is imported by accident.

Package ``__init__`` files run only when they are listed as real; other packages are bare
namespaces whose submodules load from the wheel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import tarfile
import types
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV = "MSQUANT_CONSUMER_CACHE"


def cache_dir() -> Path:
    """Where wheels and extracted modules are kept (never inside the repository)."""
    return Path(os.environ.get(CACHE_ENV, "~/.cache/msquant/consumers")).expanduser()


@dataclass(frozen=True)
class Release:
    """One released distribution on PyPI.

    :param project: the PyPI name, e.g. ``vllm-ascend``.
    :param version: the exact release.
    """

    project: str
    version: str

    @property
    def label(self) -> str:
        return f"{self.project} {self.version}"

    @property
    def stem(self) -> str:
        return f"{self.project.replace('-', '_')}-{self.version}"


class WheelUnavailable(RuntimeError):
    """The wheel could not be downloaded (no network, no such release)."""


def fetch_wheel(release: Release) -> Path:
    """The release's wheel in the cache, downloaded with ``pip download --no-deps`` on first use.

    :raises WheelUnavailable: when pip cannot get it.
    """
    folder = cache_dir() / "wheels"
    found = sorted(folder.glob(f"{release.stem}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--quiet", "--dest", str(folder),
        f"{release.project}=={release.version}",
    ]  # fmt: skip
    logger.info("downloading %s: %s", release.label, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(folder.glob(f"{release.stem}-*.whl"))
    if result.returncode != 0 or not found:
        raise WheelUnavailable(
            f"pip could not download {release.label} (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}"
        )
    return found[0]


class WheelSource:
    """The ``.py`` files of one wheel, extracted into the cache the first time each is read."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self.wheel = fetch_wheel(release)
        self.root = cache_dir() / "src" / release.stem
        with zipfile.ZipFile(self.wheel) as archive:
            self.files = {name for name in archive.namelist() if name.endswith(".py")}
            self.metadata = next(
                (
                    archive.read(name).decode()
                    for name in archive.namelist()
                    if name.endswith(".dist-info/METADATA")
                ),
                "",
            )
        # every folder holding a module, and their parents (namespace folders without .py files)
        self.packages = {
            "/".join(parts[:end])
            for parts in (name.split("/") for name in self.files)
            for end in range(1, len(parts))
        }

    def requirement(self, project: str) -> str | None:
        """The ``Requires-Dist`` line of the wheel for ``project`` (e.g. a version pin)."""
        for line in self.metadata.splitlines():
            if line.startswith("Requires-Dist:"):
                spec = line.split(":", 1)[1].strip()
                name = spec.split(";")[0]
                for stop in "=<>!~ [(":
                    name = name.split(stop)[0]
                if name.strip().lower().replace("_", "-") == project:
                    return spec
        return None

    def path_of(self, relative: str) -> Path:
        """The extracted file ``relative`` (a path inside the wheel), extracting it if needed."""
        target = self.root / relative
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(self.wheel) as archive:
                data = archive.read(relative)
            temporary = target.with_suffix(".py.part")
            temporary.write_bytes(data)
            temporary.replace(target)
        return target

    def module_file(self, module: str) -> str | None:
        """The wheel path of ``module``'s source (``pkg/mod.py`` or ``pkg/__init__.py``)."""
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def is_package(self, module: str) -> bool:
        return module.replace(".", "/") in self.packages


#: The build requirements pip needs to download vLLM-Ascend's source archive (it prepares the
#: archive's metadata, running its ``setup.py`` in this interpreter: ``--no-build-isolation``,
#: since its isolated build would install torch-npu and CANN's compilers). They are in msquant's
#: ``test`` extra: ``setup.py:32`` imports ``setuptools_scm``; setuptools builds the metadata
#: through its own ``bdist_wheel`` (70.1 and later; ``wheel`` before).
SDIST_BUILD_REQUIREMENTS = ("setuptools>=70.1", "setuptools-scm>=8")
#: The chip vLLM-Ascend's ``setup.py`` is told it builds for (``SOC_VERSION``): without it,
#: it asks ``npu-smi`` and raises on a machine without an NPU (``setup.py:141-154`` of
#: 0.30.0rc2). An Atlas A2 (``Dockerfile``'s default), the device the harness answers as; metadata
#: preparation only reads it (nothing is compiled). A ``SOC_VERSION`` already set is kept.
SDIST_SOC_VERSION = "ascend910b1"


def fetch_sdist(release: Release) -> Path:
    """The release's unpacked source archive in the cache (``<cache>/<stem>/``), for releases
    published as a source archive only (vLLM-Ascend 0.30.0rc2): ``pip download --no-deps
    --no-binary :all:`` on first use (with ``SOC_VERSION`` set, :data:`SDIST_SOC_VERSION`, and
    :data:`SDIST_BUILD_REQUIREMENTS` installed), then unpacked beside the archive.

    :raises WheelUnavailable: when pip cannot get it.
    """
    folder = cache_dir()
    unpacked = folder / release.stem
    if (unpacked / "PKG-INFO").exists():
        return unpacked
    archives = sorted(folder.glob(f"{release.stem}.tar.gz"))
    if not archives:
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", "--quiet", "--dest", str(folder),
            f"{release.project}=={release.version}",
        ]  # fmt: skip
        environment = {
            **os.environ,
            "SOC_VERSION": os.environ.get("SOC_VERSION", SDIST_SOC_VERSION),
        }
        logger.info("downloading %s: %s", release.label, " ".join(command))
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, env=environment
        )
        archives = sorted(folder.glob(f"{release.stem}.tar.gz"))
        if not archives:
            raise WheelUnavailable(
                f"pip could not download the source archive of {release.label} (exit "
                f"{result.returncode}; preparing its metadata needs "
                f"{', '.join(SDIST_BUILD_REQUIREMENTS)} installed in {sys.executable}'s "
                f"environment: pip install -e '.[test]'): {result.stderr.strip()[-2000:]}"
            )
    with tarfile.open(archives[0]) as archive:
        archive.extractall(folder, filter="data")
    if not (unpacked / "PKG-INFO").exists():
        raise WheelUnavailable(f"{archives[0]} did not unpack into {unpacked}")
    return unpacked


class SdistSource(WheelSource):
    """The ``.py`` files of one release's unpacked source archive (same interface as
    :class:`WheelSource`; the package folders sit at the archive's top level)."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self.root = fetch_sdist(release)
        self.wheel = self.root
        self.files = {
            path.relative_to(self.root).as_posix()
            for path in self.root.rglob("*.py")
            if path.relative_to(self.root).parts[0] == release.project.replace("-", "_")
        }
        self.metadata = (self.root / "PKG-INFO").read_text()
        self.packages = {
            "/".join(parts[:end])
            for parts in (name.split("/") for name in self.files)
            for end in range(1, len(parts))
        }

    def path_of(self, relative: str) -> Path:
        return self.root / relative


#: A stub's content: called with the fresh module object to fill in its attributes.
StubFactory = Callable[[types.ModuleType], None]


class _StubLoader(importlib.abc.Loader):
    def __init__(self, factory: StubFactory) -> None:
        self.factory = factory

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.setdefault("__path__", [])  # stubs may have (stubbed or real) children
        module.__msquant_stub__ = True  # type: ignore[attr-defined]
        self.factory(module)


class _NamespaceLoader(importlib.abc.Loader):
    """A package of the wheel whose ``__init__`` is not run (submodules still load)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class EngineImporter(importlib.abc.MetaPathFinder):
    """Imports the modules of some top-level packages from wheels, real or stubbed.

    :param sources: top-level package name -> the wheel holding it.
    :param real: module names executed from the wheel (a package's ``__init__`` runs only if its
        package name is listed; any submodule of a listed name ending in ``.*`` is real too).
    :param stubs: module name -> factory filling the stand-in module.
    """

    def __init__(
        self,
        sources: Mapping[str, WheelSource],
        real: Iterable[str],
        stubs: Mapping[str, StubFactory],
    ) -> None:
        self.sources = dict(sources)
        self.real = {name for name in real if not name.endswith(".*")}
        self.real_trees = tuple(name[:-2] for name in real if name.endswith(".*"))
        self.stubs = dict(stubs)
        self.loaded: list[str] = []

    def is_real(self, name: str) -> bool:
        return name in self.real or any(name.startswith(f"{tree}.") for tree in self.real_trees)

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.stubs:  # also device packages that are not in a wheel (torch_npu)
            spec = importlib.machinery.ModuleSpec(fullname, _StubLoader(self.stubs[fullname]))
            spec.submodule_search_locations = []
            return spec
        top = fullname.partition(".")[0]
        if top not in self.sources:
            return None
        source = self.sources[top]
        if self.is_real(fullname):
            file = source.module_file(fullname)
            if file is None:
                raise ImportError(f"{fullname} is not in {source.release.label}")
            location = source.path_of(file)
            is_package = file.endswith("__init__.py")
            self.loaded.append(fullname)
            return importlib.util.spec_from_file_location(
                fullname,
                location,
                submodule_search_locations=[str(location.parent)] if is_package else None,
            )
        if source.is_package(fullname):
            spec = importlib.machinery.ModuleSpec(fullname, _NamespaceLoader(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        raise ImportError(
            f"{fullname} ({source.release.label}) is neither listed as real nor stubbed in the "
            "consumer harness"
        )


def install(importer: EngineImporter) -> None:
    """Put ``importer`` first on ``sys.meta_path`` (once)."""
    if importer not in sys.meta_path:
        sys.meta_path.insert(0, importer)


def uninstall(importer: EngineImporter) -> None:
    """Take ``importer`` off ``sys.meta_path`` and forget every module it imported (its
    packages' and its stubs'), so that another release of the same engine can be imported."""
    if importer in sys.meta_path:
        sys.meta_path.remove(importer)
    tops = set(importer.sources)
    for name in list(sys.modules):
        if name.partition(".")[0] in tops or name in importer.stubs:
            del sys.modules[name]


def stub(**attributes: Any) -> StubFactory:
    """A stub factory that sets ``attributes`` on the module."""

    def fill(module: types.ModuleType) -> None:
        for name, value in attributes.items():
            setattr(module, name, value)

    return fill


def placeholder_class(name: str, base: type = object) -> type:
    """A class standing for an engine class that exists only for ``isinstance`` checks or type
    hints; instantiating it says which class was reached unexpectedly."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"the consumer harness stubs {name}; it was not expected here")

    return type(name, (base,), {"__init__": refuse})


class EngineLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The engines' logger (``init_logger``) with their ``*_once`` helpers, over ``logging``."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})
        self.seen: set[str] = set()

    def _once(self, level: int, message: str, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("scope", None)
        key = f"{level}:{message}"
        if key not in self.seen:
            self.seen.add(key)
            self.log(level, message, *args, **kwargs)

    def debug_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.DEBUG, message, *args, **kwargs)

    def info_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.INFO, message, *args, **kwargs)

    def warning_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.WARNING, message, *args, **kwargs)


@dataclass(frozen=True)
class DeviceCapability:
    """A CUDA compute capability as vLLM's and SGLang's platform objects report it."""

    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


class CudaPlatformStub:
    """Platform detection answered as on one NVIDIA H100/H200 (SM 9.0): the machine whose
    choices the consumer checks reproduce. Only the queries the loaded modules make exist."""

    device_type = "cuda"
    device_name = "cuda"
    capability = DeviceCapability(9, 0)
    #: the ``torch.compile`` backend vLLM's small helpers are decorated with (never called here)
    simple_compile_backend = "inductor"

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_out_of_tree(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability:
        return self.capability

    def has_device_capability(self, capability: Any, device_id: int = 0) -> bool:
        wanted = capability.to_int() if hasattr(capability, "to_int") else int(capability)
        return self.capability.to_int() >= wanted

    def is_device_capability(self, capability: Any, device_id: int = 0) -> bool:
        wanted = capability.to_int() if hasattr(capability, "to_int") else int(capability)
        return self.capability.to_int() == wanted

    def is_device_capability_family(self, family: int, device_id: int = 0) -> bool:
        return self.capability.to_int() // 10 == family // 10

    def use_sync_weight_loader(self) -> bool:
        return False

    def fp8_dtype(self) -> Any:
        import torch

        return torch.float8_e4m3fn
