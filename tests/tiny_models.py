"""Build tiny random decoder models (with a real trained tokenizer) in local folders for tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few lines of text, and the
models are random-weight instances of real transformers architectures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CORPUS = Path(__file__).parent / "data" / "calib.txt"
VOCAB_SIZE = 384

ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=8),
    # sandwich norms scaling by 1 + weight: the MLP reads pre_feedforward_layernorm
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=8),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=8),
    # post-norm only: post_attention_layernorm normalises the attention's output
    "olmo2": dict(model_type="olmo2"),
    # Qwen3.5's language model: a Gated DeltaNet (linear attention) layer, then a full-attention one
    "qwen3_5_text": dict(
        model_type="qwen3_5_text",
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    ),
}


def build_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer and save it into ``directory``."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").split("\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(str(directory))
    return fast


def build_tiny_model(
    directory: Path,
    arch: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    vocab_size: int = VOCAB_SIZE,
    **overrides: Any,
) -> Path:
    """Write a random-weight causal LM of ``arch`` with a trained tokenizer into ``directory``
    (``vocab_size`` may exceed the tokenizer's, as real models' padded vocabularies do)."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    params = dict(ARCHS[arch])
    model_type = params.pop("model_type")
    base: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **{**base, **params, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.to(dtype).eval()
    model.save_pretrained(str(directory))
    return directory


#: Tiny MoE architectures (hidden 64 from :func:`build_tiny_model`, 4-8 experts of width 32, top-2).
#: ``intermediate_size`` is the dense MLP width (Qwen-MoE's dense layers, DeepSeek's first layer);
#: Mixtral uses it as the expert width, so pass ``intermediate_size=32`` for it.
MOE_ARCHS: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    # Qwen3-Next: a linear-attention (Gated DeltaNet) layer, then a full-attention one, MoE MLPs
    "qwen3_next": dict(
        model_type="qwen3_next",
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe",
        head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    # GLM-5 (transformers' ``glm_moe_dsa``): MLA with a query LoRA, the DSA indexer
    # (``self_attn.indexer``: wq_b, wk, k_norm, weights_proj), the first 3 layers dense, as GLM-5;
    # its attention takes as many key/value heads as query heads; every second layer from the
    # third on is a ``shared`` indexer layer, reusing the top-k indices the layer before hands on
    "glm_moe_dsa": dict(
        model_type="glm_moe_dsa",
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=3,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=8,
        index_topk_freq=2,
    ),
    # like Mixtral, MiniMax-M2's experts are ``intermediate_size`` wide: pass ``intermediate_size=32``
    "minimax_m2": dict(
        model_type="minimax_m2", head_dim=16, num_local_experts=4, num_experts_per_tok=2
    ),
}
ARCHS.update(MOE_ARCHS)


#: Tiny vision-language models (transformers' image-text-to-text classes): a text decoder as in
#: :func:`build_tiny_model` (hidden 64, 2 layers) beside a 2-block vision tower of width 32.
_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    head_dim=16,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
_DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
#: image / video token ids inside the tiny vocabulary (the real ones are beyond it)
_SPECIAL_IDS = dict(
    image_token_id=VOCAB_SIZE - 9, video_token_id=VOCAB_SIZE - 8, image_start_token_id=VOCAB_SIZE - 7,
    image_end_token_id=VOCAB_SIZE - 6, video_start_token_id=VOCAB_SIZE - 5,
    video_end_token_id=VOCAB_SIZE - 4,
)  # fmt: skip
_OMNI_IDS = dict(
    audio_token_index=VOCAB_SIZE - 10, image_token_index=VOCAB_SIZE - 9,
    video_token_index=VOCAB_SIZE - 8, audio_start_token_id=VOCAB_SIZE - 7,
)  # fmt: skip
_OMNI_AUDIO = dict(
    num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
    output_dim=64, max_source_positions=64, n_window=4,
)  # fmt: skip
VLM_ARCHS: dict[str, dict[str, Any]] = {
    # Qwen2.5-VL: windowed vision attention (block 1 full), gated vision MLP, mRoPE text
    "qwen2_5_vl": dict(
        text_config=dict(_TEXT, rope_parameters=_MROPE),
        vision_config=dict(_QWEN_VISION, fullatt_block_indexes=[1], window_size=32),
    ),
    "qwen3_vl": dict(
        text_config=dict(_TEXT, rope_parameters=_MROPE),
        vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]),
    ),
    "qwen3_vl_moe": dict(
        text_config=dict(_TEXT, rope_parameters=_MROPE, **_MOE),
        vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]),
    ),
    "qwen3_5": dict(text_config=dict(_TEXT, **_DELTANET), vision_config=_QWEN_VISION),
    "qwen3_5_moe": dict(
        text_config=dict(_TEXT, **_DELTANET, **_MOE, shared_expert_intermediate_size=32),
        vision_config=_QWEN_VISION,
    ),
    "internvl": dict(
        text_config=dict(_TEXT, model_type="qwen3"),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_hidden_layers=2,
            image_size=[28, 28],
            patch_size=[14, 14],
        ),
    ),
    # Kimi-K2.5: DeepSeek-V3's text model (MLA, MoE) beside MoonViT
    "kimi_k25": dict(
        text_config=dict(
            _TEXT,
            model_type="deepseek_v3",
            num_key_value_heads=4,
            **{k: v for k, v in MOE_ARCHS["deepseek_v3"].items() if k != "model_type"},
            head_dim=8,  # DeepSeek-V3's rotary embedding spans qk_rope_head_dim
        ),
        vision_config=dict(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2
        ),
        projection_hidden_size=64,
    ),
    # GLM-4.5V / 4.6V: GLM-4-MoE's text model (partial rotary, layer 0 dense) beside a GLM vision
    # tower whose merger ends in a gated MLP (``merger.gate_proj`` / ``up_proj`` / ``down_proj``)
    "glm4v_moe": dict(
        text_config=dict(
            _TEXT,
            **{k: v for k, v in MOE_ARCHS["glm4_moe"].items() if k != "model_type"},
            # half of head_dim 16 rotates: the sections span its 4 frequencies
            rope_parameters=dict(_MROPE, partial_rotary_factor=0.5, mrope_section=[1, 1, 2]),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            image_size=28,
            patch_size=14,
        ),
        **_SPECIAL_IDS,
    ),
    # Qwen2.5-Omni and Qwen3-Omni: the whole checkpoint (``thinker.*`` beside ``talker.*`` and the
    # speech decoder ``token2wav.*`` / ``code2wav.*``), built by :data:`OMNI_CLASSES`
    "qwen2_5_omni": dict(
        thinker_config=dict(
            audio_config=_OMNI_AUDIO,
            vision_config=dict(_QWEN_VISION, fullatt_block_indexes=[1], window_size=28),
            text_config=dict(_TEXT, rope_parameters=_MROPE),
            **_OMNI_IDS,
        ),
        talker_config=dict(
            vocab_size=64,
            embedding_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters=_MROPE,
            tts_text_start_token_id=1,
            tts_text_end_token_id=2,
            tts_text_pad_token_id=3,
            tts_codec_start_token_id=4,
            tts_codec_end_token_id=5,
            tts_codec_pad_token_id=6,
            tts_codec_mask_token_id=7,
            vision_start_token_id=8,
            vision_end_token_id=9,
            **_OMNI_IDS,
        ),
        token2wav_config=dict(
            dit_config=dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                ff_mult=2,
                emb_dim=16,
                head_dim=16,
                num_embeds=64,
                mel_dim=8,
                enc_emb_dim=8,
                enc_dim=16,
                enc_channels=[16, 16, 16, 16, 32],
                enc_attention_channels=8,
                enc_se_channels=8,
                look_ahead_layers=[1],
                look_backward_layers=[0],
            ),
            bigvgan_config=dict(
                mel_dim=8,
                upsample_initial_channel=16,
                upsample_rates=[2, 2],
                upsample_kernel_sizes=[4, 4],
                resblock_kernel_sizes=[3],
                resblock_dilation_sizes=[[1, 3, 5]],
            ),
        ),
    ),
    "qwen3_omni_moe": dict(
        thinker_config=dict(
            audio_config=dict(_OMNI_AUDIO, downsample_hidden_size=8, n_window_infer=8),
            vision_config=dict(
                _QWEN_VISION,
                patch_size=14,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0],
            ),
            text_config=dict(_TEXT, rope_parameters=_MROPE, **_MOE),
            **{k.replace("index", "id"): v for k, v in _OMNI_IDS.items()},
        ),
        talker_config=dict(
            text_config=dict(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                moe_intermediate_size=16,
                num_local_experts=2,
                num_experts_per_tok=1,
                shared_expert_intermediate_size=16,
            ),
            code_predictor_config=dict(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                num_code_groups=2,
            ),
            num_code_groups=2,
            thinker_hidden_size=64,
            codec_eos_token_id=10,
            codec_nothink_id=11,
            codec_think_bos_id=12,
            codec_think_eos_id=13,
            codec_pad_id=14,
            codec_bos_id=15,
            accept_hidden_layer=1,
            spatial_merge_size=2,
        ),
        code2wav_config=dict(
            codebook_size=64,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            num_hidden_layers=1,
            num_quantizers=2,
            upsample_rates=[2, 2],
            upsampling_ratios=[2],
            decoder_dim=16,
            sliding_window=8,
        ),
    ),
}


