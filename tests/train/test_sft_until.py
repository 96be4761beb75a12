"""``train_sft``'s stopping check (``until``) and the localisation block's check (:class:`LocateCheck`)."""

from __future__ import annotations

import copy

import pytest

from mars.model.chat import render
from mars.synth.locate import LocateCheck, held_out_drills, locate_dialogues, zoom_cell
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
    with pytest.raises(ValueError, match="a localisation check needs n >= 1 and 0 < target <= 1"):
        LocateCheck(proc, scene, n=6, target=0.0, seed=99)
