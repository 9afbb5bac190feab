"""The processors a validated config asks for, in the order a run calls them."""

from __future__ import annotations

import logging

from msquant.config.spec import QuantConfig
from msquant.contracts.processor import (
    Processor,
    ProcessorConfig,
    ProcessorContainer,
    nested_fields,
)
from msquant.contracts.registry import ProcessorRegistry
from msquant.errors import RegistryError

__all__ = ["default_saver", "build_processor", "build_prior_stages", "build_processors"]

logger = logging.getLogger(__name__)


def default_saver(registry: ProcessorRegistry) -> type[Processor]:
    """The saver written when a config's ``spec.save`` is empty: the one registered saver whose
    class declares ``default_saver = True`` (msModelSlim's default format, among the built-ins).

    :raises RegistryError: when no registered saver, or more than one, declares itself the default.
    """
    # declared on the class itself: a subclass of the default saver is not the default too
    declared = [
        registry.get(name)
        for name in registry.names("save")
        if vars(registry.get(name)).get("default_saver", False) is True
    ]
    if len(declared) == 1:
        return declared[0]
    if not declared:
        raise RegistryError(
            "spec.save is empty and no registered saver declares itself the default "
            f"(default_saver = True); name a saver in spec.save (registered savers: "
            f"{', '.join(registry.names('save')) or '(none)'})"
        )
    raise RegistryError(
        "several registered savers declare themselves the default (default_saver = True): "
        f"{', '.join(cls.type_name for cls in declared)}; exactly one may"
    )


def build_processor(entry: ProcessorConfig, registry: ProcessorRegistry) -> Processor:
    """The processor of one validated entry; a container (:class:`ProcessorContainer`) gets the
    processors of the entries it holds, built the same way, in order."""
    processor = registry.get(entry.type)(entry)
    fields = nested_fields(type(entry))
    if fields:
        children = [build_processor(child, registry) for f in fields for child in getattr(entry, f)]
        if not isinstance(processor, ProcessorContainer):
            raise RegistryError(
                f"processor {entry.type!r} has nested processor entries ({', '.join(fields)}) but "
                "does not implement adopt_children (msquant.ProcessorContainer)"
            )
        processor.adopt_children(children)
    return processor


def build_prior_stages(config: QuantConfig, registry: ProcessorRegistry) -> list[list[Processor]]:
    """The processors of each ``spec.prior`` stage, in order: built and checked against the
    model, never run (msModelSlim's prior stages change nothing in its export,
    :mod:`msquant.run.prior_inputs`)."""
    return [
        [build_processor(entry, registry) for entry in stage.process] for stage in config.spec.prior
    ]


def build_processors(config: QuantConfig, registry: ProcessorRegistry) -> list[Processor]:
    """Instantiate ``spec.process`` then ``spec.save``; an empty ``save`` means the default saver
    (:func:`default_saver`).

    With several savers, each writes into its own subfolder of the save path named after its
    ``type`` (``_2``, ``_3`` appended for repeats), so one quantization run can produce every
    deployment format without files colliding.
    """
    entries = list(config.spec.process) + list(config.spec.save)
    if not config.spec.save:
        saver_cls = default_saver(registry)
        entries.append(saver_cls.config_class.model_validate({"type": saver_cls.type_name}))
        logger.info("spec.save is empty: writing the default %s format", saver_cls.type_name)
    processors = [build_processor(entry, registry) for entry in entries]
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
