"""smart_resize: transformers' Qwen2-VL rule, except a side of at most factor/2 pixels (kept from Qwen's reference)."""

from __future__ import annotations

import itertools
import math

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from mars.tools.imaging import policy_view, smart_resize


def _previous_formula(height, width, factor=28, min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 1280):
    """The formula mars.tools.imaging computed before it called transformers (the reference of these tests)."""
    if height < 1 or width < 1:
        raise ValueError("size")
    if max(height, width) / min(height, width) > 200:
        raise ValueError("aspect")
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


SIDES = (1, 2, 7, 13, 14, 15, 16, 17, 27, 28, 29, 41, 42, 43, 55, 56, 57, 70, 99, 100, 150, 333, 700, 1000, 1001,
         1920, 2800, 4000)
FACTORS = (14, 28, 32)
BOUNDS = (  # (min_pixels, max_pixels): the policy's defaults, Qwen's processor defaults, a larger view
    (56 * 56, 224 * 224),
    (56 * 56, 14 * 14 * 4 * 1280),
    (256 * 28 * 28, 1280 * 28 * 28),
)


def _grid():
    for h, w in itertools.product(SIDES, SIDES):
        if max(h, w) / min(h, w) <= 200:
            for factor, (lo, hi) in itertools.product(FACTORS, BOUNDS):
                yield h, w, factor, lo, hi


def test_golden_values():
    # 1000 x 700, factor 28, pixels in [56*56, 224*224] = [3136, 50176]:
    #   round(1000/28) = round(35.71) = 36 -> 1008; round(700/28) = 25 -> 700; 1008*700 = 705600 > 50176, so
    #   beta = sqrt(1000*700 / 50176) = 3.7351; 1000/3.7351 = 267.7 -> floor(9.56)*28 = 252;
    #   700/3.7351 = 187.4 -> floor(6.69)*28 = 168. 252*168 = 42336 <= 50176.
    assert smart_resize(1000, 700, 28, 3136, 50176) == (252, 168)
    # with Qwen's default max_pixels (1003520) 1008*700 fits: just the rounding
    assert smart_resize(1000, 700) == (1008, 700)
    # 100 x 50 with min_pixels 200704 (256*28*28): 112*56 = 6272 < min, beta = sqrt(200704/5000) = 6.3357;
    #   100*6.3357 = 633.6 -> ceil(22.63)*28 = 644; 50*6.3357 = 316.8 -> ceil(11.31)*28 = 336
    assert smart_resize(100, 50, 28, 256 * 28 * 28, 1280 * 28 * 28) == (644, 336)
    # 14 x 1000: 14/28 = 0.5 rounds to 0 (to even); ours takes the side as 28: 28 x round(35.71)*28 = 28 x 1008,
    #   in [3136, 50176]. transformers keeps 0, so 0 < min_pixels and it scales up from 14 x 1000:
    #   beta = sqrt(3136/14000) = 0.4733; 14*0.4733 = 6.6 -> 28; 1000*0.4733 = 473.3 -> ceil(16.9)*28 = 476.
    assert smart_resize(14, 1000, 28, 3136, 50176) == (28, 1008)
    assert hf_smart_resize(14, 1000, 28, 3136, 50176) == (28, 476)
    # 15 x 1000: 15/28 rounds to 1 in both rules: 28 x 1008 (no jump between 14 and 15 rows in ours)
    assert smart_resize(15, 1000, 28, 3136, 50176) == hf_smart_resize(15, 1000, 28, 3136, 50176) == (28, 1008)


def test_equals_the_previous_formula_and_transformers_outside_thin_sides():
    thin_differs = 0
    n = 0
    for h, w, factor, lo, hi in _grid():
        ours = smart_resize(h, w, factor, lo, hi)
        assert ours == _previous_formula(h, w, factor, lo, hi), (h, w, factor, lo, hi)
        assert ours[0] % factor == 0 and ours[1] % factor == 0 and min(ours) >= factor
        hf = hf_smart_resize(h, w, factor, lo, hi)
        if 2 * min(h, w) > factor:
            assert ours == hf, (h, w, factor, lo, hi)  # every side rounds to >= 1 multiple: transformers' result
        else:
            thin_differs += ours != hf
        n += 1
    assert n > 1000
    assert thin_differs > 0  # the kept difference is real on this grid (e.g. 14 x 1000 above)


def test_errors():
    for h, w in ((0, 10), (10, 0), (-3, 10)):
        with pytest.raises(ValueError, match="positive"):
            smart_resize(h, w)
    for h, w in ((1, 201), (201, 1), (30, 6100), (6100, 30)):  # aspect ratio above 200: thin and not thin
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(h, w)
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_smart_resize(30, 6100)
    assert smart_resize(1, 200) == _previous_formula(1, 200)  # exactly 200 is allowed


def test_policy_view_size():
    im = Image.new("L", (1000, 700))  # width x height
    view = policy_view(im, 3136, 50176)
    assert view.mode == "RGB" and view.size == (252, 168)  # (width, height) of smart_resize(700, 1000)
    assert policy_view(Image.new("RGB", (5, 100)), 3136, 50176).size == (28, 112)
