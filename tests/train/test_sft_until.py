"""``train_sft``'s stopping check (``until``) and the localisation block's check (:class:`LocateCheck`)."""

from __future__ import annotations

import copy

import pytest
import torch

from mars.model.chat import render
from mars.train.locate import LocateCheck, held_out_drills, locate_dialogues, zoom_cell
from mars.train.optim import OptimConfig
from mars.train.sft import SFTConfig, train_sft
from mars.world.generate import WorldSpec
from tests.model.test_model import tiny_stack
from tests.train.test_deepspeed import dialogues


def _cfg(steps: int) -> SFTConfig:
    return SFTConfig(optim=OptimConfig(lr=2e-3, warmup_steps=0, schedule="constant", max_steps=steps),
                     batch_size=2, checkpoint_every=2, seed=3)


class Recorder:
    """A check that stops from step ``at`` on and records each question (step, the model's training flag)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.asked = at, []

    def __call__(self, model, step: int) -> bool:
        self.asked.append((step, model.training))
        return self.at is not None and step >= self.at


def test_until_stops_at_a_checkpoint_and_a_rerun_resumes_into_the_same_stop(tmp_path):
    _, proc, base = tiny_stack()
    examples = [render(d, proc) for d in dialogues()]
    pad = proc.tokenizer.pad_token_id

    never = Recorder(None)
    full = train_sft(copy.deepcopy(base), examples, _cfg(8), pad_id=pad, ckpt_dir=tmp_path / "full", live_dir=None,
                     fp="f", until=never)
    # asked after the checkpoints of steps 2, 4 and 6 (not after the last), always in eval mode
    assert never.asked == [(2, False), (4, False), (6, False)]
    assert (full["steps"], full["stopped_early"], len(full["history"])) == (8, False, 8)

    stop = Recorder(4)
    model = copy.deepcopy(base)
    res = train_sft(model, examples, _cfg(8), pad_id=pad, ckpt_dir=tmp_path / "stop", live_dir=None, fp="f",
                    until=stop)
    assert stop.asked == [(2, False), (4, False)]
    assert (res["steps"], res["stopped_early"], res["resumed_from"]) == (4, True, 0)
    assert res["history"] == full["history"][:4]  # the same run up to the stop
    assert not model.training

    # a rerun (as after a kill once the check had answered) resumes at step 4, asks again and stops at once
    again = Recorder(4)
    res2 = train_sft(copy.deepcopy(base), examples, _cfg(8), pad_id=pad, ckpt_dir=tmp_path / "stop",
                     live_dir=None, fp="f", until=again)
    assert again.asked == [(4, False)]
    assert (res2["steps"], res2["stopped_early"], res2["resumed_from"]) == (4, True, 4)
    assert res2["history"] == res["history"]

    # the same rerun with a check that lets it go on trains to the end, as the uninterrupted run did
    on = Recorder(None)
    res3 = train_sft(copy.deepcopy(base), examples, _cfg(8), pad_id=pad, ckpt_dir=tmp_path / "stop",
                     live_dir=None, fp="f", until=on)
    assert on.asked == [(4, False), (6, False)]
    assert (res3["steps"], res3["stopped_early"]) == (8, False)
    assert res3["history"] == full["history"]


def test_locate_check_scores_held_out_scenes_against_the_teachers_cell():
    _, proc, base = tiny_stack()
    scene = WorldSpec.smoke().scene_config()
    prompts, truth = held_out_drills(scene, 6, seed=99, system="sys")
    full = locate_dialogues(scene, n=6, seed=99, system="sys")
    assert prompts == [d[:-1] for d in full]  # the drills without their answer turn
    assert all(p[-1]["role"] == "user" for p in prompts)
    assert all(t is not None and 0 <= t[0] < scene.grid_rows and 0 <= t[1] < scene.grid_cols for t in truth)
    from mars.agent.protocol import parse_turn

    assert truth == [zoom_cell(parse_turn(d[-1]["content"]), scene.grid_rows, scene.grid_cols) for d in full]

    check = LocateCheck(proc, scene, n=6, target=0.5, seed=99, system="sys")
    model = copy.deepcopy(base).eval()
    assert check(model, 50) is False  # a random-init model writes no zoom call: 0 of 6 framed
    assert check.history == [(50, 0.0)]
    assert check.reads == [] and check.scores(model, 50) == {"framed": 0.0}  # no read asked; not rescored
    assert check.history == [(50, 0.0)]
    with pytest.raises(ValueError, match="a localisation check needs n >= 1, 0 < target <= 1 and 0 <= read_target"):
        LocateCheck(proc, scene, n=6, target=0.0, seed=99)
    with pytest.raises(ValueError, match="0 <= read_target <= 1"):
        LocateCheck(proc, scene, n=6, target=0.5, seed=99, read_target=1.5)


def _memorised(base, proc, dialogues: list[list[dict]], tmp_path) -> torch.nn.Module:
    """A copy of ``base`` trained on ``dialogues`` until it writes their assistant turns back (greedy)."""
    examples = [render(d, proc) for d in dialogues]
    cfg = SFTConfig(optim=OptimConfig(lr=3e-3, warmup_steps=0, schedule="constant", max_steps=100),
                    batch_size=len(examples), checkpoint_every=1000, seed=0)
    model = copy.deepcopy(base)
    train_sft(model, examples, cfg, pad_id=proc.tokenizer.pad_token_id, ckpt_dir=tmp_path, live_dir=None, fp="m")
    return model.eval()


def test_locate_check_with_a_read_target_needs_the_frame_and_then_the_read(tmp_path):
    """With ``read_target`` > 0 the check passes only once the first zoom frames the held-out scene and the answer
    after the teacher's zoom is the teacher's; the read is asked only once the frame holds, nothing before
    ``min_step``. Models: the tiny random-init one (frames nothing), one that memorised the held-out drill's zoom
    (frames it, reads nothing) and one that memorised the zoom and the answer (both)."""
    from mars.train.locate import held_out_reads

    _, proc, base = tiny_stack()
    scene = WorldSpec.smoke().scene_config()
    check = LocateCheck(proc, scene, n=1, target=1.0, seed=99, system="sys", attributes=["colour"],
                        read_target=1.0, min_step=4, max_new_tokens=160)  # the tiny vocabulary's zoom: 147
    reads, answers = held_out_reads(scene, 1, seed=99, system="sys", attributes=["colour"], mcq_share=0.0)
    assert check.answers == answers and len(answers[0]) > 1  # an open question: the colour, not a letter
    zoom = locate_dialogues(scene, n=1, seed=99, system="sys", attributes=["colour"])
    answered = [reads[0] + [{"role": "assistant", "content": f"<think>the fill</think><answer>{answers[0]}</answer>"}]]

    assert check(base, 2) is False and check.history == [] and check.reads == []  # before min_step: not asked
    assert check(base, 4) is False and check.history == [(4, 0.0)] and check.reads == []  # no frame: no read asked

    frames = _memorised(base, proc, zoom, tmp_path / "zoom")
    assert check(frames, 6) is False
    assert (check.history[-1], check.reads) == ((6, 1.0), [(6, 0.0)])  # the frame holds, the read does not

    both = _memorised(base, proc, zoom + answered, tmp_path / "both")
    assert check(both, 8) is True
    assert check.scores(both, 8) == {"framed": 1.0, "read": 1.0}  # the stage's metrics: asked at step 8 already
    assert (len(check.history), len(check.reads)) == (3, 2)
    assert check.histories() == {"framed": [(4, 0.0), (6, 1.0), (8, 1.0)], "read": [(6, 0.0), (8, 1.0)]}
