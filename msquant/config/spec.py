"""The msModelSlim-v1-compatible quantization spec and its validation.

Shape (``apiversion``, ``metadata``, ``spec{runner, prior, process[], save[], dataset}``) and field
names follow msModelSlim v1. Processor entries are discriminated by ``type`` against the classes of a
:class:`~msquant.contracts.registry.ProcessorRegistry`, so plugins extend the schema without engine changes.

Validation has two layers, both reported together with YAML paths such as
``spec.process[0].qconfig.weight.ext.group_size``: the pydantic schema (unknown keys, types, enum
values, unknown processor types), then each processor's ``check_config`` (semantic rules such as
unimplemented ``(dtype, scope, method)`` combinations). Both layers run in one pass: an entry that
fails the schema (an unknown processor, say) does not hide the semantic problems of the others.

Two ``apiversion`` s are read: ``modelslim_v1`` and msModelSlim's vision-language one,
``multimodal_vlm_modelslim_v1``, whose ``spec`` has one more key, ``default_text`` (the prompt
msModelSlim pairs with each calibration image of a folder such as ``calibImages``; msquant does
the same when ``dataset`` names a folder of images, :mod:`msquant.load.image_calibration`, and
ignores it for a text calibration file). The processors and their meaning are the same; a
vision-language model's text decoder is what the layer loop walks (docs/msmodelslim-compat.md).

Keys beside ``apiversion``/``metadata``/``spec`` at the top of a file are ignored, as msModelSlim
ignores them: its configs define YAML anchors there (``default_w8a8_dynamic: &w8a8 {...}``) that
``spec`` refers to. A key that looks like a misspelt ``spec`` (or another known key) is warned about.
"""

from __future__ import annotations

import difflib
import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from msquant.config.yaml_loader import load_yaml_file, load_yaml_text
from msquant.contracts.processor import ProcessorConfig, Stage, nested_fields
from msquant.contracts.registry import ProcessorRegistry
from msquant.errors import ConfigError, ConfigIssue, validation_message
from msquant.registry_base import plugin_problems_named

__all__ = [
    "RunnerType",
    "Metadata",
    "SpecBody",
    "VlmSpecBody",
    "API_VERSIONS",
    "VLM_API_VERSION",
    "QuantConfig",
    "build_config_model",
    "validate_config",
    "load_config",
    "load_config_text",
    "prior_stage_notes",
    "config_json_schema",
]

API_VERSION: Literal["modelslim_v1"] = "modelslim_v1"
#: msModelSlim's apiversion for vision-language models (its ``multimodal_vlm_v1`` service).
VLM_API_VERSION: Literal["multimodal_vlm_modelslim_v1"] = "multimodal_vlm_modelslim_v1"
#: Every apiversion msquant reads.
API_VERSIONS = (API_VERSION, VLM_API_VERSION)
#: The most ``spec.prior`` stages a config may have (msModelSlim's practices use one).
MAX_PRIOR_STAGES = 8
_STAGES: tuple[Stage, ...] = ("process", "save")

logger = logging.getLogger(__name__)


class RunnerType(str, Enum):
    """Scheduling of the run; msModelSlim's names."""

    AUTO = "auto"
    MODEL_WISE = "model_wise"
    LAYER_WISE = "layer_wise"
    DP_LAYER_WISE = "dp_layer_wise"


class Metadata(BaseModel):
    """Descriptive metadata of a config (msModelSlim ``metadata``); not used for computation."""

    model_config = ConfigDict(extra="forbid")

    config_id: str = "Unknown"
    score: float = Field(100.0, ge=0)
    label: dict[str, Any] = Field(default_factory=dict)
    verified_model_types: list[str] = Field(default_factory=list)
    verified_tags: dict[str, list[list[str]]] = Field(default_factory=dict)


class PriorStage(BaseModel):
    """A preliminary stage (msModelSlim ``spec.prior``). msModelSlim 26.1.0 runs its ``process``
    entries over the model and then reloads the weights from ``model_path`` before the next
    stage, so a stage changes nothing in its export; msquant validates a stage but does not run
    it (:func:`prior_stage_notes`)."""

    model_config = ConfigDict(extra="forbid")

    process: list[ProcessorConfig] = Field(default_factory=list)
    dataset: str | None = Field(
        None,
        description=(
            "Calibration file msModelSlim runs this stage on (same forms as spec.dataset; "
            "default: the main calibration set); msquant reads it to check it, but does not run "
            "the stage."
        ),
    )