#: The Omni models' whole-checkpoint classes (:func:`build_tiny_vlm`).
OMNI_CLASSES = {
    "qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
    "qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration",
}


def build_tiny_vlm(directory: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight vision-language model of ``arch`` (:data:`VLM_ARCHS`, updated with
    ``overrides``) with a trained tokenizer into ``directory``."""
    from transformers import AutoModelForImageTextToText

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    config = AutoConfig.for_model(arch, **{**VLM_ARCHS[arch], **overrides})
    torch.manual_seed(seed)
    if arch in OMNI_CLASSES:  # no auto class builds the whole checkpoint (thinker and talker)
        import transformers

        model = getattr(transformers, OMNI_CLASSES[arch])(config).eval()
    else:
        model = AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(str(directory))
    return directory


#: A tiny DeepSeek-V3 with MLA and a query LoRA, dense MLPs in both layers (``fa3_quant``'s
#: tests and oracle): ``build_tiny_model(directory, "deepseek_v3", **MLA_DEEPSEEK_V3)``.
MLA_DEEPSEEK_V3: dict[str, int] = dict(
    first_k_dense_replace=2,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)


def _vl_template(image: str) -> str:
    """A chat template of Qwen's form rendering an image as ``image`` (then the text), enough
    for the tiny processors of :func:`build_tiny_vlm_with_processor`."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
        + image
        + "{% elif c['type'] == 'text' %}{{ c['text'] }}"
        "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


#: Per arch: (the processor class, the chat template's image, the vision tokens added to the
#: tokenizer, the config's token ids (field -> token), the processor's own settings, which the
#: config shares).
_VL_PROCESSORS: dict[str, tuple[str, str, list[str], dict[str, str], dict[str, Any]]] = {
    "qwen3_vl": (
        "Qwen3VLProcessor",
        "<|vision_start|><|image_pad|><|vision_end|>",
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
        {
            "vision_start_token_id": "<|vision_start|>",
            "image_token_id": "<|image_pad|>",
            "vision_end_token_id": "<|vision_end|>",
            "video_token_id": "<|video_pad|>",
        },
        {},
    ),
    "internvl": (
        "InternVLProcessor",
        "<IMG_CONTEXT>\n",
        ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"],
        {"image_token_id": "<IMG_CONTEXT>"},
        {"image_seq_length": 1},
    ),
}
_VL_PROCESSORS["qwen3_vl_moe"] = _VL_PROCESSORS["qwen3_vl"]
_VL_PROCESSORS["glm4v_moe"] = (
    "Glm4vProcessor",
    "<|begin_of_image|><|image|><|end_of_image|>",
    ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
     "<|end_of_video|>"],
    {
        "image_start_token_id": "<|begin_of_image|>",
        "image_token_id": "<|image|>",
        "image_end_token_id": "<|end_of_image|>",
        "video_start_token_id": "<|begin_of_video|>",
        "video_token_id": "<|video|>",
        "video_end_token_id": "<|end_of_video|>",
    },
    {},
)  # fmt: skip
#: InternVL's processor reads its tokens off the tokenizer by these names.
_INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def _save_image_processor(directory: Path, arch: str) -> dict[str, Any]:
    """transformers' image processor of ``arch`` (PIL backend, a few patches per image) saved in
    ``directory``; returns the vision config fields it implies."""
    if arch == "internvl":  # 28x28 tiles (4 patches, 1 token after pixel shuffle), at most 2 + 1
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
            GotOcr2ImageProcessorPil,
        )

        GotOcr2ImageProcessorPil(
            size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=2
        ).save_pretrained(str(directory))
        return {}
    if arch == "glm4v_moe":  # 14-pixel patches merged 2x2, images of 28x28 to 56x56 pixels
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

        Glm4vImageProcessorPil(
            size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
        ).save_pretrained(str(directory))
        return {}
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
        max_pixels=64 * 64,
    ).save_pretrained(str(directory))  # fmt: skip
    return {"patch_size": 16}


