"""llm-compressor's oneshot on given calibration token ids (run by bench/accuracy.py and bench/e2e.py
in llm-compressor's own virtual environment; not part of msquant, imports nothing of it).

``--scheme w4_gptq`` (default): its GPTQ defaults (GPTQModifier: dampening 0.01, block 128,
act-order "static", the sequential pipeline that calibrates each layer on the quantized previous
layers' outputs) with an int ``--bits`` symmetric group scheme on every Linear but lm_head.
``--scheme w8a8_smoothquant``: its SmoothQuantModifier (strength 0.8, its default mappings for the
model's family) then a QuantizationModifier with int8 per-channel symmetric weights (round to
nearest) and int8 dynamic per-token symmetric activations on every Linear but lm_head, the recipe
of its W8A8 int8 examples. Writes a compressed-tensors export to ``--out`` and prints one JSON
line: the seconds of ``oneshot`` (model load included) and of ``oneshot`` plus the save.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
from transformers import AutoModelForCausalLM, AutoTokenizer


def gptq(args: argparse.Namespace) -> list[object]:
    """GPTQ with an int group scheme on every Linear but lm_head."""
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=args.bits,
            type="int",
            symmetric=True,
            strategy="group",
            group_size=args.group_size,
        ),
    )
    return [GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]


def w8a8_smoothquant() -> list[object]:
    """SmoothQuant (strength 0.8), then int8 weights per channel and int8 dynamic per-token
    activations, both symmetric, on every Linear but lm_head."""
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
        input_activations=QuantizationArgs(
            num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
        ),
    )
    return [
        SmoothQuantModifier(smoothing_strength=0.8),
        QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, required=True)
    parser.add_argument("--ids", type=Path, required=True, help="JSON list of token id lists")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--group_size", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--scheme", choices=("w4_gptq", "w8a8_smoothquant"), default="w4_gptq")
    args = parser.parse_args()
    ids = json.loads(args.ids.read_text())
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    recipe = w8a8_smoothquant() if args.scheme == "w8a8_smoothquant" else gptq(args)
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=max(len(x) for x in ids),
        shuffle_calibration_samples=False,
    )
    oneshot_seconds = time.perf_counter() - started
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    seconds = time.perf_counter() - started
    print(json.dumps({"oneshot_seconds": oneshot_seconds, "seconds": seconds}))


if __name__ == "__main__":
    main()
