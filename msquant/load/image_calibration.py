"""Image calibration of a vision-language model: msModelSlim's image folders read and run
through the model's own processor.

msModelSlim 26.1.0's ``multimodal_vlm_modelslim_v1`` practices name ``spec.dataset:
calibImages``, a folder of images without an index (its legacy directory loader): every image,
in file-name order, is one sample paired with ``spec.default_text``, and each sample goes through
the model's ``AutoProcessor`` chat template as one user message (the image, then the text) with
the generation prompt added. msquant reads the same folder form (``.jpg`` / ``.jpeg`` / ``.png``,
nothing downloaded) and builds the same messages with the processor saved in the model folder;
each sample becomes the token ids (the samples every text path takes) plus the other model inputs
the processor returns (pixel values, image grid, attention mask, ...). Pillow decodes the images
(the ``vision`` extra); it is imported only here, and only for such a run.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from msquant.errors import CalibrationDataError
from msquant.load.msmodelslim_datasets import MSMODELSLIM_MEDIA_SETS, msmodelslim_lab_calib

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageSamples",
    "image_folder",
    "image_samples",
    "load_processor",
    "read_image_folder",
]

logger = logging.getLogger(__name__)

#: The image files of a calibration folder (msModelSlim's legacy directory loader's).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
#: The files a processor is saved as (any one of them present: the folder has a processor).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
#: The image calibration folders msModelSlim ships (``lab_calib``), by name.
IMAGE_SETS = frozenset({"calibImages"})


@dataclass(frozen=True)
class ImageSamples:
    """Image calibration samples: ``input_ids`` (``[1, seq]`` each, what text paths take) and,
    per sample, the other inputs of the model's forward (``pixel_values``, ``image_grid_thw``,
    ``attention_mask``, ...)."""

    input_ids: list[torch.Tensor]
    inputs: list[dict[str, torch.Tensor]]
    images: list[Path]


def image_folder(name: str, config_dir: Path | None) -> Path | None:
    """The image folder ``spec.dataset`` names, or None when it names none (a text file).

    An existing folder (absolute, from the CWD, or beside the YAML) is taken as is; msModelSlim's
    name ``calibImages`` is read from an installed msModelSlim's ``lab_calib`` folder.

    :raises CalibrationDataError: for ``calibImages`` without such a folder, or another of
        msModelSlim's media sets (videos, audio), which msquant does not read.
    """
    path = Path(name).expanduser()
    for candidate in (path, config_dir / path if config_dir is not None else path):
        if candidate.is_dir():
            return candidate
    if name not in MSMODELSLIM_MEDIA_SETS:
        return None
    lab_calib = msmodelslim_lab_calib()
    if name in IMAGE_SETS and lab_calib is not None and (lab_calib / name).is_dir():
        logger.info("dataset %s: read from msModelSlim's %s", name, lab_calib)
        return lab_calib / name
    if name in IMAGE_SETS:
        raise CalibrationDataError(
            f"spec.dataset {name!r} is msModelSlim's folder of calibration images, which msquant "
            "does not ship and no installed msModelSlim provides here; put a folder of that name "
            "(.jpg / .jpeg / .png images) beside the YAML or in the working directory, or give "
            "a folder's path in spec.dataset"
        )
    raise CalibrationDataError(
        f"spec.dataset {name!r} is one of msModelSlim's video / audio calibration sets; msquant "
        "calibrates a vision-language model on images (a folder of .jpg / .jpeg / .png files, "
        "each paired with spec.default_text) or on text"
    )


def read_image_folder(folder: Path) -> list[Path]:
    """The images of a calibration folder in file-name order (msModelSlim's order).

    :raises CalibrationDataError: for a folder without images, or with an index file (a
        ``.json`` / ``.jsonl`` pairing images with texts, which msquant does not read).
    """
    if not folder.is_dir():
        raise CalibrationDataError(f"calibration image folder {folder} does not exist")
    files = [f for f in folder.iterdir() if f.is_file()]
    index = sorted(f.name for f in files if f.suffix.lower() in (".json", ".jsonl"))
    if index:
        raise CalibrationDataError(
            f"calibration image folder {folder} holds {index[0]}: an index pairing images with "
            "their own texts is not implemented; keep only the images (each is paired with "
            "spec.default_text)"
        )
    images = sorted(f for f in files if f.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise CalibrationDataError(
            f"calibration image folder {folder} holds no image ({', '.join(IMAGE_SUFFIXES)})"
        )
    return images


def _require_pillow() -> None:
    if importlib.util.find_spec("PIL") is None:
        raise CalibrationDataError(
            "calibrating on images needs Pillow to read them: pip install 'msquant[vision]'"
        )


def load_processor(model_dir: Path, trust_remote_code: bool = False) -> Any:
    """The model folder's processor (image processor, tokenizer and chat template together).

    Where transformers cannot build the processor's video processor (it needs torchvision, which
    image calibration does not use), the processor class is built without it.

    :raises CalibrationDataError: when the folder holds no processor files.
    """
    if not any((model_dir / name).is_file() for name in PROCESSOR_FILES):
        raise CalibrationDataError(
            f"image calibration needs the model's processor, but {model_dir} holds none of "
            f"{', '.join(PROCESSOR_FILES)}: copy the processor files of the original checkpoint "
            "(preprocessor_config.json, processor / chat-template files, tokenizer) into the "
            "model folder, or calibrate on text (a .jsonl file in spec.dataset)"
        )
    _require_pillow()
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(
            str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (ImportError, ValueError) as error:  # transformers raises either, by model
        if "torchvision" not in str(error).lower():
            raise
        logger.info("processor built without its video processor (%s)", str(error).strip()[:80])
        return _processor_without_video(model_dir, trust_remote_code)


def _processor_without_video(model_dir: Path, trust_remote_code: bool) -> Any:
    """The folder's processor class built from its image processor, tokenizer and chat template
    alone (no video processor)."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name, settings = None, {}
    for file in PROCESSOR_FILES:
        path = model_dir / file
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            name = saved.get("processor_class") or name
            if file == "processor_config.json":  # the processor's own settings
                settings = {k: v for k, v in saved.items() if k != "processor_class"}
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        raise CalibrationDataError(
            f"{model_dir}: the processor files name no processor class transformers has "
            f"({name!r}); save the model's processor with save_pretrained into the folder"
        )

    class ImagesOnly(cls):  # type: ignore[misc, valid-type]
        """The processor with no video processor (its class check skipped for None)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    tokenizer = AutoTokenizer.from_pretrained(
        str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True
    )
    image_processor = AutoImageProcessor.from_pretrained(
        str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True
    )
    accepted = inspect.signature(cls.__init__).parameters
    return ImagesOnly(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=template or getattr(tokenizer, "chat_template", None),
        **{key: value for key, value in settings.items() if key in accepted},
    )


def image_samples(images: Sequence[Path], text: str, processor: Any) -> ImageSamples:
    """Each image with ``text`` as one user message through the processor's chat template
    (generation prompt added), as msModelSlim's VLM adapters build their samples.

    :raises CalibrationDataError: when the processor has no chat template, or gives no token.
    """
    _require_pillow()
    if not getattr(processor, "chat_template", None):
        raise CalibrationDataError(
            "the model's processor has no chat template (chat_template.jinja or the processor's "
            "chat_template), which image calibration renders each image and text with"
        )
    input_ids, inputs = [], []
    for image in images:
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": str(image)},
                    {"type": "text", "text": text},
                ],
            }
        ]
        encoded = processor.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )
        ids = encoded["input_ids"]
        if ids.shape[-1] == 0:
            raise CalibrationDataError(f"{image}: the processor gave no token")
        input_ids.append(ids.to(torch.long))
        inputs.append(
            {
                key: value
                for key, value in encoded.items()
                if key != "input_ids" and isinstance(value, torch.Tensor)
            }
        )
    logger.info("calibration: %d image sample(s) with the text %r", len(images), text)
    return ImageSamples(input_ids, inputs, list(images))
