"""The layer-wise runner feeds each decoder layer exactly what the full model would."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

import msquant
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_causal_lm, load_tokenizer
from msquant.model.layers import find_decoder_layers
from msquant.plugin import DecoderLayer, Processor, ProcessorConfig, RunContext
from msquant.plugin.devices import get_backend
from msquant.run.capture import batch_samples, capture_layer_inputs
from msquant.run.runner import run_layer_wise

CALIB = Path(__file__).parents[1] / "data" / "calib.txt"


class ProbeConfig(ProcessorConfig):
    type: Literal["probe", "counter"] = "probe"


class Probe(Processor):
    """Records the hidden states entering and leaving each layer during the calibration forward."""

    type_name = "probe"
    config_class = ProbeConfig
    requires_calibration = True

    def setup(self, ctx: RunContext) -> None:
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.events: list[str] = ["setup"]

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self.events.append(f"before:{layer.index}")

        def pre(
            module: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]
        ) -> None:
            self.inputs.setdefault(layer.index, []).append(args[0].clone())

        def post(module: nn.Module, args: object, kwargs: object, out: object) -> None:
            tensor = out[0] if isinstance(out, tuple) else out
            assert isinstance(tensor, torch.Tensor)
            self.outputs.setdefault(layer.index, []).append(tensor.clone())

        self.handles = [
            layer.module.register_forward_pre_hook(pre, with_kwargs=True),
            layer.module.register_forward_hook(post, with_kwargs=True),
        ]

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for handle in self.handles:
            handle.remove()
        self.events.append(f"after:{layer.index}")

    def finalize(self, ctx: RunContext) -> None:
        self.events.append("finalize")


ARCH_CASES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param(
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        id="qwen2-mixed-sliding",
    ),
    pytest.param("qwen3", {}, id="qwen3"),
    pytest.param("mistral", {}, id="mistral-sliding"),
]


@pytest.mark.parametrize(("arch", "overrides"), ARCH_CASES)
def test_layer_inputs_match_full_forward(
    arch: str, overrides: dict[str, object], tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(arch, num_layers=3, **overrides)
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(read_calibration_texts(CALIB)[:3], load_tokenizer(model_dir))
    assert all(s.shape[1] > 6 for s in samples)  # longer than the sliding window
    with torch.no_grad():
        reference = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    layers = find_decoder_layers(model)
    assert [layer.name for layer in layers] == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
    ]
    probe = Probe(ProbeConfig())
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), layers)
    run_layer_wise(ctx, [probe], samples, progress=False)

    assert probe.events == [
        "setup",
        "before:0",
        "after:0",
        "before:1",
        "after:1",
        "before:2",
        "after:2",
        "finalize",
    ]
    for i in range(3):
        for s, ref in enumerate(reference):
            torch.testing.assert_close(probe.inputs[i][s], ref[i], rtol=1e-5, atol=1e-5)
            if i < 2:  # the last hidden state reported by HF is after the final norm
                torch.testing.assert_close(probe.outputs[i][s], ref[i + 1], rtol=1e-5, atol=1e-5)
    # the layer list was restored after capture
    assert all(
        type(layer.module).__name__.endswith("DecoderLayer") for layer in find_decoder_layers(model)
    )


def test_equal_length_samples_run_as_one_batch(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Samples of one length are stacked; each row equals that sample's own forward (sliding
    window and full attention layers mixed, so both masks must be batched correctly)."""
    model_dir = tiny_model_factory(
        "qwen2", num_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(read_calibration_texts(CALIB)[:5], load_tokenizer(model_dir), 12)
    assert {s.shape[1] for s in samples} == {12}
    with torch.no_grad():
        reference = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    probe = Probe(ProbeConfig())
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, [probe], samples, progress=False)
    for i in range(3):
        (batch,) = probe.inputs[i]
        assert batch.shape == (5, 12, 64)
        for row, ref in enumerate(reference):
            torch.testing.assert_close(batch[row : row + 1], ref[i], rtol=1e-5, atol=1e-5)


