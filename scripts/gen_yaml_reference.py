#!/usr/bin/env python
"""Generate ``docs/yaml-reference.md`` from msquant's config schema.

The reference is derived, never written by hand: the structure, types, defaults, allowed values and
descriptions come from ``msquant.config_json_schema(registry)`` (the same JSON Schema that
``msquant schema`` prints) and the ``ext`` option models of the methods registered in the
``msquant.methods`` entry-point group (``msquant.plugin.default_method_registry()``). Defaults
that pydantic computes with a factory (which JSON Schema omits) are read from the models.

Usage::

    python scripts/gen_yaml_reference.py            # (re)write docs/yaml-reference.md
    python scripts/gen_yaml_reference.py --check    # exit 1 if the file on disk is out of date

By default only msquant's built-in processors are documented, so the output does not depend on
which third-party plugins happen to be installed; ``--include-plugins`` documents them all.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import msquant
import msquant.plugin
from msquant.config import build_config_model

__all__ = ["DEFAULT_OUTPUT", "generate", "main"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "docs" / "yaml-reference.md"
BUILTIN_PREFIX = "msquant."
REGENERATE = "python scripts/gen_yaml_reference.py"
EXIT_OK, EXIT_STALE, EXIT_USER = 0, 1, 2

logger = logging.getLogger("gen_yaml_reference")

# Descriptions for fields whose pydantic models carry none (used only when the schema has none).
FALLBACK_DESCRIPTIONS: dict[tuple[str, str], str] = {
    (
        "QuantConfigFile",
        "apiversion",
    ): "Config format version: msModelSlim's v1 format, or its vision-language one (spec.default_text added).",
    ("QuantConfigFile", "metadata"): "Descriptive information about the config.",
    ("QuantConfigFile", "spec"): "What to run, how to save it, and on which calibration data.",
    ("Metadata", "config_id"): "Identifier of the config (informational).",
    (
        "Metadata",
        "score",
    ): "Quality score as msModelSlim's practice files record it (informational).",
    ("Metadata", "label"): "Free-form labels, e.g. `{w_bit: 8, a_bit: 16}` (informational).",
    ("Metadata", "verified_model_types"): "Model types the config was verified on (informational).",
    ("Metadata", "verified_tags"): "Tags per verified model type (informational).",
    ("Spec", "runner"): (
        "Scheduling of the run: `auto`/`layer_wise` stream the decoder layers from disk one at a "
        "time, `model_wise` loads every weight first, `dp_layer_wise` is layer_wise over several "
        "processes (torchrun, `--nproc`, `--device npu:0,1`); the export is the same."
    ),
    ("Spec", "prior"): (
        "Stages msModelSlim runs before `process`; validated, **not run**: msModelSlim 26.1.0 "
        "reloads the weights after each prior stage, so a stage changes nothing in its export "
        "(its prior stages pass results through its run context, for `adapt_rotation` stage 1, "
        "which msquant lacks). msquant skips each stage with a warning and exports what "
        "msModelSlim exports; a stage's `dataset` must still be readable and its processors "
        "must apply to the model. Entries meant to change the model belong in `process`. At "
        "most 8 stages."
    ),
    ("Spec", "process"): "Processors applied to the model, in order; selected by `type`.",
    ("Spec", "save"): "Savers writing the output, in order; empty means `ascendv1_saver`.",
    ("PriorStage", "process"): "Processor entries of the stage (any `spec.process` processor).",
    ("LinearQConfig", "act"): (
        "Activation quantization: `float` (weight-only, the default), or int8 `per_tensor` (W8A8, "
        "static: calibrated, sym or asym) / `per_token` (W8A8_DYNAMIC, sym) with `method: minmax`, "
        "both with int8 per-channel symmetric `minmax` weights."
    ),
    ("LinearQConfig", "weight"): "Weight quantization.",
    ("LinearQuantConfig", "qconfig"): "How weights (and activations) are quantized.",
}
TYPE_FIELD_DESCRIPTION = "Selects the processor."
ROOT_TITLE = "Top level"


@dataclass
class Section:
    """One table of the reference: the keys allowed at one YAML location."""

    path: str
    anchor: str
    title: str
    description: str
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)


METHODS = msquant.plugin.default_method_registry()


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _md(text: str) -> str:
    """Docstring text as Markdown: reST ``code`` to `code`, table-safe, one line."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    return text.replace("|", "\\|")


