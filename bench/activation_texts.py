"""Write the texts of the activation-scheme measurements in docs/accuracy.md ("Activation
schemes"): the calibration side (the even-position articles of the bench's Wikipedia dump, at
most 64: all 52, one sample each) and the held-out side (the odd-position articles), as plain
text files.

Usage: ``python bench/activation_texts.py OUT_DIR`` (needs ``pip install --no-deps gensim==4.4.0``,
see :mod:`eval_texts`); writes ``OUT_DIR/calib.txt`` and ``OUT_DIR/wiki.txt``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from eval_texts import find_sources, split_articles, wiki_articles, wiki_plain_text

logger = logging.getLogger("activation_texts")

#: Calibration samples (each truncated to 512 tokens by ``--max_calib_tokens 512``).
CALIB_ARTICLES = 64
#: Articles shorter than this are left out, as in the accuracy bench.
MIN_CHARS = 500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sources = find_sources()
    articles = [wiki_plain_text(raw) for _, raw in wiki_articles(sources.wiki)]
    calibration, held_out = split_articles([a for a in articles if len(a) >= MIN_CHARS])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # a calibration sample is one blank-line separated block: no blank line inside an article
    samples = [a.replace("\n\n", "\n") for a in calibration[:CALIB_ARTICLES]]
    (args.out_dir / "calib.txt").write_text("\n\n".join(samples) + "\n", encoding="utf-8")
    (args.out_dir / "wiki.txt").write_text("\n\n".join(held_out) + "\n", encoding="utf-8")
    logger.info("%d calibration articles, %d held-out articles", len(samples), len(held_out))


if __name__ == "__main__":
    main()
