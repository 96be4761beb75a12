"""search_chain: which link of the search chain (top-1 title, copied query, answer in the snippet, answer) fails."""

from __future__ import annotations

import json

import pyarrow as pa

from mars.agent.protocol import format_answer, format_tool_call, format_tool_response
from mars.eval.run import search_chain

QUESTIONS = {
    "q1": {"type": "search", "entity_id": "e1", "answer": "1776"},
    "q2": {"type": "multi-hop", "entity_id": "e2", "answer": "Stirex"},
    "q3": {"type": "perception", "entity_id": "e1", "answer": "circle"},
}
NAMES = {"e1": "Larus Shipyard", "e2": "Bor Mill"}


def _row(qid: str, model: str, correct: bool, *turns: str | tuple[str, str]) -> dict:
    """An episode: a str is an assistant turn, a one-tuple the tool observation (a user turn) that follows it."""
    msgs = [{"role": "user", "content": [{"type": "image", "ref": 0}, {"type": "text", "text": "?"}]}]
    for t in turns:
        if isinstance(t, tuple):
            msgs.append({"role": "user", "content": [{"type": "text", "text": format_tool_response(t[0])},
                                                     {"type": "image", "ref": 1}]})
        else:
            msgs.append({"role": "assistant", "content": t})
    return {"question_id": qid, "model": model, "workflow": "agentic", "messages_json": json.dumps(msgs),
            "correct": correct}


def _images(*titles: str) -> tuple[str]:
    lines = [f"[{i + 1}] {t}" for i, t in enumerate(titles)]
    return ("Image search results for image 0:\n" + "\n".join(lines) + "\nThumbnails follow.",)


def _search(query: str) -> str:
    return format_tool_call("text_search", {"query": query}, "look it up")


IMAGE = format_tool_call("image_search", {"img_idx": 0}, "whose emblem?")
ZOOM = format_tool_call("image_zoom_in", {"bbox_2d": [100, 100, 300, 300], "label": "x", "img_idx": 0}, "zoom")
SNIPPET_YEAR = ("[1] Larus Shipyard: founded in 1776 in Cabraron by Heapoll Quezath.",)
SNIPPET_NONE = ("[1] Laros Works: founded in 1801.",)


def test_each_link_of_the_chain_is_counted_where_the_episode_reaches_it():
    rows = [
        # right title, copied, the year in the snippet, answered right: every link
        _row("q1", "a", True, IMAGE, _images("Larus Shipyard crest", "Bor Mill logo"),
             _search("Larus Shipyard founded"), SNIPPET_YEAR, format_answer("1776", "t")),
        # right title, drifted query ("Laros"), nothing in the snippet
        _row("q1", "a", False, IMAGE, _images("Larus Shipyard crest"), _search("Laros Shipyard founded"),
             SNIPPET_NONE, format_answer("1801", "t")),
        # a wrong top-1 title, copied faithfully (a copy even so), the answer not in its snippet
        _row("q2", "a", False, ZOOM, ("Zoomed in.",), IMAGE, _images("Other Mill logo", "Bor Mill logo"),
             _search("Other Mill city"), SNIPPET_NONE, format_answer("x", "t")),
        # a malformed turn is skipped; right title, copied; the city in the snippet (any case), answered wrong
        _row("q2", "a", False, ZOOM, ("Zoomed in.",), "<think>x</think><tool_call>{bad json</tool_call>",
             ("Format error.",), IMAGE, _images("Bor Mill emblem"), _search("Bor Mill city"),
             ("[1] Bor Mill: based in STIREX since 1900.",), format_answer("Lagos", "t")),
        # never searched: a miss of every link
        _row("q1", "a", False, format_answer("1900", "t")),
        _row("q3", "a", True, ZOOM, ("Zoomed in.",), format_answer("circle", "t")),  # perception: not counted
        _row("q9", "a", True, format_answer("x", "t")),  # not a known question: not counted
        # run b: a text search BEFORE any image search does not count; none after it
        _row("q1", "b", False, _search("Larus Shipyard founded"), SNIPPET_YEAR, IMAGE, _images("Larus Shipyard logo"),
             format_answer("1776", "t")),
    ]
    got = search_chain(pa.Table.from_pylist(rows), QUESTIONS, NAMES)
    # run a, 5 episodes: an image search in episodes 1-4 (4/5); top-1 right in 1, 2, 4 (3/5); query copies the top-1
    # in 1, 3, 4 (3/5); the answer in the snippet in 1, 4 (2/5); right among those: episode 1 (1/2)
    assert got == {
        "a/agentic": {"chain_episodes": 5, "chain_image_searched": 0.8, "chain_top1_right": 0.6,
                      "chain_query_copies_top1": 0.6, "chain_snippet_has_answer": 0.4, "chain_right_given_snippet": 0.5},
        "b/agentic": {"chain_episodes": 1, "chain_image_searched": 1.0, "chain_top1_right": 1.0,
                      "chain_query_copies_top1": 0.0, "chain_snippet_has_answer": 0.0, "chain_right_given_snippet": None},
    }
    assert search_chain(pa.Table.from_pylist(rows[5:7]), QUESTIONS, NAMES) == {}  # no search episode, no entry