def _value(value: Any) -> str:
    """A YAML-style rendering of a default or allowed value, as inline code."""
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _model_classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every pydantic model reachable from ``root``'s fields, by class name (= JSON Schema title)."""
    found: dict[str, type[BaseModel]] = {}
    pending = [root]
    while pending:
        cls = pending.pop()
        title = cls.model_config.get("title") or cls.__name__
        if title in found:
            continue
        found[title] = cls
        for info in cls.model_fields.values():
            pending.extend(_models_in(info.annotation))
    return found


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        yield from _models_in(arg)
    for arg in getattr(annotation, "__metadata__", ()) or ():
        yield from _models_in(arg)


class _Builder:
    """Walks the JSON Schema from the root and collects one :class:`Section` per object."""

    def __init__(self, schema: dict[str, Any], classes: dict[str, type[BaseModel]]) -> None:
        self.defs: dict[str, Any] = schema.get("$defs", {})
        self.classes = classes
        self.sections: list[Section] = []
        self.extra_allowed = {
            ("WeightQConfig", "method"): ", ".join(
                f"[{_value(n)}](#{_anchor('ext ' + n)})" for n in METHODS.names()
            ),
            ("WeightQConfig", "ext"): "see [Weight methods](#weight-methods)",
        }

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if ref is None:
            return node
        return self.defs[ref.rsplit("/", 1)[-1]]

    def add_object(
        self, node: dict[str, Any], path: str, title: str, description: str = "", scope: str = ""
    ) -> str:
        """Document the object ``node`` found at ``path``; returns the section anchor.

        ``scope`` (e.g. a processor type) is appended to the titles of nested sections so that
        two processors with a key of the same name get distinct sections.
        """
        node = self.resolve(node)
        anchor = _anchor(title)
        section = Section(path, anchor, title, _md(description or node.get("description", "")))
        self.sections.append(section)
        children: list[tuple[dict[str, Any], str, str, str]] = []
        required = set(node.get("required", ()))
        model_name = node.get("title", "").split("_")[0]  # WeightQConfig_<method>: one member
        for key, prop in node.get("properties", {}).items():
            type_text, allowed, child = self.describe_type(prop, f"{path}.{key}" if path else key)
            opaque = (model_name, key) == ("WeightQConfig", "ext")  # documented per method below
            if opaque:
                type_text, child = "mapping", None
            if child is not None and scope:
                child = (child[0], child[1], f"{child[2]} ({scope})", child[3])
            if child is not None:
                children.append(child)
                type_text = f"[{type_text}](#{_anchor(child[2])})"
            default = "**required**" if key in required else self.default(prop, model_name, key)
            default = "`{}`" if opaque else default
            text = prop.get("description") or self.resolve(prop).get("description", "")
            if key == "type" and "const" in prop:
                text = TYPE_FIELD_DESCRIPTION
            if not prop.get("description"):
                text = FALLBACK_DESCRIPTIONS.get((model_name, key), text)
            allowed = self.extra_allowed.get((model_name, key), allowed)
            section.rows.append((f"`{key}`", type_text, default, allowed, _md(text)))
        for child_node, child_path, child_title, child_description in children:
            self.add_object(child_node, child_path, child_title, child_description, scope)
        return anchor

    def describe_type(
        self, prop: dict[str, Any], path: str
    ) -> tuple[str, str, tuple[dict[str, Any], str, str, str] | None]:
        """``(type, allowed values, child object to document or None)`` of one property."""
        target = self.resolve(prop)
        if "enum" in target:
            return "string", ", ".join(_value(v) for v in target["enum"]), None
        if "const" in target:
            return "string", _value(target["const"]), None
        if "anyOf" in target:
            options = [o for o in target["anyOf"] if o.get("type") != "null"]
            nullable = len(options) < len(target["anyOf"])
            parts = [self.describe_type(o, path) for o in options]
            text = " or ".join(p[0] for p in parts) + (" or null" if nullable else "")
            return text, ", ".join(p[1] for p in parts if p[1]), None
        if "oneOf" in target and "discriminator" in target:  # qconfig.weight: one member per method
            member = self.resolve(target["oneOf"][0])
            return "mapping", "", (member, path, path, prop.get("description", ""))
        kind = target.get("type")
        if kind == "array":
            items = target.get("items", {})
            if "oneOf" in items:
                mapping = items.get("discriminator", {}).get("mapping", {})
                stage = path.rsplit(".", 1)[-1]
                names = ", ".join(
                    f"[{_value(n)}](#{_anchor(f'spec.{stage}[] type: {n}')})" for n in mapping
                )
                return "list of entries selected by `type`", names, None
            if "$ref" in items and self.resolve(items).get("type") == "object":
                title = f"{path}[]"
                return "list of mappings", "", (items, title, title, "")
            inner, allowed, _ = self.describe_type(items, path + "[]")
            return f"list of {inner}", allowed, None
        if kind == "object" and "properties" in target:
            return "mapping", "", (target, path, path, prop.get("description", ""))
        if kind == "object":
            extra = target.get("additionalProperties", True)
            if isinstance(extra, dict) and extra:
                inner, _, _ = self.describe_type(extra, path)
                return f"mapping of string to {inner}", "", None
            return "mapping (free-form)", "", None
        allowed = _bounds(target)
        if kind == "boolean":
            allowed = "`true`, `false`"
        return str(kind or "any"), allowed, None

    def default(self, prop: dict[str, Any], model_name: str, key: str) -> str:
        if "default" in prop:
            return "`null`" if prop["default"] is None else _value(prop["default"])
        cls = self.classes.get(model_name)
        info = cls.model_fields.get(key) if cls is not None else None
        if info is not None and not info.is_required():
            value = info.get_default(call_default_factory=True)
            if isinstance(value, BaseModel):
                return "(all defaults)"
            return _value(value)
        return ""


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    for word, sign in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ):
        if word in node:
            parts.append(f"{sign} {node[word]}")
    return ", ".join(parts)