class SpecBody(BaseModel):
    """``spec``: what to run (``process``), how to save (``save``), and on which data (``dataset``)."""

    model_config = ConfigDict(extra="forbid")

    runner: RunnerType = RunnerType.AUTO
    prior: list[PriorStage] = Field(
        default_factory=list,
        max_length=MAX_PRIOR_STAGES,
    )
    process: list[ProcessorConfig] = Field(default_factory=list)
    save: list[ProcessorConfig] = Field(default_factory=list)
    dataset: str | None = Field(
        None,
        description=(
            "Calibration file (.jsonl, .json or .txt); relative to the CWD or the YAML. "
            "msModelSlim's dataset names (boolq.jsonl, cn_en.jsonl, ...) are read from an "
            "installed msModelSlim's lab_calib folder; without one, mix_calib.jsonl means "
            "msquant's shipped default set and the other names are refused. A "
            "multimodal_vlm_modelslim_v1 config may name a folder of .jpg / .jpeg / .png images "
            "instead (msModelSlim's calibImages: beside the YAML, in the CWD, or an installed "
            "msModelSlim's), each paired with default_text through the model's processor."
        ),
    )


class VlmSpecBody(SpecBody):
    """``spec`` of ``apiversion: multimodal_vlm_modelslim_v1``: ``SpecBody`` and ``default_text``."""

    default_text: str = Field(
        "Describe this image in detail.",
        description=(
            "msModelSlim's prompt paired with each calibration image (non-empty): with "
            "spec.dataset naming a folder of images, each image and this text go through the "
            "model's processor chat template as one user message; unused with a text file."
        ),
    )

    @field_validator("default_text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("default_text must not be empty (msModelSlim refuses a blank one)")
        return value


class QuantConfig(BaseModel):
    """A whole quantization config file; other top-level keys (YAML anchors) are ignored."""

    model_config = ConfigDict(extra="ignore")

    apiversion: Literal["modelslim_v1", "multimodal_vlm_modelslim_v1"] = API_VERSION
    metadata: Metadata = Field(default_factory=Metadata)
    spec: SpecBody = Field(default_factory=SpecBody)


def _entry_type(registry: ProcessorRegistry, stage: Stage) -> Any:
    classes = list(entry_classes(registry, stage).values())
    if not classes:
        return ProcessorConfig
    # Discriminate on ``type`` even for a single class, so that a missing or unknown ``type`` is
    # reported as such (instead of defaulting to the only class or adding follow-on errors).
    return Annotated[Union[tuple(classes)], Field(discriminator="type")]  # noqa: UP007


#: How deep containers (``group``) may nest in a config: a ``group`` in a ``group`` in a ``group``.
MAX_NESTING = 3


def entry_classes(registry: ProcessorRegistry, stage: Stage) -> dict[str, type[ProcessorConfig]]:
    """``{type: config class}`` of the registry's ``stage`` processors, each class whose config
    holds processor entries (:data:`~msquant.contracts.processor.ProcessorConfigList`) rebuilt so
    that those entries validate against the registered ``spec.process`` processors (containers
    nest up to :data:`MAX_NESTING` deep)."""
    plain = {name: registry.get(name).config_class for name in registry.names(stage)}
    if not any(nested_fields(cls) for cls in plain.values()):
        return plain
    process = {name: registry.get(name).config_class for name in registry.names("process")}
    level = process
    for _ in range(MAX_NESTING):
        union = _union_of(list(level.values()))
        level = {name: _with_children(cls, union) for name, cls in process.items()}
    return level if stage == "process" else {n: _with_children(c, union) for n, c in plain.items()}


def _union_of(classes: list[type[ProcessorConfig]]) -> Any:
    if not classes:
        return ProcessorConfig
    return Annotated[Union[tuple(classes)], Field(discriminator="type")]  # noqa: UP007


def _with_children(cls: type[ProcessorConfig], union: Any) -> type[ProcessorConfig]:
    """``cls`` with its nested-entries fields typed as lists of ``union``."""
    fields = nested_fields(cls)
    if not fields:
        return cls
    overrides: dict[str, Any] = {name: (list[union], cls.model_fields[name]) for name in fields}
    built: type[ProcessorConfig] = create_model(cls.__name__, __base__=cls, **overrides)
    return built


def build_config_model(
    registry: ProcessorRegistry, apiversion: str = API_VERSION
) -> type[QuantConfig]:
    """The :class:`QuantConfig` subclass whose process/save entries are the registry's configs;
    its ``spec`` is :class:`VlmSpecBody` for ``apiversion`` :data:`VLM_API_VERSION`."""
    spec_base = VlmSpecBody if apiversion == VLM_API_VERSION else SpecBody
    process_list: Any = list[_entry_type(registry, "process")]  # type: ignore[misc]
    save_list: Any = list[_entry_type(registry, "save")]  # type: ignore[misc]
    prior = create_model(
        "PriorStage", __base__=PriorStage, process=(process_list, Field(default_factory=list))
    )
    body = create_model(
        "Spec",
        __base__=spec_base,
        prior=(list[prior], SpecBody.model_fields["prior"]),
        process=(process_list, Field(default_factory=list)),
        save=(save_list, Field(default_factory=list)),
    )
    return create_model(
        "QuantConfigFile", __base__=QuantConfig, spec=(body, Field(default_factory=body))
    )


def config_json_schema(registry: ProcessorRegistry) -> dict[str, Any]:
    """JSON Schema of config files for this registry (for editors and the YAML reference docs)."""
    return build_config_model(registry).model_json_schema()


def validate_config(
    data: Any, registry: ProcessorRegistry, source: str | None = None
) -> QuantConfig:
    """Validate a parsed config (a dict) against the schema and every processor's semantic checks.

    :param data: the parsed YAML document.
    :param registry: the processors that may appear in ``spec.process`` / ``spec.save``.
    :param source: where the data came from (file path), named in errors.
    :raises ConfigError: with every problem found, each located by its YAML path.
    """
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            [ConfigIssue("", f"a config must be a mapping with a 'spec' key, got {kind}")], source
        )
    _note_extra_top_level_keys(data, source)
    apiversion = data.get("apiversion", API_VERSION)
    model_cls = build_config_model(
        registry, apiversion if apiversion in API_VERSIONS else API_VERSION
    )
    try:
        config = model_cls.model_validate(data)
    except ValidationError as exc:
        issues = _schema_issues(exc, registry, model_cls)
        raise ConfigError(issues + _semantic_issues_of_raw(data, registry), source) from None
    issues = _semantic_issues(config, registry)
    if issues:
        raise ConfigError(issues, source)
    for note in prior_stage_notes(config):
        logger.warning("%s%s", f"{source}: " if source else "", note)
    return config