def test_batch_samples_groups_equal_lengths_within_the_token_budget() -> None:
    def ids(length: int, value: int) -> torch.Tensor:
        return torch.full((1, length), value)

    samples = [ids(4, 0), ids(3, 1), ids(4, 2), ids(4, 3), ids(9, 4), ids(3, 5), ids(4, 6)]
    batches = batch_samples(samples, max_batch_tokens=12)
    # length 4: three per batch (12 tokens); length 3: both; a sample over the budget runs alone
    assert [b[:, 0].tolist() for b in batches] == [[0, 2, 3], [1, 5], [4], [6]]
    assert sum(int(b.shape[0]) for b in batches) == len(samples)
    assert [b.shape[0] for b in batch_samples(samples, max_batch_tokens=1)] == [1] * 7
    with pytest.raises(ValueError, match=r"\[1, seq\] tensors, got \(2, 4\)"):
        batch_samples([torch.zeros(2, 4)])


def test_data_free_processors_skip_calibration(tiny_llama: Path, tmp_path: Path) -> None:
    model = load_causal_lm(tiny_llama)
    layers = find_decoder_layers(model)
    calls: list[int] = []

    class Counter(Processor):
        type_name = "counter"
        config_class = ProbeConfig

        def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
            layer.module.register_forward_hook(lambda *a: calls.append(layer.index))

    ctx = RunContext(model, tiny_llama, tmp_path, get_backend("cpu"), layers)
    run_layer_wise(ctx, [Counter(ProbeConfig())], None, progress=False)
    assert calls == []  # no forward ran


def test_decoder_layers_found_generically() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.proj = nn.Linear(4, 64)

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.backbone = nn.Module()
            self.backbone.blocks = nn.ModuleList([Block() for _ in range(3)])

    layers = find_decoder_layers(Toy())
    assert [layer.name for layer in layers] == [
        "backbone.blocks.0",
        "backbone.blocks.1",
        "backbone.blocks.2",
    ]
    with pytest.raises(msquant.ModelLoadError, match="cannot find the decoder layers"):
        find_decoder_layers(nn.Sequential(nn.Linear(2, 2)))


class PassProbe(Probe):
    """Asks for ``passes`` calibration passes over layer 1 only, recording the events and the
    layer-1 forwards of each pass."""

    def __init__(self, passes: int) -> None:
        super().__init__(ProbeConfig())
        self.passes = passes

    def calibration_passes(self, layer: DecoderLayer) -> int:
        return self.passes if layer.index == 1 else 1

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        self.events.append(f"pass:{layer.index}.{index}")

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        self.events.append(f"done:{layer.index}.{index}")


def test_layers_get_the_most_passes_any_processor_asks_for(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Extra passes repeat the same inputs through the layer; the first one's outputs feed the
    next layer, so the next layer's inputs are those of a single-pass run."""
    model_dir = tiny_model_factory("llama", num_layers=3)
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(read_calibration_texts(CALIB)[:2], load_tokenizer(model_dir))
    with torch.no_grad():
        reference = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    many, one = PassProbe(3), PassProbe(1)
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, [one, many], samples, progress=False)

    batches = len(batch_samples(samples))
    assert batches == len(samples)  # samples of different lengths: one batch each
    assert [e for e in many.events if ":1" in e] == [
        "before:1",
        "pass:1.0", "done:1.0", "pass:1.1", "done:1.1", "pass:1.2", "done:1.2",
        "after:1",
    ]  # fmt: skip
    assert one.events == many.events  # every processor hears of every pass
    assert len(many.inputs[0]) == batches and len(many.inputs[1]) == 3 * batches
    for index in range(3):  # every pass over layer 1 saw the same inputs
        for batch in range(batches):
            torch.testing.assert_close(
                many.inputs[1][index * batches + batch], many.inputs[1][batch], rtol=0, atol=0
            )
    for i, sample_states in enumerate(reference):  # layer 2 sees the float model's states
        torch.testing.assert_close(many.inputs[2][i], sample_states[2], rtol=1e-5, atol=1e-5)