def build_tiny_vlm_with_processor(
    directory: Path,
    arch: str = "qwen3_vl",
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
) -> Path:
    """A tiny vision-language model (:data:`VLM_ARCHS`: Qwen3-VL, Qwen3-VL-MoE, InternVL) with
    the processor files image calibration reads: the trained tokenizer with the family's vision
    tokens added (the config's image token ids point at them), transformers' image processor
    (PIL backend, images resized to a few patches), a chat template, and
    ``processor_config.json`` naming the processor class. ``text`` / ``vision``: fields of the
    text / vision config changed."""
    import json

    processor_class, image, tokens, token_ids, settings = _VL_PROCESSORS[arch]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    if arch == "internvl":
        tokenizer._set_model_specific_special_tokens(special_tokens=_INTERNVL_TOKENS)
    tokenizer.save_pretrained(str(directory))
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in token_ids.items()}
    vision_fields = _save_image_processor(directory, arch)
    (directory / "chat_template.jinja").write_text(_vl_template(image), encoding="utf-8")
    (directory / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class, **settings}), encoding="utf-8"
    )
    base = VLM_ARCHS[arch]
    config = AutoConfig.for_model(
        arch,
        **{
            **base,
            "text_config": dict(base["text_config"], vocab_size=len(tokenizer) + 4, **(text or {})),
            "vision_config": dict(base["vision_config"], **vision_fields, **(vision or {})),
            **ids,
            **settings,
        },
    )
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).eval().save_pretrained(str(directory))
    return directory


