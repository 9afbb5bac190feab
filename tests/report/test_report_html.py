"""``msquant report``: the run report as a table or a self-contained HTML page.

The page of a real tiny GPTQ run is checked twice: parsed as written (every module's bars and
row, bar heights proportional to the errors, escaping, no network references) and loaded in a
real headless browser (Debian's ``chromium``), whose DOM after the scripts ran and whose
screenshot are checked. Without a browser those tests are skipped, unless ``CI_REQUIRE_BROWSER=1``
(set by ``.ci/run``) makes them fail.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from conftest import CALIB_TXT, CliResult

import msquant
from msquant.report.document import load_report, report_from_dict
from msquant.report.html.page import render_html, write_html
from msquant.report.run_report import REPORT_FILE
from msquant.report.table import render_report

SEQLEN = 64
HOSTILE_NAME = 'model.layers.0.mlp.<script>alert("x")</script>"><img src=x onerror=alert(1)>'
HOSTILE_PATH = '/models/"><img src=x onerror=alert(2)><b>bold</b>'
SCREEN = (1200, 1600)


# --- a DOM good enough for checking the page ---------------------------------------------------


@dataclass
class Node:
    """One element: tag, attributes (unescaped), ancestors and its own text."""

    tag: str
    attrs: dict[str, str]
    parents: tuple[Node, ...]
    text: str = ""
    classes: set[str] = field(default_factory=set)

    def within(self, tag: str, element_id: str) -> bool:
        """Whether an ancestor is ``tag#element_id``."""
        return any(p.tag == tag and p.attrs.get("id") == element_id for p in self.parents)


class _Collector(HTMLParser):
    VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.nodes: list[Node] = []
        self.stack: list[Node] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        node = Node(tag, values, tuple(self.stack), classes=set(values.get("class", "").split()))
        self.nodes.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, -1, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        if self.stack:
            self.stack[-1].text += data


def parse(page: str) -> list[Node]:
    collector = _Collector()
    collector.feed(page)
    collector.close()
    return collector.nodes


def select(
    nodes: list[Node], tag: str, cls: str | None = None, within: str | None = None, **attrs: str
) -> list[Node]:
    """Elements ``tag.cls[attr=value]`` inside ``svg#within`` / ``table#within`` / any ``#within``."""
    found = []
    for node in nodes:
        if node.tag != tag or (cls is not None and cls not in node.classes):
            continue
        if within is not None and not any(p.attrs.get("id") == within for p in node.parents):
            continue
        if all(node.attrs.get(key.replace("_", "-")) == value for key, value in attrs.items()):
            found.append(node)
    return found


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> msquant.QuantizeResult:
    """A real GPTQ run (int4 group 32) with calibration and a perplexity evaluation."""
    root = tmp_path_factory.mktemp("report_html")
    text = root / "text.txt"
    text.write_text(CALIB_TXT.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    weight = {"dtype": "int4", "scope": "per_group", "symmetric": False, "method": "gptq"}
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": {**weight, "ext": {"group_size": 32}}},
                }
            ],
            "save": [{"type": "ascendv1_saver"}],
        },
    }
    return msquant.quantize(
        tiny_llama, root / "out", config, calib_path=CALIB_TXT, max_calib_tokens=32,
        progress=False, eval_data=text, eval_seqlen=SEQLEN,
    )  # fmt: skip


@pytest.fixture(scope="module")
def report(run: msquant.QuantizeResult) -> dict[str, Any]:
    return load_report(run.save_path / REPORT_FILE)


def _hostile(report: dict[str, Any]) -> dict[str, Any]:
    """The report with an HTML-injecting module name and model path."""
    data = copy.deepcopy(report)
    data["model_path"] = HOSTILE_PATH
    data["modules"].append({**data["modules"][0], "name": HOSTILE_NAME})
    return data


# --- the page as written -----------------------------------------------------------------------


