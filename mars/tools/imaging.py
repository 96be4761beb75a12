"""Image geometry shared by the tools and the model: Qwen-VL's ``smart_resize``.

:func:`smart_resize` is the rule Qwen2-VL / Qwen2.5-VL processors use to pick the size an
image is shown at: both sides rounded to multiples of ``factor`` (patch 14 x merge 2 = 28),
total pixels within ``[min_pixels, max_pixels]``, aspect ratio kept as well as rounding
allows. :func:`policy_view` applies it to a PIL image, giving what the policy sees.
"""

from __future__ import annotations

import math

from PIL import Image


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Return ``(height, width)``: multiples of ``factor`` with pixels in ``[min_pixels, max_pixels]``."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def policy_view(image: Image.Image, min_pixels: int, max_pixels: int, factor: int = 28) -> Image.Image:
    """``image`` resized as a Qwen-VL processor would show it to the policy (bicubic)."""
    h, w = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    return image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
