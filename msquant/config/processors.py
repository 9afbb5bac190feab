"""The processors a validated config asks for, in the order a run calls them."""

from __future__ import annotations

import logging

from msquant.config.spec import QuantConfig
from msquant.plugin.processor import Processor
from msquant.plugin.registry import ProcessorRegistry

__all__ = ["DEFAULT_SAVER", "build_processors"]

logger = logging.getLogger(__name__)

# The saver used when a config's ``spec.save`` is empty (msModelSlim's default format).
DEFAULT_SAVER = "ascendv1_saver"


def build_processors(config: QuantConfig, registry: ProcessorRegistry) -> list[Processor]:
    """Instantiate ``spec.process`` then ``spec.save``; an empty ``save`` means the default saver.

    With several savers, each writes into its own subfolder of the save path named after its
    ``type`` (``gptq_saver``, ``compressed_tensors``, ...; ``_2``, ``_3`` appended for repeats), so
    one quantization run can produce every deployment format without files colliding.
    """
    entries = list(config.spec.process) + list(config.spec.save)
    if not config.spec.save:
        saver_cls = registry.get(DEFAULT_SAVER)
        entries.append(saver_cls.config_class.model_validate({"type": DEFAULT_SAVER}))
        logger.info("spec.save is empty: writing the default %s format", DEFAULT_SAVER)
    processors = [registry.get(entry.type)(entry) for entry in entries]
    savers = [p for p in processors if p.stage == "save"]
    if len(savers) > 1:
        used: dict[str, int] = {}
        for saver in savers:
            used[saver.type_name] = used.get(saver.type_name, 0) + 1
            count = used[saver.type_name]
            saver.output_subdir = saver.type_name if count == 1 else f"{saver.type_name}_{count}"
        logger.info(
            "%d savers: each writes into its own subfolder (%s)",
            len(savers),
            ", ".join(str(s.output_subdir) for s in savers),
        )
    return processors