def test_every_module_has_its_bars_and_row(report: dict[str, Any]) -> None:
    nodes = parse(render_html(report))
    names = [m["name"] for m in report["modules"]]
    assert len(names) == 14
    for name in names:
        for chart in ("layer-errors", "type-errors"):
            (bar,) = select(nodes, "rect", "bar", within=chart, data_module=name)
            module = next(m for m in report["modules"] if m["name"] == name)
            assert float(bar.attrs["data-value"]) == module["output_error"]
            (ref,) = select(nodes, "rect", "ref", within=chart, data_module=name)
            assert float(ref.attrs["data-value"]) == module["rtn_output_error"]
            assert f"type-{name.rpartition('.')[2]}" in bar.classes
        assert len(select(nodes, "rect", "bar", within="layer-damping", data_module=name)) == 1
        (row,) = select(nodes, "tr", within="modules", data_module=name)
    times = select(nodes, "rect", "time", within="layer-time")
    assert [n.attrs["data-layer"] for n in times] == ["0", "1"]
    assert [float(n.attrs["data-value"]) for n in times] == [
        layer["seconds"] for layer in report["layers"]
    ]
    items = select(nodes, "li", within="legend")
    legend = [n.attrs["data-type"] for n in items if "data-type" in n.attrs]
    assert legend == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_bars_are_grouped_by_layer_and_type_and_sized_by_value(report: dict[str, Any]) -> None:
    nodes = parse(render_html(report))
    for chart, key in (("layer-errors", "0"), ("type-errors", "q_proj")):
        (group,) = select(nodes, "g", "group", within=chart, data_group=key)
        members = [n for n in select(nodes, "rect", "bar", within=chart) if group in n.parents]
        expected = (
            [m["name"] for m in report["modules"] if m["name"].startswith("model.layers.0.")]
            if key == "0"
            else ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
        )
        assert [n.attrs["data-module"] for n in members] == expected
    bars = select(nodes, "rect", "bar", within="layer-errors")
    refs = select(nodes, "rect", "ref", within="layer-errors")
    values = [float(n.attrs["data-value"]) for n in bars + refs]
    heights = [float(n.attrs["height"]) for n in bars + refs]
    per_unit = heights[0] / values[0]
    for value, height in zip(values, heights, strict=True):  # one linear scale, 0 at the axis
        assert height == pytest.approx(value * per_unit, abs=0.02)
    bottoms = {round(float(n.attrs["y"]) + float(n.attrs["height"]), 1) for n in bars + refs}
    assert len(bottoms) == 1


def test_summary_and_table_show_the_report(report: dict[str, Any]) -> None:
    nodes = parse(render_html(report))
    summary = {n.attrs["data-key"]: n.text for n in select(nodes, "dd", within="summary")}
    assert summary["model_path"] == report["model_path"]
    assert summary["config_sha256"] == report["config_sha256"]
    assert summary["modules"] == "14" and summary["layers"] == "2"
    assert f"msquant {msquant.__version__}" in summary["versions"]
    assert summary["perplexity"].startswith(f"{report['evaluation']['ppl']:.6g} on ")
    module = report["modules"][3]
    (row,) = select(nodes, "tr", within="modules", data_module=module["name"])
    cells = [n for n in select(nodes, "td") if row in n.parents]
    keys = [n.attrs["data-key"] for n in select(nodes, "th", within="modules")]
    by_key = dict(zip(keys, cells, strict=True))
    assert by_key["name"].text == module["name"]
    assert float(by_key["output_error"].attrs["data-value"]) == module["output_error"]
    ratio = module["output_error"] / module["rtn_output_error"]
    assert float(by_key["error_ratio"].attrs["data-value"]) == pytest.approx(ratio, rel=1e-12)
    assert by_key["group_size"].text == "32" and by_key["symmetric"].text == "no"


def test_text_from_the_report_is_escaped(report: dict[str, Any]) -> None:
    page = render_html(_hostile(report))
    assert "<img" not in page and "<b>" not in page
    assert page.count("<script>") == 1  # the page's own sorting script only
    nodes = parse(page)
    assert not select(nodes, "img") and not select(nodes, "b")
    (bar,) = select(nodes, "rect", "bar", within="layer-errors", data_module=HOSTILE_NAME)
    assert bar.attrs["data-module"] == HOSTILE_NAME  # escaped in the page, intact in the DOM
    (title,) = select(nodes, "title")[:1]
    assert title.text == f"msquant report: {HOSTILE_PATH}"


def test_page_is_self_contained_and_deterministic(report: dict[str, Any]) -> None:
    page = render_html(report)
    assert page == render_html(copy.deepcopy(report))
    nodes = parse(page)
    assert not [n for n in nodes if {"src", "href"} & set(n.attrs)]
    without_namespace = page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "http://" not in without_namespace and "https://" not in without_namespace
    (csp,) = select(nodes, "meta", http_equiv="Content-Security-Policy")
    assert csp.attrs["content"].startswith("default-src 'none'")


