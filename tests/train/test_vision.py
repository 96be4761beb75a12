"""Vision pre-training (phase 0): labels, read-out, accuracy counting, training, resume and the stage's params,
for reading (emblem attributes) and for localisation (the framed cell)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from mars.model.build import build_model, tiny_config
from mars.model.processor import build_processor
from mars.model.tokenizer import train_tokenizer
from mars.train.captions import zoom_crop
from mars.train.data import unpack_pixels
from mars.train.locate import locate_dialogues
from mars.train.vision import (
    HEADS,
    ReadHeads,
    VisionPretrainConfig,
    cell_data,
    cell_heads,
    emblem_labels,
    pretrain_vision,
    read_accuracy,
    zoom_read_data,
)
from mars.world.generate import WorldSpec
from stages import sft

# the sft knobs these tests build on: every optional phase off (params.yaml's sft section turns them on), so each
# test names the phases it needs
NO_PHASES = dict(vision_pretrain_steps=0, vision_locate_steps=0, pretrain_steps=0, pretrain_drills=0, pretrain_locate=0,
                 pretrain_zoom_captions=0, locate_answers=0.0, locate_mix=0.0, locate_frame_steps=0,
                 locate_frame_captions=0, locate_steps=0, locate_target=0.0, locate_read_target=0.0,
                 locate_check_from=0, mix_pretrain=0.0, group_batches=1, compile=False)


def Params(**knobs) -> sft.Params:  # noqa: N802  (reads as the dataclass it builds)
    return sft.Params(**{**NO_PHASES, **knobs})


@pytest.fixture(scope="module")
def stack():
    tok = train_tokenizer(["the emblem"] * 4, vocab_size=300)
    proc = build_processor(tok, 56 * 56, 112 * 112)  # a small view keeps the tests quick
    scene = WorldSpec().scene_config()
    return tok, proc, scene


def tower(tok, seed: int = 0):
    cfg = tiny_config(len(tok), vision_hidden=32, vision_layers=1, window_size=112)
    return build_model(cfg, seed=seed).model.visual, cfg.vision_config.out_hidden_size


def test_emblem_labels_index_the_attribute_tables():
    # PALETTE = ("#1f3a93", "#2e6fdb", ...): #2e6fdb is 1, #8d99ae (the last of 16) is 15;
    # SHAPES = (circle, square, triangle, hexagon, ...): hexagon is 3; GLYPHS = "ABCDEFGHJKLMN...": K is 9 (no I);
    # PATTERNS = (stripes, dots, cross, ...): cross is 2; a missing glyph or pattern is the last class (24, 7)
    assert emblem_labels({"fill": "#2e6fdb", "shape": "hexagon", "glyph": "K", "pattern": "cross"}) == (1, 3, 9, 2)
    assert emblem_labels({"fill": "#8d99ae", "shape": "circle", "glyph": None, "pattern": None}) == (15, 0, 24, 7)
    assert HEADS == {"colour": 16, "shape": 8, "glyph": 25, "pattern": 8}


def test_zoom_read_data_is_the_zoom_crops_in_the_view(stack):
    _, proc, scene = stack
    data = zoom_read_data(scene, proc, 6, seed=3)
    rng = np.random.default_rng([3, 71])
    specs = [zoom_crop(scene, rng)[1] for _ in range(6)]  # the same draw, the same order
    assert [d[2] for d in data] == [emblem_labels(s) for s in specs]
    for packed, grid, _ in data:
        pv = unpack_pixels(packed)  # packed at a byte per value (mars.train.data.pack_pixels)
        assert pv.dtype == torch.float16 and grid.shape == (1, 3)
        assert int(grid.prod()) == pv.shape[0] and int(grid[0, 1] * grid[0, 2]) * 14 * 14 <= 112 * 112  # the view
    assert zoom_read_data(scene, proc, 0, seed=3) == []
    with pytest.raises(ValueError, match="must be >= 0"):
        zoom_read_data(scene, proc, -1, seed=3)


def test_read_heads_give_one_row_per_image():
    heads = ReadHeads(16)
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])  # 4 and 6 merged tokens
    out = heads(torch.randn(10, 16), grid)
    assert [tuple(o.shape) for o in out] == [(2, 16), (2, 8), (2, 25), (2, 8)]


def test_read_accuracy_counts_letters_and_patterns_only_where_drawn(stack):
    tok, proc, scene = stack
    visual, dim = tower(tok)
    data = zoom_read_data(scene, proc, 20, seed=1)
    heads = ReadHeads(dim)
    with torch.no_grad():  # constant predictions: colour 0 (navy), shape 0 (circle), letter A, pattern "none"
        for h, cls in zip(heads.heads, (0, 0, 0, 7)):
            h.weight.zero_()
            h.bias.zero_()
            h.bias[cls] = 1.0
    visual.train()
    acc = read_accuracy(visual, heads, data)
    ys = np.array([d[2] for d in data])
    # colour: the share of navy fills; shape: the share of circles; letter: the share of A among crops with a
    # letter; pattern: predicting "none" is never right over the crops that have a pattern
    assert acc["colour"] == pytest.approx(float(np.mean(ys[:, 0] == 0)))
    assert acc["shape"] == pytest.approx(float(np.mean(ys[:, 1] == 0)))
    has = ys[:, 2] < 24
    assert acc["glyph"] == pytest.approx(float(np.mean(ys[has, 2] == 0)))
    assert acc["pattern"] == 0.0
    assert visual.training  # the mode is restored


def test_pretrain_vision_fits_its_images_and_resumes_exactly(stack, tmp_path):
    tok, proc, scene = stack
    data = zoom_read_data(scene, proc, 32, seed=0)
    cfg = VisionPretrainConfig(steps=40, batch_size=8, lr=2e-3, checkpoint_every=20)
    visual, dim = tower(tok)
    full = pretrain_vision(visual, data, cfg, dim=dim, ckpt_dir=tmp_path / "a", fp="x")
    # 40 steps over 32 images: the summed cross-entropy (ln 8 + ln 25 + ln 8 = 7.38 at chance) falls
    assert full["loss_first"] > 6.0 and full["loss_final"] < full["loss_first"] - 1.0
    assert set(full["train_accuracy"]) == set(HEADS) and full["resumed_from"] == 0

    # a kill after step 20: only the step-20 checkpoint is left; the rerun resumes there and ends identical
    visual2, _ = tower(tok)
    pretrain_vision(visual2, data, cfg, dim=dim, ckpt_dir=tmp_path / "b", fp="x")
    shutil.rmtree(tmp_path / "b" / "step-000040")
    visual3, _ = tower(tok)
    resumed = pretrain_vision(visual3, data, cfg, dim=dim, ckpt_dir=tmp_path / "b", fp="x")
    assert resumed["resumed_from"] == 20 and resumed["loss_final"] == full["loss_final"]
    for (n, a), b in zip(visual.state_dict().items(), visual3.state_dict().values()):
        assert torch.equal(a, b), n

    # another fingerprint (changed params or inputs) starts fresh
    visual4, _ = tower(tok)
    assert pretrain_vision(visual4, data, cfg, dim=dim, ckpt_dir=tmp_path / "b", fp="y")["resumed_from"] == 0


def test_pretrain_vision_rejects_bad_input(stack, tmp_path):
    tok, proc, scene = stack
    visual, dim = tower(tok)
    with pytest.raises(ValueError, match="at least batch_size"):
        pretrain_vision(visual, zoom_read_data(scene, proc, 2, seed=0), VisionPretrainConfig(steps=1, batch_size=4),
                        dim=dim, ckpt_dir=tmp_path, fp="x")
    with pytest.raises(ValueError, match="lr > 0"):
        VisionPretrainConfig(lr=0.0)


def test_stage_params_for_phase_0():
    p = Params(vision_pretrain_steps=100, vision_pretrain_images=64, batch_size=16, checkpoint_every=10)
    cfg = p.vision_config()
    assert (cfg.steps, cfg.batch_size, cfg.lr, cfg.checkpoint_every) == (100, 16, 5e-4, 40)
    with pytest.raises(ValueError, match="freeze_vision"):
        Params(vision_pretrain_steps=100, freeze_vision=True)
    with pytest.raises(ValueError, match="vision_pretrain_images must be >= sft.batch_size"):
        Params(vision_pretrain_steps=100, vision_pretrain_images=8, batch_size=16)
    with pytest.raises(ValueError, match="vision_pretrain_steps must be >= 0"):
        Params(vision_pretrain_steps=-1)


def _box_cell(reply: str, rows: int, cols: int) -> int:
    """The cell index of the bbox_2d centre in a zoom reply, read with a regex (independent of the parser)."""
    import re

    x1, y1, x2, y2 = (float(v) for v in re.search(r'"bbox_2d": \[([^\]]*)\]', reply).group(1).split(","))
    return int((y1 + y2) / 2 * rows // 1000) * cols + int((x1 + x2) / 2 * cols // 1000)


def test_cell_data_labels_the_teachers_cell_and_skips_other_drills(stack):
    _, proc, scene = stack
    drills = locate_dialogues(scene, n=6, seed=4, system="S")
    text_only = [{"role": "user", "content": "Who founded it?"}, {"role": "assistant", "content": "<answer>x</answer>"}]
    image = drills[0][1]["content"][0]["image"]
    caption = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Read it"}]},
               {"role": "assistant", "content": "<think>a circle</think><answer>circle</answer>"}]
    data = cell_data([text_only, *drills[:3], caption, *drills[3:]], proc, 2, 2)
    assert len(data) == 6  # the text-only drill and the caption (no zoom) are skipped
    assert [d[2] for d in data] == [(_box_cell(d[-1]["content"], 2, 2),) for d in drills]
    assert len({d[2] for d in data}) > 1  # the frame moves between scenes
    # a drill that goes on to the crop and the answer (sft.locate_answers) is labelled by its zoom, not its answer
    answered = [d for d in locate_dialogues(scene, n=6, seed=4, system="S", answer_share=1.0) if len(d) > 3]
    assert answered and [d[2] for d in cell_data(answered, proc, 2, 2)] == [
        (_box_cell(d[2]["content"], 2, 2),) for d in answered]
    for packed, grid, _ in data:
        pv = unpack_pixels(packed)
        assert pv.dtype == torch.float16 and int(grid.prod()) == pv.shape[0]
    assert cell_heads(2, 3) == {"cell": 6}
    heads = ReadHeads(16, heads=cell_heads(2, 2))
    assert [tuple(o.shape) for o in heads(torch.randn(10, 16), torch.tensor([[1, 4, 4], [1, 4, 6]]))] == [(2, 4)]


def test_pretrain_vision_learns_the_framed_cell(stack, tmp_path):
    tok, proc, scene = stack
    train = cell_data(locate_dialogues(scene, n=64, seed=0), proc, 2, 2)
    visual, dim = tower(tok)
    res = pretrain_vision(visual, train, VisionPretrainConfig(steps=60, batch_size=16, lr=2e-3, checkpoint_every=60),
                          dim=dim, ckpt_dir=tmp_path, fp="x", heads=cell_heads(2, 2), test=train[:32])
    # one 4-way head: cross-entropy ln 4 = 1.39 at chance; measured: first 12 steps 1.32, last 12 0.60, 86% of the
    # training scenes right (chance 25%)
    assert res["loss_first"] > 1.2 and res["loss_final"] < 0.9
    assert set(res["train_accuracy"]) == {"cell"} and res["train_accuracy"]["cell"] >= 0.6


def test_stage_params_for_phase_0_localisation():
    p = Params(vision_locate_steps=150, pretrain_locate=64, locate_steps=300, batch_size=16, checkpoint_every=10,
               vision_lr=0.002)
    cfg = p.vision_locate_config()
    assert (cfg.steps, cfg.batch_size, cfg.lr, cfg.checkpoint_every) == (150, 16, 0.002, 10)
    with pytest.raises(ValueError, match="vision_locate_steps > 0 trains the vision tower"):
        Params(vision_locate_steps=10, pretrain_locate=64, locate_steps=5, freeze_vision=True)
    with pytest.raises(ValueError, match=r"pretrain_locate >= sft.batch_size \(16\), got 8"):
        Params(vision_locate_steps=10, pretrain_locate=8, locate_steps=5, batch_size=16)
    with pytest.raises(ValueError, match="vision_locate_steps must be >= 0"):
        Params(vision_locate_steps=-1)
    with pytest.raises(ValueError, match="which only the block .* or phase 1 .* draws"):
        Params(vision_locate_steps=10, pretrain_locate=64, pretrain_steps=0, locate_steps=0)
    Params(vision_locate_steps=10, pretrain_locate=64, pretrain_steps=10)  # phase 1's drills are enough
    with pytest.raises(ValueError, match=r"sft.locate_answers must be in \[0, 1\], got 1.5"):
        Params(locate_answers=1.5)


def test_locate_answers_reach_the_blocks_drills(stack):
    """sft.locate_answers: the block's perception drills go on to the crop and the answer (vision_drills)."""
    from mars.train.drawing import vision_drills

    _, _, scene = stack
    plain = vision_drills(Params(pretrain_locate=16, locate_steps=5), scene, "S")
    answered = vision_drills(Params(pretrain_locate=16, locate_steps=5, locate_answers=1.0), scene, "S")
    assert {len(d) for d in plain} == {3}
    assert {len(d) for d in answered} == {3, 5}  # multi-hop drills still stop at the zoom
    scenes = lambda ds: [np.asarray(d[1]["content"][0]["image"]).tobytes() for d in ds]  # noqa: E731
    assert scenes(answered) == scenes(plain)  # the same scenes, the answers drawn apart