def _registry(include_plugins: bool) -> msquant.plugin.ProcessorRegistry:
    registry = msquant.plugin.default_registry()
    if include_plugins:
        return registry
    classes = [registry.get(name) for name in registry.names()]
    return msquant.plugin.ProcessorRegistry(
        c for c in classes if c.__module__.startswith(BUILTIN_PREFIX)
    )


def _table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell or "" for cell in row) + " |" for row in rows]
    return lines


def generate(include_plugins: bool = False) -> str:
    """The Markdown text of the YAML reference."""
    registry = _registry(include_plugins)
    schema = msquant.config_json_schema(registry)
    config_model = build_config_model(registry)
    classes = _model_classes(config_model)
    builder = _Builder(schema, classes)

    builder.add_object(schema, "", ROOT_TITLE, "The whole config file.")
    for stage in ("process", "save"):
        for name in registry.names(stage):
            config_cls = registry.get(name).config_class
            classes.update(_model_classes(config_cls))
            sub = config_cls.model_json_schema()
            builder.defs.update(sub.get("$defs", {}))
            path = f"spec.{stage}[]"
            builder.add_object(sub, path, f"{path} type: {name}", config_cls.__doc__ or "", name)

    lines = [
        "# YAML reference",
        "",
        f"<!-- Generated by {REGENERATE} from msquant's config schema. Do not edit by hand. -->",
        "",
        "Every key msquant accepts in a quantization config, generated from the same JSON Schema",
        "that `msquant schema` prints. The format is msModelSlim's v1 format (`apiversion:",
        "modelslim_v1`), so msModelSlim YAML files validate unchanged. Unknown keys are errors",
        "everywhere except in free-form mappings and at the top level, where msModelSlim's",
        "configs define YAML anchors beside `spec` (`default_w8a8: &w8a8 {...}`): other top-level",
        "keys are ignored, as msModelSlim ignores them (one that looks like a misspelt `spec` is",
        "warned about). `msquant validate FILE.yaml` reports every problem of the file in one",
        "pass, each with its YAML path. Module-name patterns (`include`, `exclude`) are",
        "msModelSlim's globs: `*`, `?`, `[...]`, case-sensitive, on the full module name, with",
        "braces expanded (`model.layers.{0,1}.mlp.down_proj`, `model.layers.{0..3}.*`); a",
        "pattern that matches no layer is warned about. Worked examples: [examples](examples.md).",
        "",
        "## Processors",
        "",
        "Entries of `spec.process` and `spec.save` are selected by their `type` key.",
        "",
    ]
    processor_rows = []
    for name in registry.names():
        cls = registry.get(name)
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        anchor = _anchor(f"spec.{cls.stage}[] type: {name}")
        processor_rows.append((f"[`{name}`](#{anchor})", f"`spec.{cls.stage}`", _md(summary)))
    lines += _table(processor_rows, ("type", "section", "what it does"))
    lines += ["", "## Keys", ""]
    for section in builder.sections:
        heading = section.title if section.title == ROOT_TITLE else f"`{section.title}`"
        lines += [f'<a id="{section.anchor}"></a>', "", f"### {heading}", ""]
        if section.description:
            lines += [section.description, ""]
        lines += _table(section.rows, ("key", "type", "default", "allowed values", "description"))
        lines.append("")
    lines += _methods_section()
    return "\n".join(lines).rstrip() + "\n"