@pytest.mark.parametrize("document", [{"modules": []}, {}, {"modules": "bad", "layers": [1]}])
def test_empty_reports_render_with_messages(document: dict[str, Any]) -> None:
    nodes = parse(render_html(document))
    assert not select(nodes, "rect")
    for chart in ("layer-errors", "type-errors", "layer-damping", "layer-time"):
        (svg,) = select(nodes, "svg", id=chart)
        assert [n.text for n in nodes if "empty" in n.classes and svg in n.parents]
    (row,) = select(nodes, "tr", "empty", within="modules")
    assert "no quantized modules" in "".join(n.text for n in nodes if row in n.parents)


def test_round_to_nearest_report_has_rows_but_no_error_bars(report: dict[str, Any]) -> None:
    data = copy.deepcopy(report)
    for module in data["modules"]:
        for key in ("output_error", "rtn_output_error", "percdamp", "damp_retries", "gptq_loss"):
            module[key] = None
    nodes = parse(render_html(data))
    assert not select(nodes, "rect", within="layer-errors")
    (message,) = select(nodes, "text", "empty", within="layer-errors")
    assert "round-to-nearest runs use no calibration data" in message.text
    assert len(select(nodes, "tr", within="modules")) == 1 + 14  # header + modules
    assert len(select(nodes, "rect", "time", within="layer-time")) == 2


def test_damping_retries_are_labelled(report: dict[str, Any]) -> None:
    data = copy.deepcopy(report)
    data["modules"][5].update(percdamp=0.1, damp_retries=2)
    nodes = parse(render_html(data))
    name = data["modules"][5]["name"]
    (label,) = select(nodes, "text", "bar-label", within="layer-damping")
    assert label.attrs["data-module"] == name and label.text == "+2"
    (summary,) = select(nodes, "dd", data_key="damp_retries")
    assert summary.text == "2"


def test_report_from_dict_round_trips(run: msquant.QuantizeResult, report: dict[str, Any]) -> None:
    assert report_from_dict(report).to_dict() == run.report.to_dict()
    assert report_from_dict({"modules": [], "unknown": 1}).to_dict()["modules"] == []


# --- writing and the command line --------------------------------------------------------------


