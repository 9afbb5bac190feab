"""Write tiny random GGUF files of the two families ``scripts/prepare_model.py`` prepares: a
Llama with a byte-level BPE vocabulary (as SmolLM2's GGUF) and a Gemma 3 with a sentencepiece
vocabulary (as Gemma 3 270M's), their linear weights in Q8_0 blocks and the rest in float32.

Nothing is downloaded: the Llama vocabulary is the tiny trained tokenizer of :mod:`tiny_models`,
the Gemma one a handful of pieces written here. The weights are random; what matters is that
transformers reads the files as it reads the real ones (dequantization, Gemma's ``1 +`` norm
convention, tied head, tokenizer rebuilt from the metadata).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: GGUF token types (llama.cpp's ``LLAMA_TOKEN_TYPE``): normal, unknown, control.
_NORMAL, _UNKNOWN, _CONTROL = 1, 2, 3
#: The words of the Gemma vocabulary (each also as a ``▁word`` piece).
_WORDS = "the capital of france is paris germany berlin a an and".split()


def _tensor_writer(writer: Any, seed: int) -> Callable[..., None]:
    """``add(name, *shape, quantized=False, norm=False)``: a random tensor, Q8_0 or float32
    (norm weights around 1, the others around 0)."""
    import gguf

    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int, quantized: bool = False, norm: bool = False) -> None:
        values = ((1.0 if norm else 0.0) + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if quantized:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)

    return add


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama_gguf(path: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> None:
    """A tiny Llama GGUF (tied head, byte-level BPE vocabulary with merges, like SmolLM2's)."""
    import gguf
    from tiny_models import build_tokenizer

    heads, kv_heads, ffn = 4, 2, 2 * hidden
    with tempfile.TemporaryDirectory() as scratch:
        build_tokenizer(Path(scratch))
        spec = json.loads((Path(scratch) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {added["id"] for added in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([_CONTROL if i in special else _NORMAL for i in range(len(tokens))])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    add = _tensor_writer(writer, seed)
    head_dim = hidden // heads
    add("token_embd.weight", len(tokens), hidden)  # no output.weight: the head is tied
    add("output_norm.weight", hidden, norm=True)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden, norm=True)
        add(f"blk.{i}.attn_q.weight", hidden, hidden, quantized=True)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_output.weight", hidden, hidden, quantized=True)
        add(f"blk.{i}.ffn_norm.weight", hidden, norm=True)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden, quantized=True)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden, quantized=True)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn, quantized=True)
    _finish(writer)


def write_tiny_gemma3_gguf(path: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> None:
    """A tiny Gemma 3 GGUF: tied head, q/k norms, the four "sandwich" norms of each layer stored
    as llama.cpp stores them (``1 + weight``), a sentencepiece vocabulary without merges."""
    import gguf

    heads, kv_heads, head_dim, ffn = 2, 1, 32, 2 * hidden
    chars = sorted(set("".join(_WORDS)) | set("TCFPGB.,"))
    pieces = [*chars, *("\u2581" + c for c in chars), *("\u2581" + w for w in _WORDS)]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", *pieces]
    types = [_CONTROL, _CONTROL, _CONTROL, _UNKNOWN] + [_NORMAL] * (len(tokens) - 4)

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny gemma")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(16)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    add = _tensor_writer(writer, seed)
    add("token_embd.weight", len(tokens), hidden)
    add("output_norm.weight", hidden, norm=True)
    for i in range(layers):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(f"blk.{i}.{norm}.weight", hidden, norm=True)
        add(f"blk.{i}.attn_q_norm.weight", head_dim, norm=True)
        add(f"blk.{i}.attn_k_norm.weight", head_dim, norm=True)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, quantized=True)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, quantized=True)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden, quantized=True)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden, quantized=True)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn, quantized=True)
    _finish(writer)