class ChangingProbe(Probe):
    """Zeroes layer 1's ``down_proj`` after calibration pass 0 (``in_pass``) or in
    ``after_layer``, and says whether the next layer is calibrated on the changed outputs."""

    def __init__(self, on_quantized: bool, in_pass: bool) -> None:
        super().__init__(ProbeConfig())
        self.calibrate_on_quantized = on_quantized
        self.in_pass = in_pass

    def calibration_passes(self, layer: DecoderLayer) -> int:
        return 2 if layer.index == 1 and self.in_pass else 1

    def _zero(self, layer: DecoderLayer) -> None:
        if layer.index == 1:
            with torch.no_grad():
                layer.module.mlp.down_proj.weight.zero_()

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        if self.in_pass and index == 0:
            self._zero(layer)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        super().after_layer(ctx, layer)
        if not self.in_pass:
            self._zero(layer)


@pytest.mark.parametrize("in_pass", [False, True], ids=["after_layer", "after_pass"])
@pytest.mark.parametrize("on_quantized", [False, True], ids=["float", "quantized"])
def test_next_layer_inputs_are_float_or_processed_outputs(
    on_quantized: bool,
    in_pass: bool,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """Layer 2 is calibrated on the float model's states (the first pass's outputs, taken before
    any processor changed layer 1), or with ``calibrate_on_quantized`` on the outputs of layer 1
    as the processors left it (one more forward after ``after_layer``)."""
    model_dir = tiny_model_factory("llama", num_layers=3)
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(read_calibration_texts(CALIB)[:2], load_tokenizer(model_dir))
    with torch.no_grad():
        floating = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    probe = ChangingProbe(on_quantized, in_pass)
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, [probe], samples, progress=False)
    assert not bool(model.model.layers[1].mlp.down_proj.weight.any())  # the change happened
    with torch.no_grad():
        changed = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    expected, other = (changed, floating) if on_quantized else (floating, changed)
    # the probe's hooks (removed in after_layer) saw each calibration pass over layer 1
    assert len(probe.inputs[1]) == len(samples) * (2 if in_pass else 1)
    for i, states in enumerate(expected):
        torch.testing.assert_close(probe.inputs[2][i], states[2], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(probe.inputs[2][i], other[i][2], rtol=1e-3, atol=1e-3)


def test_quantized_calibration_needs_a_calibrating_processor() -> None:
    """``calibrate_on_quantized`` counts only for processors that calibrate."""
    from msquant.run.runner import calibrates_on_quantized

    asking = Probe(ProbeConfig())
    asking.calibrate_on_quantized = True
    idle = Probe(ProbeConfig())
    idle.requires_calibration = False
    idle.calibrate_on_quantized = True
    assert calibrates_on_quantized([Probe(ProbeConfig()), asking])
    assert not calibrates_on_quantized([Probe(ProbeConfig()), idle])


def test_layer_segments_split_before_a_processor_observing_the_finished_layer() -> None:
    """A calibrating processor that sets ``calibrates_after_previous`` starts a segment, unless it
    is first or calibrates nothing."""
    from msquant.run.runner import layer_segments

    def probe(after_previous: bool, calibrates: bool = True) -> Probe:
        made = Probe(ProbeConfig())
        made.calibrates_after_previous, made.requires_calibration = after_previous, calibrates
        return made

    first, observer, idle, plain = probe(False), probe(True), probe(True, False), probe(False)
    assert layer_segments([first, observer, plain]) == [[first], [observer, plain]]
    assert layer_segments([observer, first]) == [[observer, first]]
    assert layer_segments([first, idle]) == [[first, idle]]
    assert layer_segments([first, plain]) == [[first, plain]]


def test_a_processor_after_previous_observes_the_finished_layer(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """With ``calibrates_after_previous``, the observer's hooks (registered in its
    ``before_layer``) see layer 1 after the processor before it changed it in ``after_layer``, and
    layer 2 is calibrated on those changed outputs (msModelSlim's order); the processor before it
    still sees the float layer."""
    model_dir = tiny_model_factory("llama", num_layers=3)
    model = load_causal_lm(model_dir)
    samples = tokenize_samples(read_calibration_texts(CALIB)[:2], load_tokenizer(model_dir))
    changing = ChangingProbe(on_quantized=False, in_pass=False)
    observer = Probe(ProbeConfig())
    observer.calibrates_after_previous = True
    with torch.no_grad():
        floating = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), find_decoder_layers(model))
    run_layer_wise(ctx, [changing, observer], samples, progress=False)
    with torch.no_grad():
        changed = [model(input_ids=s, output_hidden_states=True).hidden_states for s in samples]
    assert observer.events[1:4] == ["before:0", "after:0", "before:1"]
    assert changing.events[1:3] == ["before:0", "after:0"]
    for i in range(len(samples)):
        torch.testing.assert_close(changing.outputs[1][i], floating[i][2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(observer.outputs[1][i], changed[i][2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(observer.inputs[2][i], changed[i][2], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(changed[i][2], floating[i][2], rtol=1e-3, atol=1e-3)


class HandOnProbe(Processor):
    """Records each layer's whole output tuple and the ``prev_topk_indices`` it was called with."""

    type_name = "probe"
    config_class = ProbeConfig
    requires_calibration = True

    def setup(self, ctx: RunContext) -> None:
        self.taken: dict[int, list[object]] = {}
        self.returned: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self.handles = _record_hand_on(layer.index, layer.module, self.taken, self.returned)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for handle in self.handles:
            handle.remove()


def _record_hand_on(
    index: int,
    module: nn.Module,
    taken: dict[int, list[object]],
    returned: dict[int, list[tuple[torch.Tensor, ...]]],
) -> list[torch.utils.hooks.RemovableHandle]:
    def pre(module: nn.Module, args: object, kwargs: dict[str, object]) -> None:
        taken.setdefault(index, []).append(kwargs.get("prev_topk_indices"))

    def post(module: nn.Module, args: object, kwargs: object, out: object) -> None:
        assert isinstance(out, tuple)
        returned.setdefault(index, []).append(tuple(t.clone() for t in out))

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    ]


def test_glm5_layers_get_the_state_the_layer_before_hands_on(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """GLM-5 (transformers' ``glm_moe_dsa``): each decoder layer returns its DSA indexer's top-k
    token indices beside the hidden states, and the model body hands them to the next layer as
    ``prev_topk_indices`` (a ``shared`` indexer layer attends over them). In float64, the
    layer-by-layer run gives every layer the hidden states and the indices the whole model's
    forward gives it, and each layer returns what it returns there."""
    model_dir = tiny_model_factory("glm_moe_dsa", num_layers=6)
    model = load_causal_lm(model_dir, experts_implementation="eager").to(torch.float64)
    assert model.config.indexer_types == ["full", "full", "shared", "full", "shared", "full"]
    samples = tokenize_samples(read_calibration_texts(CALIB)[:3], load_tokenizer(model_dir))
    assert all(s.shape[1] > model.config.index_topk for s in samples)  # the indexer selects
    taken: dict[int, list[object]] = {}
    returned: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    layers = find_decoder_layers(model)
    handles = [
        h for layer in layers for h in _record_hand_on(layer.index, layer.module, taken, returned)
    ]
    with torch.no_grad():
        for sample in samples:
            model(input_ids=sample)
    for handle in handles:
        handle.remove()
    probe = HandOnProbe(ProbeConfig())
    ctx = RunContext(model, model_dir, tmp_path, get_backend("cpu"), layers)
    run_layer_wise(ctx, [probe], samples, progress=False)

    assert len(batch_samples(samples)) == len(samples)  # one sample per batch, as above
    for i in range(6):
        for s in range(len(samples)):
            hidden, indices = probe.returned[i][s]
            torch.testing.assert_close(hidden, returned[i][s][0], rtol=1e-12, atol=1e-12)
            assert torch.equal(indices, returned[i][s][1])
            if i == 0:
                assert probe.taken[i][s] is None and taken[i][s] is None
            else:
                assert isinstance(probe.taken[i][s], torch.Tensor)
                assert torch.equal(probe.taken[i][s], returned[i - 1][s][1])
            if model.config.indexer_types[i] == "shared":  # reused, not recomputed
                assert torch.equal(indices, returned[i - 1][s][1])
    # the selection differs from layer to layer: a run handing nothing on would differ
    assert not torch.equal(returned[1][0][1], returned[3][0][1])


def test_glm5_w8a8_dynamic_exports_and_verifies(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A W8A8_DYNAMIC run of the tiny GLM-5 (its attention linears, the indexer's included)
    exports, and ``msquant verify`` reloads the export and checks its forward."""
    model_dir = tiny_model_factory("glm_moe_dsa", num_layers=4)
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {
                "act": {"scope": "per_token", "dtype": "int8", "symmetric": True,
                        "method": "minmax"},
                "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True,
                           "method": "minmax"},
            }, "include": ["*self_attn*", "*mlp*"]}],
            "save": [{"type": "ascendv1_saver", "part_file_size": 0}],
        },
    }  # fmt: skip
    out = tmp_path / "out"
    msquant.quantize(model_dir, out, config, calib_path=CALIB, progress=False)
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["model.layers.1.self_attn.indexer.wk.weight"] == "W8A8_DYNAMIC"
    assert description["model.layers.2.self_attn.q_a_proj.weight"] == "W8A8_DYNAMIC"
    assert "model.layers.2.self_attn.indexer.wk.weight" not in description  # a shared layer
    report = msquant.verify_export(out, model_path=model_dir)
    assert report.ok, report.to_dict()
    assert report.forward is not None and report.forward.ok, report.forward


class _StateLayer(nn.Module):
    """A toy decoder layer returning ``(hidden, state)``, adding the state it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(
        self, hidden: torch.Tensor, state: torch.Tensor | None = None, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.proj(hidden) + (0 if state is None else state)
        return out, out.mean(-1, keepdim=True)


class _StateBody(nn.Module):
    """A toy model body: ``hand_on`` passes each layer's state to the next layer's call;
    ``sum`` adds the states up itself; ``drop`` ignores them."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_StateLayer() for _ in range(3)])

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        hidden, state, total = self.embed(input_ids), None, 0
        for layer in self.layers:
            hidden, returned = layer(hidden, state=state if self.how == "hand_on" else None)
            state = returned
            if self.how == "sum":
                total = total + returned
        return hidden


@pytest.mark.parametrize(
    ("how", "message"),
    [("sum", "into its own work"), ("drop", "to no later layer")],
)
def test_state_a_body_does_not_hand_to_a_layer_is_refused(how: str, message: str) -> None:
    """A layer's extra output the body uses itself, or drops, is refused at capture, naming the
    layer's class; one it hands to the next layer's call is carried (the output matches the
    whole body's)."""
    ids = [torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(0))]
    body = _StateBody(how)
    with pytest.raises(msquant.ModelLoadError, match=f"_StateLayer returns more .* {message}"):
        capture_layer_inputs(body, find_decoder_layers(body), ids)
    body = _StateBody("hand_on")
    layers = find_decoder_layers(body)
    activations = capture_layer_inputs(body, layers, ids)
    assert activations.hands_state_on
    assert [c.handed for c in activations.calls[0]] == [{}, {"state": (0, 1)}, {"state": (1, 1)}]
    for layer in layers:
        activations.advance(layer, get_backend("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(activations.hidden[0], body(ids[0]), rtol=0, atol=0)