def test_cli_prints_the_table_or_writes_the_page(
    run: msquant.QuantizeResult,
    report: dict[str, Any],
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    path = run.save_path / REPORT_FILE
    table = run_cli("report", path)
    assert table.code == 0, table.err
    assert table.out == render_report(run.report) + "\n"
    assert "perplexity" in table.out.splitlines()[-1]
    out = tmp_path / "page.html"
    out.write_text("old page", encoding="utf-8")
    written = run_cli("report", path, "--html", out)
    assert written.code == 0, written.err
    assert out.read_text(encoding="utf-8") == render_html(report)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]  # no temporary left


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.json", None, "cannot read report {path}"),
        ("bad.json", "{", "report {path} is not valid JSON"),
        ("list.json", "[]", "{path} is not a run report"),
    ],
)
def test_cli_bad_report_exits_2(
    name: str,
    content: str | None,
    message: str,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    result = run_cli("report", path, "--html", tmp_path / "out.html")
    assert result.code == 2
    assert message.format(path=path) in result.err and "Traceback" not in result.err
    assert not (tmp_path / "out.html").exists()


def test_unwritable_page_is_an_input_error_and_leaves_nothing(
    report: dict[str, Any], tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    with pytest.raises(msquant.MsquantInputError, match="cannot write"):
        write_html(report, tmp_path / "missing" / "page.html")
    target = tmp_path / "folder.html"
    target.mkdir()  # replacing a folder by a file fails after the temporary file was written
    with pytest.raises(msquant.MsquantInputError, match=f"cannot write {target}"):
        write_html(report, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.html"]


# --- in a real browser -------------------------------------------------------------------------


def _browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    found = found or shutil.which("google-chrome")
    if found is None:
        if os.environ.get("CI_REQUIRE_BROWSER") == "1":
            pytest.fail("CI_REQUIRE_BROWSER=1 but no chromium / google-chrome on PATH")
        pytest.skip("no headless browser (chromium) installed")
    return found


def _chromium(page: Path, profile: Path, *args: str, fragment: str = "") -> str:
    """Run the browser headless on ``page``; its standard output."""
    command = [
        _browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--hide-scrollbars", "--force-device-scale-factor=1",
        f"--user-data-dir={profile}", *args, page.as_uri() + fragment,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_browser_renders_the_page(report: dict[str, Any], tmp_path: Path) -> None:
    page = write_html(_hostile(report), tmp_path / "report.html")
    dom = _chromium(page, tmp_path / "profile", "--dump-dom", fragment="#sort=-output_error")
    nodes = parse(dom)
    (table,) = select(nodes, "table", id="modules")
    assert table.attrs.get("data-sortable") == "true"  # the script ran
    assert table.attrs.get("data-sorted-by") == "-output_error"
    rows = [n.attrs["data-module"] for n in select(nodes, "tr", within="modules") if n.attrs]
    errors = {m["name"]: m["output_error"] for m in _hostile(report)["modules"]}
    assert sorted(rows) == sorted(errors)
    assert [errors[name] for name in rows] == sorted(errors.values(), reverse=True)
    (header,) = select(nodes, "th", within="modules", data_key="output_error")
    assert header.attrs["aria-sort"] == "descending"
    for name in errors:
        assert len(select(nodes, "rect", "bar", within="layer-errors", data_module=name)) == 1
        assert len(select(nodes, "rect", "bar", within="type-errors", data_module=name)) == 1
    assert len(select(nodes, "rect", "time", within="layer-time")) == 2
    assert not select(nodes, "img") and len(select(nodes, "script")) == 1  # nothing injected


def test_browser_screenshot_is_a_picture(report: dict[str, Any], tmp_path: Path) -> None:
    page = write_html(report, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    size = f"--window-size={SCREEN[0]},{SCREEN[1]}"
    _chromium(page, tmp_path / "profile", f"--screenshot={shot}", size)
    width, height, pixels = _png(shot.read_bytes())
    assert (width, height) == SCREEN
    assert len(set(pixels)) > 32, "the screenshot is blank"


def _png(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and the decompressed (still filtered) scanlines of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, width, height, idat = 8, 0, 0, b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    return width, height, zlib.decompress(idat)


def test_json_of_the_page_fixture_is_a_run_report(report: dict[str, Any]) -> None:
    """The fixture really is what ``quant`` wrote: GPTQ errors and an evaluation are present."""
    assert json.loads(json.dumps(report)) == report
    assert all(m["method"] == "gptq" and m["output_error"] > 0 for m in report["modules"])
    assert report["evaluation"]["seqlen"] == SEQLEN and report["evaluation"]["ppl"] > 1


def test_report_from_dict_skips_invalid_records() -> None:
    """A document with values of the wrong type (another tool, an edited file) still loads:
    invalid run-wide values keep their defaults, invalid records are skipped, valid ones kept."""
    module = {"name": "m", "method": "gptq", "bits": 4, "group_size": None, "symmetric": True}
    loaded = report_from_dict(
        {
            "model_type": "llama",
            "calibration_samples": "many",
            "modules": [{**module, "name": "bad", "bits": "four"}, module, "not an object"],
            "layers": [{"index": 0}, {"index": 1, "name": "model.layers.1", "seconds": 0.5}],
            "evaluation": {"ppl": 3.0},
        }
    )
    assert loaded.model_type == "llama" and loaded.calibration_samples == 0
    assert [m.name for m in loaded.modules] == ["m"] and loaded.modules[0].bits == 4
    assert [(t.index, t.name) for t in loaded.layers] == [(1, "model.layers.1")]
    assert loaded.evaluation is None


def test_quantized_kv_caches_are_summarized(report: dict[str, Any]) -> None:
    """A run that quantizes KV caches (``kv_caches``) gets a summary row and a line in the text
    table; a run without them has neither."""
    assert "kv_caches" not in {
        n.attrs["data-key"] for n in select(parse(render_html(report)), "dd", within="summary")
    }
    assert "KV cache" not in render_report(report_from_dict(report))
    cache = {"scheme": "C8", "channels": 16, "tokens": 40, "key_absmax": 2.5, "value_absmax": 0.5}
    names = [f"model.layers.{i}.self_attn" for i in range(6)]
    data = {
        **copy.deepcopy(report),
        "kv_caches": [{**cache, "name": n, "tensors": []} for n in names],
    }
    data["kv_caches"][3]["key_absmax"] = 7.25
    summary = {
        n.attrs["data-key"]: n.text
        for n in select(parse(render_html(data)), "dd", within="summary")
    }
    assert summary["kv_caches"] == (
        "C8 on 6 attention(s): model.layers.0.self_attn ... model.layers.5.self_attn; "
        "largest |key| 7.25, |value| 0.5"
    )
    text = render_report(report_from_dict(data))
    assert "KV cache C8 on 6 attention(s)" in text.splitlines()