def prior_stage_notes(config: QuantConfig) -> list[str]:
    """One warning per ``spec.prior`` stage: msModelSlim 26.1.0 reloads the model's weights
    from ``model_path`` after each prior stage, so the stage changes nothing in its export
    (its prior stages serve processors that hand a result on through its run context, as
    ``adapt_rotation`` stage 1 does); msquant does not run the stage, to export what msModelSlim
    exports."""
    notes = []
    for index, stage in enumerate(config.spec.prior):
        kinds = ", ".join(entry.type for entry in stage.process) or "no processor"
        notes.append(
            f"spec.prior[{index}] ({kinds}) is not run: msModelSlim 26.1.0 reloads the model's "
            "weights after each prior stage, so what the stage changes never reaches "
            "spec.process or its export (its prior stages pass results on through its run "
            "context, for adapt_rotation stage 1, which msquant does not have); msquant skips "
            "the stage and exports what msModelSlim exports. Move the entries into spec.process "
            "to apply them"
        )
    return notes


def _note_extra_top_level_keys(data: dict[Any, Any], source: str | None) -> None:
    """Log the top-level keys that are ignored; warn when one looks like a misspelt known key."""
    known = list(QuantConfig.model_fields)
    where = f" in {source}" if source else ""
    for key in data:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
        if close and close[0] not in data:
            logger.warning(
                "top-level key %r%s is ignored (as msModelSlim ignores keys beside apiversion, "
                "metadata and spec); did you mean %r?",
                key,
                where,
                close[0],
            )
        else:
            logger.debug("top-level key %r%s ignored (a YAML anchor holder)", key, where)


def load_config(path: str | Path, registry: ProcessorRegistry) -> QuantConfig:
    """Read, parse and validate a YAML config file."""
    return validate_config(load_yaml_file(path), registry, str(path))


def load_config_text(
    text: str, registry: ProcessorRegistry, source: str = "<string>"
) -> QuantConfig:
    """Parse and validate YAML config text."""
    return validate_config(load_yaml_text(text, source), registry, source)


def _semantic_issues(config: QuantConfig, registry: ProcessorRegistry) -> list[ConfigIssue]:
    issues = []
    located: list[tuple[str, str]] = []
    for number, prior in enumerate(config.spec.prior):
        for index, entry in enumerate(prior.process):
            where = f"spec.prior[{number}].process[{index}]"
            issues += _entry_issues(registry, where, entry)
            located += _located_types(where, entry)
    for stage in _STAGES:
        for index, entry in enumerate(getattr(config.spec, stage)):
            issues += _entry_issues(registry, f"spec.{stage}[{index}]", entry)
            located += _located_types(f"spec.{stage}[{index}]", entry)
    return issues + _repeated_entry_issues(registry, located)