def test_phase_two_groups_its_batches_and_the_earlier_phases_stay_shuffled():
    """``group_batches`` is phase 2's; phase 1 and the block keep plain shuffled batches (grouped, phase 1's batches
    come in runs of one drill kind and the model copied less; the block's would split its localisation drills from
    the shorter phase-1 drills)."""
    p = Params(group_batches=8, pretrain_steps=10, pretrain_drills=4, pretrain_locate=4, locate_steps=5)
    assert p.train_config().group_batches == 8
    assert p.pretrain_config().group_batches == 1
    assert p.locate_config().group_batches == 1


def test_locate_target_makes_the_block_stop_at_a_held_out_check():
    """``locate_target`` > 0 gives the block a :class:`mars.train.locate.LocateCheck` (held-out scenes drawn with
    another seed than the drills); 0 gives none; out-of-range knobs are errors."""
    from mars.train.locate import LocateCheck
    from mars.world.generate import WorldSpec
    from mars.train.cold_start import locate_check
    from mars.train.drawing import locate_block_dialogues
    from tests.model.test_model import tiny_stack

    _, proc, _ = tiny_stack()
    scene = WorldSpec.smoke().scene_config()
    p = Params(pretrain_locate=4, locate_steps=5, locate_target=0.9, locate_check_scenes=3, seed=2)
    check = locate_check(p, proc, scene, "sys", None)
    assert isinstance(check, LocateCheck) and (len(check.prompts), check.target) == (3, 0.9)
    train = locate_block_dialogues(p, scene, "sys")
    assert all(c[1]["content"] != t[1]["content"] for c, t in zip(check.prompts, train))  # new scenes
    assert (check.read_target, check.min_step, check.reading) == (0.0, 0, [])  # the frame alone, at every checkpoint
    assert locate_check(Params(pretrain_locate=4, locate_steps=5), proc, scene, "sys", None) is None
    both = locate_check(Params(pretrain_locate=4, locate_steps=5, locate_target=0.9, locate_check_scenes=3,
                               locate_answers=1.0, locate_read_target=0.6, locate_check_from=300, seed=2),
                        proc, scene, "sys", ["colour"])
    assert (both.read_target, both.min_step, len(both.prompts), len(both.reading)) == (0.6, 300, 3, 3)
    # the frame stage's check (sft.locate_frame_steps) has the frame alone, from the same step
    frame_only = locate_check(Params(pretrain_locate=4, locate_steps=5, locate_target=0.9, locate_check_scenes=3,
                                     locate_answers=1.0, locate_read_target=0.6, locate_check_from=300, seed=2),
                              proc, scene, "sys", ["colour"], read=False)
    assert (frame_only.read_target, frame_only.min_step, frame_only.reading) == (0.0, 300, [])
    with pytest.raises(ValueError, match=r"sft.locate_target must be in \[0, 1\]"):
        Params(locate_target=1.5)
    with pytest.raises(ValueError, match="sft.locate_check_scenes must be >= 1"):
        Params(locate_check_scenes=0)
    with pytest.raises(ValueError, match=r"sft.locate_read_target must be in \[0, 1\]"):
        Params(locate_read_target=-0.1)
    with pytest.raises(ValueError, match="needs the check .sft.locate_target > 0. and answered drills"):
        Params(locate_read_target=0.5, locate_answers=1.0)
    with pytest.raises(ValueError, match="needs the check .sft.locate_target > 0. and answered drills"):
        Params(locate_read_target=0.5, locate_target=0.9)
    with pytest.raises(ValueError, match="sft.locate_check_from must be >= 0"):
        Params(locate_check_from=-1)


