"""Image geometry shared by the tools and the model: Qwen-VL's ``smart_resize``.

:func:`smart_resize` is the rule Qwen2-VL / Qwen2.5-VL processors use to pick the size an
image is shown at: both sides rounded to multiples of ``factor`` (patch 14 x merge 2 = 28),
total pixels within ``[min_pixels, max_pixels]``, aspect ratio kept as well as rounding
allows. :func:`policy_view` applies it to a PIL image, giving what the policy sees.

It is transformers' own ``smart_resize`` (``transformers.models.qwen2_vl``, the function the
Qwen2-VL image processors call), with two differences kept from Qwen's reference
(``qwen_vl_utils.smart_resize``), both tested in ``tests/tools/test_imaging.py``:

- a side of at most ``factor / 2`` pixels rounds to ``factor``, not to 0. transformers rounds
  it to 0, so the product falls below ``min_pixels`` and the image is scaled up from there:
  a 14 x 1000 crop becomes 28 x 476 while a 15 x 1000 one becomes 28 x 1008. Here both are
  28 x 1008 (:func:`_smart_resize_thin`); every other size gets transformers' result.
- a size below 1 pixel is a ``ValueError`` (transformers divides by zero).
"""

from __future__ import annotations

import math

from PIL import Image

_MAX_RATIO = 200  # the longest side may be at most this many times the shortest (as Qwen's processors check)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Return ``(height, width)``: multiples of ``factor`` with pixels in ``[min_pixels, max_pixels]``.

    Raises ``ValueError`` for a side below 1 pixel or an aspect ratio above 200. A thin image (aspect near 200)
    can come out above ``max_pixels``: its short side cannot go below ``factor`` (as in transformers).
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if 2 * min(height, width) <= factor:  # that side would round to 0 in transformers
        return _smart_resize_thin(height, width, factor, min_pixels, max_pixels)
    # imported here: the module pulls in torch, which the callers of the tools may not need otherwise
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    return hf_smart_resize(height, width, factor, min_pixels, max_pixels)


def _smart_resize_thin(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The same rule when a side rounds to 0 multiples of ``factor``: that side is taken as ``factor`` (Qwen's
    reference ``max(factor, round_by_factor(side))``), so the result does not jump at ``side = factor / 2``."""
    if max(height, width) / min(height, width) > _MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {_MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
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