def _located_types(prefix: str, entry: ProcessorConfig) -> list[tuple[str, str]]:
    """``(YAML path, type)`` of an entry and of the entries it holds, in YAML order."""
    located = [(prefix, entry.type)]
    for name in nested_fields(type(entry)):
        for index, child in enumerate(getattr(entry, name)):
            located += _located_types(f"{prefix}.{name}[{index}]", child)
    return located


def _repeated_entry_issues(
    registry: ProcessorRegistry, located: list[tuple[str, str]]
) -> list[ConfigIssue]:
    """One issue for every entry after the first of a processor that allows one per config
    (:attr:`~msquant.plugin.Processor.once_per_config`), naming the first entry's path."""
    first: dict[str, str] = {}
    issues = []
    for path, kind in located:
        reason = registry.get(kind).once_per_config if kind in registry else None
        if not reason:
            continue
        if kind not in first:
            first[kind] = path
            continue
        issues.append(
            ConfigIssue(
                path, f"{kind} is listed more than once ({first[kind]} and {path}): {reason}"
            )
        )
    return issues


def _entry_issues(
    registry: ProcessorRegistry, prefix: str, entry: ProcessorConfig
) -> list[ConfigIssue]:
    """The processor's ``check_config`` issues of one entry located under ``prefix``
    (``spec.process[2]``), then those of the entries it holds (``spec.process[2].configs[0]``)."""
    issues = [
        ConfigIssue(f"{prefix}.{issue.path}" if issue.path else prefix, issue.message)
        for issue in registry.get(entry.type).check_config(entry)
    ]
    for name in nested_fields(type(entry)):
        for index, child in enumerate(getattr(entry, name)):
            issues += _entry_issues(registry, f"{prefix}.{name}[{index}]", child)
    return issues


def _semantic_issues_of_raw(data: dict[Any, Any], registry: ProcessorRegistry) -> list[ConfigIssue]:
    """The semantic issues of a document that failed the schema: every entry that is valid on its
    own is still checked, so one run of ``validate`` shows every problem of the file."""
    spec = data.get("spec")
    if not isinstance(spec, dict):
        return []
    classes = {stage: entry_classes(registry, stage) for stage in _STAGES}
    issues = []
    located: list[tuple[str, str]] = []
    priors = spec.get("prior")
    for number, prior in enumerate(priors if isinstance(priors, list) else []):
        entries = prior.get("process") if isinstance(prior, dict) else None
        for index, raw in enumerate(entries if isinstance(entries, list) else []):
            where = f"spec.prior[{number}].process[{index}]"
            issues += _raw_entry_issues(registry, classes["process"], where, raw)
            located += _raw_located_types(registry, classes["process"], where, raw)
    for stage in _STAGES:
        entries = spec.get(stage)
        for index, raw in enumerate(entries if isinstance(entries, list) else []):
            issues += _raw_entry_issues(registry, classes[stage], f"spec.{stage}[{index}]", raw)
            located += _raw_located_types(registry, classes[stage], f"spec.{stage}[{index}]", raw)
    return issues + _repeated_entry_issues(registry, located)


def _raw_located_types(
    registry: ProcessorRegistry,
    classes: dict[str, type[ProcessorConfig]],
    prefix: str,
    raw: Any,
) -> list[tuple[str, str]]:
    """``(YAML path, type)`` of a raw entry of a type registered for its stage (``classes``) and
    of the ``spec.process`` entries it holds."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in classes:
        return []
    located = [(prefix, kind)]
    process = entry_classes(registry, "process")
    for name in nested_fields(classes[kind]):
        children = raw.get(name)
        for index, child in enumerate(children if isinstance(children, list) else []):
            located += _raw_located_types(registry, process, f"{prefix}.{name}[{index}]", child)
    return located


def _raw_entry_issues(
    registry: ProcessorRegistry,
    classes: dict[str, type[ProcessorConfig]],
    prefix: str,
    raw: Any,
) -> list[ConfigIssue]:
    """The semantic issues of one raw entry whose processor is registered for its stage: all of
    them when the entry passes its schema, else those of the entries it holds (its own schema
    errors are already reported)."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in classes:
        return []
    try:
        return _entry_issues(registry, prefix, classes[kind].model_validate(raw))
    except ValidationError:
        pass
    issues = []
    process = entry_classes(registry, "process")
    for name in nested_fields(classes[kind]):
        children = raw.get(name)
        for index, child in enumerate(children if isinstance(children, list) else []):
            issues += _raw_entry_issues(registry, process, f"{prefix}.{name}[{index}]", child)
    return issues


