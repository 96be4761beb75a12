"""dialogues_digest (the training data's part of a checkpoint's fingerprint: roles, texts, image pixels, order) and
the EpochSampler (seeded epochs, length-grouped batches, resume)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from PIL import Image

from mars.train.data import EpochSampler, dialogues_digest


def _dialogues() -> list[list[dict]]:
    img = Image.new("RGB", (8, 6), (10, 20, 30))
    return [
        [{"role": "system", "content": "tools"},
         {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is it?"}]},
         {"role": "assistant", "content": "<think>The snippet about Ab gives the city: Cd.</think>"}],
        [{"role": "user", "content": [{"type": "text", "text": "Q"}]}, {"role": "assistant", "content": "A"}],
    ]


def test_digest_is_stable_and_sees_every_change_of_the_data():
    base = dialogues_digest(_dialogues())
    assert len(base) == 16 and set(base) <= set("0123456789abcdef")
    assert dialogues_digest(_dialogues()) == base  # equal data (new objects): equal digest, so a kill resumes
    # no dialogue, one empty dialogue and the data are three different data sets
    assert len({dialogues_digest([]), dialogues_digest([[]]), base}) == 3

    def changed(edit) -> str:
        d = copy.deepcopy(_dialogues())
        edit(d)
        return dialogues_digest(d)

    variants = {
        "wording": changed(lambda d: d[0][2].update(content="<think>The snippet about Ab gives Cd.</think>")),
        "role": changed(lambda d: d[1][0].update(role="system")),
        "one pixel": changed(lambda d: d[0][1]["content"][0]["image"].putpixel((0, 0), (10, 20, 31))),
        "image size": changed(lambda d: d[0][1]["content"].__setitem__(
            0, {"type": "image", "image": Image.new("RGB", (6, 8), (10, 20, 30))})),
        "order": changed(lambda d: d.reverse()),
        "a dialogue fewer": changed(lambda d: d.pop()),
        # the boundary between messages counts: the same characters split differently are other data
        "split": changed(lambda d: (d[1][0]["content"][0].update(text="QA"), d[1][1].update(content=""))),
    }
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants)


def _draw(sampler, steps: int) -> list[list[int]]:
    return [sampler.next() for _ in range(steps)]


def test_plain_sampler_is_a_seeded_permutation_per_epoch():
    s = EpochSampler(10, 4, seed=3)
    flat = sum(_draw(s, 5), [])  # 20 indices = two epochs of 10; the third batch straddles the epoch boundary
    assert flat[:10] == list(np.random.default_rng([3, 0]).permutation(10))
    assert flat[10:20] == list(np.random.default_rng([3, 1]).permutation(10))
    assert s.state() == {"epoch": 2, "offset": 0}


def test_length_grouped_batches_pad_less_cover_the_epoch_and_resume():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 1000, size=50)
    bs = 4

    def useful_share(batches):  # real tokens / padded tokens (each batch padded to its longest example)
        return sum(lengths[b].sum() for b in batches) / sum(lengths[b].max() * len(b) for b in batches)

    plain = _draw(EpochSampler(50, bs, seed=1), 130)
    grouped_sampler = EpochSampler(50, bs, seed=1, lengths=lengths, group_batches=8)
    grouped = _draw(grouped_sampler, 130)
    assert all(len(b) == bs for b in grouped)
    # runs of 32, 18 examples -> 8 + 5 whole batches per epoch (the last of each run overlaps its neighbour)
    epoch0 = grouped[:13]
    assert set(sum(epoch0, [])) == set(range(50))
    assert grouped_sampler._perm(0).size == 13 * bs
    # inside a batch the lengths come from one sorted run: far less padding than a plain shuffle
    assert useful_share(grouped) > 0.85 > useful_share(plain)
    # other epochs are other permutations, and the same seed gives the same batches
    assert grouped[13:26] != epoch0
    assert _draw(EpochSampler(50, bs, seed=1, lengths=lengths, group_batches=8), 130) == grouped
    # resume mid-epoch from the saved position: the same remaining batches
    a = EpochSampler(50, bs, seed=1, lengths=lengths, group_batches=8)
    _draw(a, 20)
    b = EpochSampler(50, bs, seed=1, lengths=lengths, group_batches=8)
    b.load(a.state())
    assert _draw(b, 30) == grouped[20:50]
    # fewer examples than a batch: still whole batches
    tiny = EpochSampler(3, bs, seed=0, lengths=[5, 1, 9], group_batches=8)
    assert [sorted(set(x)) for x in _draw(tiny, 3)] == [[0, 1, 2]] * 3


def test_sampler_rejects_bad_grouping():
    with pytest.raises(ValueError, match="group_batches must be >= 1"):
        EpochSampler(10, 4, seed=0, lengths=[1] * 10, group_batches=0)
    with pytest.raises(ValueError, match="lengths has 9 entries for 10 examples"):
        EpochSampler(10, 4, seed=0, lengths=[1] * 9, group_batches=2)


def test_rendered_pixels_are_kept_packed_and_batched_as_float32():
    """render_examples keeps pixel values packed at one byte per value (an eighth of float32: 3 channels x 14 x 14
    codes a patch against 3 x 2 x 14 x 14 float32 values); collate hands the model float32 holding exactly the
    float16-rounded values, and text-only examples stay without pixels."""
    import torch

    from mars.model.chat import render
    from mars.train.data import PackedPixels, collate, render_examples
    from tests.model.test_model import tiny_stack
    from tests.train.test_deepspeed import dialogues

    _, proc, _ = tiny_stack()
    kept = render_examples(dialogues(), proc, max_len=4096)
    full = [render(d, proc) for d in dialogues()]
    packed = kept[0].pixel_values
    assert isinstance(packed, PackedPixels) and full[0].pixel_values.dtype == torch.float32
    assert packed.codes.dtype == torch.uint8 and packed.codes.numel() * 8 == full[0].pixel_values.nbytes
    assert kept[1].pixel_values is None
    batch = collate(kept, proc.tokenizer.pad_token_id)
    pv = batch.inputs["pixel_values"]
    assert pv.dtype == torch.float32
    assert torch.equal(pv, full[0].pixel_values.half().float())
    assert float((pv - full[0].pixel_values).abs().max()) < 2e-3  # the normalised values lie within about +-2


def test_pack_pixels_round_trips_and_keeps_what_it_cannot_pack_as_float16():
    """Two patches of 2 channels x 2 temporal copies x 2 values: channel 0 holds the values 0.5 and -1, channel 1
    holds 2; packed, channel 0's table starts [-1, 0.5] (torch.unique sorts) and its codes are [[1, 0], [0, 0]]."""
    import torch

    from mars.train.data import PackedPixels, pack_pixels, unpack_pixels

    # a row is (C, T, P*P) = (2, 2, 2): the temporal copies repeat each channel's two values
    pv = torch.tensor([[0.5, -1.0, 0.5, -1.0, 2.0, 2.0, 2.0, 2.0],
                       [-1.0, -1.0, -1.0, -1.0, 2.0, 2.0, 2.0, 2.0]])
    packed = pack_pixels(pv, channels=2, temporal=2)
    assert isinstance(packed, PackedPixels) and packed.codes.shape == (2, 2, 2)
    assert packed.table[0, :2].tolist() == [-1.0, 0.5] and packed.codes[:, 0].tolist() == [[1, 0], [0, 0]]
    assert torch.equal(unpack_pixels(packed), pv.half())
    unequal = pv.clone()
    unequal[0, 2] = 0.25  # the second temporal copy differs: kept as float16
    assert torch.equal(pack_pixels(unequal, 2, 2), unequal.half())
    many = torch.linspace(-2, 2, 600).reshape(1, 600)  # 300 distinct values a channel (C=2, T=1): more than 256
    assert torch.equal(unpack_pixels(pack_pixels(many, 2, 1)), many.half())


