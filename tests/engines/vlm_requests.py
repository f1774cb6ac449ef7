"""What the image and the video engine tests (test_engine_vision.py, test_engine_video.py) share: a ``/generate``
to a real engine process, and the reference its log-probs are checked against, a transformers forward of the same
inputs."""

from __future__ import annotations

import httpx
import torch

# the processor's outputs a Qwen2.5-VL forward takes besides the ids: an image's, then a video's
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def post(engine, body) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=120)


def hf_logprobs(model_dir, prompt: list[int], gen: list[int], media: dict) -> torch.Tensor:
    """log p of each of ``gen`` after ``prompt`` (expanded) with the images or videos of ``media``
    (:func:`relax_hpc.multimodal.encode_ids` or ``encode_media_ids``): one fp32 transformers forward of the whole
    sequence."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq = torch.tensor([prompt + gen])
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=torch.ones_like(seq),
                       **{k: media[k] for k in MEDIA_KEYS if k in media}).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(gen)[:, None])[:, 0]