def _methods_section() -> list[str]:
    lines = [
        "## Weight methods",
        "",
        "`qconfig.weight.method` selects the algorithm; `qconfig.weight.ext` holds its options,",
        "validated against the method's option model below (an unknown key is an error naming",
        "the valid ones). Only the listed `(dtype, scope)` combinations are implemented; others",
        "fail validation with the list of valid ones. Methods are plugins: see",
        "[adding a method](developer/add-method.md).",
        "",
    ]
    rows = []
    methods = [METHODS.get(name) for name in METHODS.names()]
    for method in methods:
        rows.append(
            (
                f"[`{method.name}`](#{_anchor('ext ' + method.name)})",
                _md(method.summary),
                ", ".join(_value(d.value) for d in sorted(method.dtypes, key=lambda d: d.value)),
                ", ".join(_value(s.value) for s in sorted(method.scopes, key=lambda s: s.value)),
                "yes" if method.calibrated else "no",
            )
        )
    lines += _table(rows, ("method", "summary", "dtype", "scope", "calibrated"))
    lines.append("")
    for method in methods:
        sub = method.options_class.model_json_schema()
        builder = _Builder(sub, _model_classes(method.options_class))
        title = f"ext {method.name}"
        builder.add_object(sub, "spec.process[].qconfig.weight.ext", title)
        section = builder.sections[0]
        lines += [f'<a id="{section.anchor}"></a>', ""]
        lines += [f"### `qconfig.weight.ext` with `method: {method.name}`", ""]
        if section.description:
            lines += [section.description, ""]
        lines += _table(section.rows, ("key", "type", "default", "allowed values", "description"))
        lines.append("")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """Command-line parser of this script."""
    parser = argparse.ArgumentParser(description="Generate docs/yaml-reference.md from the schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help="file to write or check"
    )
    parser.add_argument(
        "--include-plugins", action="store_true", help="also document third-party processors"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Script entry point; returns the exit code (0 ok, 1 out of date in --check mode, 2 bad use)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    text = generate(args.include_plugins)
    output: Path = args.output
    if args.check:
        current = output.read_text(encoding="utf-8") if output.is_file() else None
        if current != text:
            state = "missing" if current is None else "out of date"
            logger.error("%s is %s; regenerate it with: %s", output, state, REGENERATE)
            return EXIT_STALE
        logger.info("%s is up to date", output)
        return EXIT_OK
    if not output.parent.is_dir():
        logger.error("folder %s does not exist", output.parent)
        return EXIT_USER
    output.write_text(text, encoding="utf-8")
    logger.info("wrote %s", output)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