def write_calibration_images(folder: Path, count: int = 2, seed: int = 0) -> Path:
    """``count`` random RGB PNG images of different sizes (``img0.png``, ...) in ``folder``."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for index in range(count):
        pixels = torch.rand(40 + 8 * index, 56, 3, generator=generator) * 255
        Image.fromarray(pixels.to(torch.uint8).numpy()).save(folder / f"img{index}.png")
    return folder


def transpose_fused_experts(directory: Path) -> None:
    """Rewrite the fused experts of ``directory``'s ``model.safetensors`` as the released
    Qwen3-VL-MoE checkpoints store them: ``experts.gate_up_proj [E, H, 2I]`` and
    ``experts.down_proj [E, I, H]`` (transformers 5 saves ``[E, 2I, H]`` / ``[E, H, I]`` and
    transposes the released layout while it loads)."""
    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


#: A tiny Qwen3-VL-MoE whose experts are narrower than in :data:`VLM_ARCHS` (``2I != H``, so
#: transformers' load-time transpose of the released layout is unambiguous).
VL_MOE_INTER, VL_MOE_HIDDEN, VL_MOE_EXPERTS = 16, 64, 4
VL_MOE_EXPERTS_MODULES = [f"model.language_model.layers.{i}.mlp.experts" for i in (0, 1)]


def build_tiny_vl_moe(directory: Path, layout: str) -> Path:
    """A tiny Qwen3-VL-MoE with fused experts as transformers saves them (``layout="saved"``:
    ``[E, 2I, H]`` / ``[E, H, I]``) or as the released checkpoints store them (``"released"``)."""
    text = dict(VLM_ARCHS["qwen3_vl_moe"]["text_config"], moe_intermediate_size=VL_MOE_INTER)
    build_tiny_vlm(directory, "qwen3_vl_moe", text_config=text)
    if layout == "released":
        transpose_fused_experts(directory)
    return directory


def vl_moe_expert_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every expert Linear's ``[out, in]`` weight of :func:`build_tiny_vl_moe`'s checkpoint, cut
    out as msModelSlim's Qwen3-VL-MoE adapter does from the released layout: ``gate_up[e]`` is
    ``[H, 2I]``, gate its first I columns transposed, up the others; ``down[e]`` ``[I, H]``
    transposed."""
    from safetensors.torch import load_file

    saved = load_file(str(directory / "model.safetensors"))
    weights = {}
    for module in VL_MOE_EXPERTS_MODULES:
        gate_up, down = saved[f"{module}.gate_up_proj"], saved[f"{module}.down_proj"]
        if gate_up.shape[1] != VL_MOE_HIDDEN:  # saved by transformers: [E, 2I, H]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        assert tuple(gate_up.shape) == (VL_MOE_EXPERTS, VL_MOE_HIDDEN, 2 * VL_MOE_INTER)
        assert tuple(down.shape) == (VL_MOE_EXPERTS, VL_MOE_INTER, VL_MOE_HIDDEN)
        for e in range(VL_MOE_EXPERTS):
            gate, up = gate_up[e].chunk(2, dim=-1)
            weights[f"{module}.{e}.gate_proj"] = gate.t()
            weights[f"{module}.{e}.up_proj"] = up.t()
            weights[f"{module}.{e}.down_proj"] = down[e].t()
    return weights


def fuse_experts_on_disk(directory: Path) -> None:
    """Rewrite the per-expert tensors of ``directory``'s ``model.safetensors``
    (``mlp.experts.<e>.gate_proj.weight`` ...) as one fused pair per layer in transformers 5's
    layout (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``), which
    transformers loads as it is (a checkpoint written from the fused parameters)."""
    import re

    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in list(tensors):
        found = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if found:
            key = (int(found.group(2)), found.group(3))
            groups.setdefault(found.group(1), {})[key] = tensors.pop(name)
    for module, weights in groups.items():
        count = 1 + max(e for e, _ in weights)
        tensors[f"{module}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[(e, "gate_proj")], weights[(e, "up_proj")]]) for e in range(count)]
        )
        tensors[f"{module}.down_proj"] = torch.stack(
            [weights[(e, "down_proj")] for e in range(count)]
        )
    save_file(tensors, str(file), metadata={"format": "pt"})