def test_drills_kept_in_the_policys_view_render_the_same_pixels():
    """A localisation drill (a 448-px scene, then the answered crop) and a zoom caption drawn with ``view`` the
    policy's view keep smaller images that render to exactly the same tokens and pixel values as drawn full size:
    the processor resizes an image already at its size to itself. With min_pixels = max_pixels = 112 x 112 the rule
    is not idempotent (a 299 x 448 scene goes to 84 x 112 = 9,408 pixels, below the minimum, which a second pass
    scales up to 112 x 140), so such images are kept as drawn and still render the same."""
    import torch

    from mars.agent.config import AgentParams
    from mars.model.chat import render
    from mars.model.processor import build_processor
    from mars.train.captions import zoom_captions
    from mars.train.drawing import agent_view
    from mars.train.locate import locate_dialogues
    from mars.world.generate import WorldSpec
    from tests.model.test_model import tiny_stack

    _, tight, _ = tiny_stack()  # min = max = 12,544 pixels
    scene = WorldSpec().scene_config()
    for proc in (build_processor(tight.tokenizer, 56 * 56, 224 * 224), tight):
        view = agent_view(AgentParams(min_pixels=proc.min_pixels, max_pixels=proc.max_pixels))
        for draw in (lambda v: locate_dialogues(scene, n=3, seed=5, answer_share=1.0, view=v),
                     lambda v: zoom_captions(scene, n=3, seed=5, view=v)):
            full, kept = draw(None), draw(view)
            sizes = [(p["image"].size, q["image"].size) for d, e in zip(full, kept) for m, n in zip(d, e)
                     if isinstance(m["content"], list) for p, q in zip(m["content"], n["content"]) if "image" in p]
            smaller = [k[0] * k[1] < f[0] * f[1] for f, k in sizes]
            assert sizes and (all(smaller) if proc is not tight else not all(smaller))
            for d, e in zip(full, kept):
                a, b = render(d, proc), render(e, proc)
                assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)