def _schema_issues(
    exc: ValidationError, registry: ProcessorRegistry, model_cls: type[BaseModel]
) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc, _ = _walk(model_cls, err["loc"], registry)
        message = validation_message(err)
        nested_union = bool(loc) and isinstance(loc[-1], str)  # a field's union, not a list entry's
        if err["type"] == "extra_forbidden":
            _, parent = _walk(model_cls, err["loc"][:-1], registry)
            message = _unknown_key_message(parent)
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found") and nested_union:
            key = str(err.get("ctx", {}).get("discriminator", "")).strip("'")
            if err["type"] == "union_tag_invalid":
                tag = err.get("ctx", {}).get("tag")
                valid = str(err.get("ctx", {}).get("expected_tags", "")).replace("'", "")
                message = _set_aside_message(tag) or f"unknown {key} {tag!r}; valid: {valid}"
            else:
                message = "Field required"
            loc = (*loc, key)
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            stage = "save" if "save" in loc else "process"
            known = ", ".join(registry.names(stage)) or "(none)"  # type: ignore[arg-type]
            tag = err.get("ctx", {}).get("tag")
            what = (
                f"unknown processor type {tag!r}"
                if err["type"] == "union_tag_invalid"
                else "missing key 'type'"
            )
            message = f"{what}; registered {stage} types: {known}"
            problem = registry.problem(tag) if isinstance(tag, str) else None
            if problem is not None:
                message = problem.message()
            loc = (*loc, "type")
        elif err["type"] == "literal_error" and loc[-1:] == ("type",):
            stage = "save" if "save" in loc else "process"
            message += f" (registered {stage} types: {', '.join(registry.names(stage))})"  # type: ignore[arg-type]
        issues.append(ConfigIssue(_format_loc(loc), message))
    return issues


def _set_aside_message(tag: object) -> str | None:
    """The message of a name whose plugin was set aside (broken, or claimed twice), or None."""
    problems = plugin_problems_named(tag)
    return "; ".join(p.message() for p in problems) if problems else None


def _unknown_key_message(model: Any) -> str:
    """``unknown key; valid keys here: ...``, or the model's own wording (a method's ``ext``
    names its method: ``unknown gptq option; valid: ...``)."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "unknown key"
    own = getattr(model, "unknown_key_message", None)
    if callable(own):
        return str(own())
    return f"unknown key; valid keys here: {', '.join(model.model_fields)}"


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _walk(
    model_cls: type[BaseModel], loc: tuple[int | str, ...], registry: ProcessorRegistry
) -> tuple[tuple[int | str, ...], Any]:
    """pydantic's raw location without the tags it inserts after a discriminated union
    (``process.0.linear_quant``, ``qconfig.weight.gptq``), and the model found there (None when
    it cannot be resolved)."""
    kept: list[int | str] = []
    current: Any = model_cls
    tags: dict[str, Any] | None = None
    for part in loc:
        if tags is not None and isinstance(part, str) and part in tags:
            current, tags = tags[part], None
            continue
        if tags is not None and isinstance(part, str) and part in registry:
            current, tags = registry.get(part).config_class, None
            continue
        kept.append(part)
        if isinstance(part, int):
            continue
        field = None
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
        if field is None:
            current, tags = None, None
            continue
        current, tags = _model_in(field.annotation), _union_tags(field)
    return tuple(kept), current


def _union_tags(field: Any) -> dict[str, Any] | None:
    """``{tag: model}`` of a field holding a union discriminated on a key (``qconfig.weight``
    on ``method``) or a list of one (``spec.process`` on ``type``); None for any other field."""
    discriminator = field.discriminator
    annotation = field.annotation
    if discriminator is None and get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
        if get_origin(annotation) is Annotated:
            annotation, *metadata = get_args(annotation)
            found = [m.discriminator for m in metadata if getattr(m, "discriminator", None)]
            discriminator = found[0] if found else None
    if not isinstance(discriminator, str):
        return None
    tags: dict[str, Any] = {}
    for member in get_args(annotation):
        member_field = getattr(member, "model_fields", {}).get(discriminator)
        if member_field is not None and get_origin(member_field.annotation) is Literal:
            tags.update({str(tag): member for tag in get_args(member_field.annotation)})
    return tags


def _model_in(annotation: Any) -> Any:
    """The BaseModel class inside ``annotation`` (``X``, ``list[X]``), else the annotation itself."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if isinstance(found, type) and issubclass(found, BaseModel):
            return found
    return annotation
