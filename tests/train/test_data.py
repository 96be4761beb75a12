"""dialogues_digest: the training data's part of a checkpoint's fingerprint (roles, texts, image pixels, order)."""

from __future__ import annotations

import copy

from PIL import Image

from mars.train.data import dialogues_digest


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
    assert len(base) == 16 and int(base, 16) >= 0
    assert dialogues_digest(_dialogues()) == base  # equal data (new objects): equal digest, so a kill resumes
    assert dialogues_digest([]) == dialogues_digest([]) != base

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