def test_the_blocks_frame_stage_holds_its_drills_and_the_first_captions():
    """``locate_frame_steps`` > 0: the block's frame stage trains on its localisation drills and the first
    ``locate_frame_captions`` of its zoom captions (:func:`mars.train.drawing.frame_stage_dialogues`), the second stage on
    all of them; its knobs are checked."""
    from mars.world.generate import WorldSpec
    from mars.train.drawing import frame_stage_dialogues, locate_block_dialogues

    scene = WorldSpec.smoke().scene_config()
    p = Params(pretrain_locate=4, pretrain_zoom_captions=3, locate_steps=5, locate_frame_steps=4,
               locate_frame_captions=1)
    block = locate_block_dialogues(p, scene, "sys")
    frame = frame_stage_dialogues(p, block)
    assert len(block) == 7 and frame == block[:5]  # 4 drills (zoom calls), then 1 of the 3 captions (answers)
    assert all("image_zoom_in" in d[-1]["content"] for d in frame[:4]) and "<answer>" in frame[4][-1]["content"]
    assert frame_stage_dialogues(Params(pretrain_locate=4, pretrain_zoom_captions=3, locate_steps=5,
                                        locate_frame_steps=4), block) == block[:4]  # the drills alone
    assert frame_stage_dialogues(Params(pretrain_locate=4, pretrain_zoom_captions=3, locate_steps=5), block) == []
    assert p.locate_frame_config().optim.max_steps == 4 and p.locate_config().optim.max_steps == 5
    with pytest.raises(ValueError, match="sft.locate_frame_steps must be >= 0"):
        Params(locate_frame_steps=-1)
    with pytest.raises(ValueError, match="is the localisation block's first stage: set sft.locate_steps > 0"):
        Params(locate_frame_steps=10)
    with pytest.raises(ValueError, match=r"sft.locate_frame_captions must be in \[0, sft.pretrain_zoom_captions = 3\]"):
        Params(pretrain_locate=4, pretrain_zoom_captions=3, locate_steps=5, locate_frame_steps=4,
               locate_frame_captions=4)
    with pytest.raises(ValueError, match="sft.locate_frame_captions is the frame stage's: set sft.locate_frame_steps"):
        Params(pretrain_locate=4, pretrain_zoom_captions=3, locate_steps=5, locate_frame_captions=1)


def test_phase_one_gets_a_held_out_copy_score():
    """Phase 1's held-out drills get a :class:`mars.train.drills.CopyCheck` that scores the last weights (never a
    stopping rule: nothing to ask during training); no drills, no score."""
    from mars.train.drills import CopyCheck
    from mars.train.cold_start import copy_check
    from tests.model.test_model import tiny_stack

    _, proc, _ = tiny_stack()
    drills = [[{"role": "user", "content": [{"type": "text", "text": "q"}]},
               {"role": "assistant", "content": "<think>t</think><answer>a</answer>"}]] * 3
    check = copy_check(proc, drills)
    assert isinstance(check, CopyCheck) and len(check.prompts) == 3 and not callable(check)
    assert copy_check(proc, []) is None
    with pytest.raises(ValueError, match="sft.pretrain_check_drills must be >= 0"):
        Params(pretrain_steps=10, pretrain_drills=4, pretrain_check_drills=-1)
