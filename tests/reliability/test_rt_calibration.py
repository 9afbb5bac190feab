"""Red-team replay C9: calibration samples longer than the model's context passed silently."""

from __future__ import annotations

from pathlib import Path

from replay import Cli, quant_args, replay


def test_c9_samples_beyond_the_trained_context_are_named(case: Path, run_cli: Cli) -> None:
    long_text = case / "long.txt"
    long_text.write_text("the quick brown fox jumps over the lazy dog " * 120 + "\n\nshort one\n")
    args = quant_args(case, config="gptq.yaml")
    args[args.index("--calib_path") + 1] = long_text
    del args[args.index("--max_calib_tokens") : args.index("--max_calib_tokens") + 2]
    outcome = replay(run_cli, case, *args)
    assert outcome.code == 0, outcome.err
    assert (
        "1 of 2 calibration sample(s) are longer than the model's max_position_embeddings (512"
        in outcome.err
    )
    assert "pass --max_calib_tokens 512" in outcome.err
    truncated = replay(
        run_cli, case, *args, "--max_calib_tokens", "512", "--save_path", case / "out2"
    )
    assert truncated.code == 0 and "max_position_embeddings" not in truncated.err
