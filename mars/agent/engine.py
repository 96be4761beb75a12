"""The multi-turn rollout engine: many episodes at once, one batched policy call per step, tools in a thread pool.

What it does
    :func:`stream_episodes` plays one episode per question (repeat a question for a GRPO group) and yields each
    episode as it finishes; :func:`run_episodes` collects them in question order. At most
    ``EngineConfig.max_live_episodes`` episodes are in play at once: a question is read (its image opened) when a
    slot frees, and a finished episode leaves at once, so memory is bounded however many questions come in
    (``bench/bench_engine_memory.py``). Each episode:

    1. the dialogue starts with the system prompt (:func:`~mars.agent.protocol.system_prompt` over
       :data:`~mars.tools.base.TOOL_SCHEMAS`) and a user message ``[image 0, question text]`` where image 0 is the
       question image at ``smart_resize(min_pixels, max_pixels)`` (:func:`~mars.tools.imaging.policy_view`);
    2. each step sends the dialogues of all episodes in play to ONE ``backend.generate`` call with
       ``max_new_tokens = max_new_tokens_per_turn`` (the same for every episode, so an episode's reply never
       depends on which others share its batch);
    3. every reply is appended as an assistant message (a plain string) and parsed with
       :func:`~mars.agent.protocol.parse_turn`:

       - a well-formed ``<answer>`` ends the episode (``finish_reason="answer"``);
       - a well-formed tool call is executed; the tool calls of the step run concurrently in a
         ``ThreadPoolExecutor(tool_workers)`` through ``toolbox.call`` (which never raises). The observation goes
         back as ONE user message whose content is ``[{"type": "text", "text": format_tool_response(obs.text,
         n_images)}, {"type": "image", "image": img}, ...]``: the text first, then the tool's images (crops,
         thumbnails) in order; those images get the next dialogue indices (img_idx);
       - a malformed turn (any :class:`~mars.agent.protocol.FormatError`; with ``EngineConfig.lenient`` only turns
         without a usable action) is counted in ``n_format_errors`` and answered with a user message holding
         :func:`~mars.agent.protocol.format_error_observation`; nothing ever raises;
    4. an episode also ends when it has used ``max_turns`` assistant turns (``"max_turns"``) or its generated tokens
       reach ``max_total_tokens`` (``"token_budget"``), or when the backend reports a failed request
       (``Generation.finish_reason == "error"`` -> ``"backend_error"``, not counted as a format error). Finished
       episodes leave the batch, and the next questions take their slots.

    Then each episode is judged with :func:`mars.rl.judge.rule_judge` (gold = ``[answer] + aliases``; ``choices``
    for multiple choice) and rewarded with :func:`mars.rl.rewards.compute_reward` (``format_ok`` over the parsed
    turns and the count of tool errors). :func:`trajectories_table` turns the :class:`Trajectory` records into the
    TRAJECTORIES table (:data:`mars.data.schemas.TRAJECTORIES`): messages as JSON with images replaced by
    ``{"type": "image", "ref": i}``, and ``images`` holding the PNG bytes of every image as shown, in order.

Messages format (what a :class:`PolicyBackend` receives)
    ``{"role": "system" | "user" | "assistant", "content": str | [{"type": "text", "text": ...} |
    {"type": "image", "image": PIL.Image}]}``; assistant messages may also hold ``"token_ids"`` (see below). The
    dialogue lists are the engine's own: backends must not mutate them.

Sampled tokens
    When the backend returns the ids it sampled, the assistant message carries them (``"token_ids"``) beside its
    text, and :func:`mars.model.chat.render` renders the turn from them: an in-process policy conditions its later
    turns on, and the RL trainer trains, exactly those ids, never a re-tokenisation of the text. Over HTTP the
    server renders earlier turns from their text (the OpenAI chat API carries no ids), so a sampled split that the
    tokenizer would not produce changes the server's context of later turns; the trainer logs the gap.

Token accounting
    The budget counts GENERATED tokens only (tool outputs are masked out of the loss and do not count in GSPO's
    |y|, docs/design.md, The agent protocol): ``len(token_ids)`` when the backend returns them, else
    ``ceil(len(text) / 4)``. The budget is checked after each turn, so an episode can overshoot it by less than one
    turn.
    ``token_ids`` / ``logprobs`` of a trajectory are the concatenation over its turns, kept only when every turn
    had them; ``turn_tokens`` holds each turn's count, so per-turn boundaries can be recovered.

Deviations
    - The image the tools read for index 0 is the ORIGINAL full-resolution question image by default
      (``EngineConfig.tool_image0 = "original"``); every later image is the one the policy saw. Relative 0..1000
      boxes name the same region on either, so boxes still refer to what the model saw, but a zoom then shows real
      detail, as in the reference (which crops the original high-resolution image): cropping the 224-px view
      of a 2K scene could never make an emblem recognisable. ``"shown"`` passes the policy's view instead (and is
      forced when the tool box uses absolute pixel coordinates).
    - ``EngineConfig.lenient = False`` (default) treats any malformed turn as failed, like the reference's
      anchored format regex; ``True`` executes a usable action from an imperfect turn (still a format error).
    - The seed passed to ``backend.generate`` is ``seed + step``. With more questions than
      ``max_live_episodes``, which episodes share a step depends on the bound, so sampled (not greedy) episodes
      depend on it too; up to the bound, the episodes are those of one unbounded batch.
    - ``EngineConfig.prompt = "compact"`` swaps the reference's ~700-token system prompt for a short one
      (:func:`~mars.agent.protocol.compact_system_prompt`); the embedded default's tiny model uses it.
      ``"direct"`` (evaluation's direct-answer workflow) lists no tools.

How to run (Python)::
        cfg = EngineConfig(max_turns=6)
        trajs = run_episodes(questions, ScriptedBackend(policy), ToolBox.from_dirs(idx, gallery), cfg, seed=0,
                              image_root=world_dir)
        write_table(trajectories_table(trajs), "trajectories.parquet", TRAJECTORIES)

    Tests: ``.venv/bin/python -m pytest tests/agent -q``; accuracy of the oracle and the no-tool baseline on a world:
    ``python -m mars.agent.oracle --world-dir data/world --index-dir data/index``.
"""

from __future__ import annotations

import io
import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import pyarrow as pa
from PIL import Image

from mars.agent.protocol import (
    DIRECT_SYSTEM_PROMPT,
    ParsedTurn,
    compact_system_prompt,
    format_error_observation,
    format_ok,
    format_tool_response,
    parse_turn,
    system_prompt,
)
from mars.data.schemas import TRAJECTORIES
from mars.errors import StageError
from mars.rl.judge import rule_judge
from mars.rl.rewards import RewardWeights, compute_reward
from mars.tools.base import TOOL_NAMES, TOOL_SCHEMAS, Observation
from mars.tools.imaging import policy_view

__all__ = [
    "EngineConfig",
    "Generation",
    "PolicyBackend",
    "Trajectory",
    "FINISH_REASONS",
    "messages_to_json",
    "run_episodes",
    "stream_episodes",
    "trajectories_table",
]

FINISH_REASONS: tuple[str, ...] = ("answer", "max_turns", "token_budget", "backend_error")


@dataclass
class Generation:
    """One assistant turn from a backend. ``finish_reason``: "stop", "length" or "error" (request failed)."""

    text: str
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str = "stop"


@runtime_checkable
class PolicyBackend(Protocol):
    """Anything that continues a batch of dialogues by one assistant turn each (same order)."""

    def generate(
        self, dialogues: list[list[dict]], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Generation]: ...


@dataclass(frozen=True)
class EngineConfig:
    """Rollout limits and the policy's image resolution (see the module docstring)."""

    max_turns: int = 10
    max_new_tokens_per_turn: int = 256
    max_total_tokens: int = 4096
    temperature: float = 0.0
    top_p: float = 1.0
    tool_workers: int = 8
    max_live_episodes: int = 64  # episodes in play at once (their images, dialogues and the backend's caches)
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    factor: int = 28  # view sides are multiples of this: the model's patch x merge (Qwen2.5-VL 28, Qwen3-VL 32)
    lenient: bool = False
    tool_image0: str = "original"  # "original" | "shown"
    prompt: str = "full"  # "full" (the reference's) | "compact" (short, tiny models) | "direct" (no tools)

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens_per_turn", "max_total_tokens", "tool_workers",
                     "max_live_episodes", "min_pixels", "max_pixels", "factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"EngineConfig.min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.prompt not in ("full", "compact", "direct"):
            raise ValueError(f"EngineConfig.prompt must be 'full', 'compact' or 'direct', got {self.prompt!r}")
        if self.tool_image0 not in ("original", "shown"):
            raise ValueError(f"EngineConfig.tool_image0 must be 'original' or 'shown', got {self.tool_image0!r}")


@dataclass
class Trajectory:
    """One finished episode: the TRAJECTORIES row fields plus the live dialogue for in-process consumers."""

    question_id: str
    episode_id: str
    messages: list[dict]
    images: list[Image.Image]  # every image as shown to the policy, in dialogue order
    tool_calls: list[dict]
    parsed_turns: list[ParsedTurn]
    n_turns: int
    n_tool_calls: int
    n_tool_errors: int
    n_format_errors: int
    answer: str | None
    finish_reason: str
    correct: bool
    reward: float
    reward_answer: float
    reward_format: float
    judge: str
    token_ids: list[int] | None
    logprobs: list[float] | None
    n_generated_tokens: int = 0
    turn_tokens: list[int] = field(default_factory=list)  # generated tokens per assistant turn (|y| per turn)

    def row(self) -> dict:
        """The TRAJECTORIES row of this episode."""
        return dict(
            question_id=self.question_id,
            episode_id=self.episode_id,
            messages_json=messages_to_json(self.messages, self.images),
            images=[_png(im) for im in self.images],
            tool_calls_json=json.dumps(self.tool_calls, ensure_ascii=False),
            n_turns=self.n_turns,
            n_tool_calls=self.n_tool_calls,
            n_tool_errors=self.n_tool_errors,
            n_format_errors=self.n_format_errors,
            answer=self.answer,
            finish_reason=self.finish_reason,
            correct=self.correct,
            reward=float(self.reward),
            reward_answer=float(self.reward_answer),
            reward_format=float(self.reward_format),
            judge=self.judge,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            turn_tokens=list(self.turn_tokens),
        )


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def messages_to_json(messages: list[dict], images: Sequence[Image.Image]) -> str:
    """The dialogue as JSON, each image item replaced by ``{"type": "image", "ref": i}`` (its dialogue index)."""
    index = {id(im): i for i, im in enumerate(images)}
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    parts.append({"type": "image", "ref": index.get(id(p.get("image")), -1)})
                else:
                    parts.append({"type": "text", "text": p.get("text", "")})
            content = parts
        out.append({"role": m["role"], "content": content})
    return json.dumps(out, ensure_ascii=False)


def trajectories_table(trajectories: Sequence[Trajectory]) -> pa.Table:
    """The TRAJECTORIES table of ``trajectories`` (one row per episode)."""
    return pa.Table.from_pylist([t.row() for t in trajectories], schema=TRAJECTORIES)


# ------------------------------------------------------------------------------------------------ episodes


@dataclass
class _Episode:
    idx: int
    question: dict
    messages: list[dict]
    shown: list[Image.Image]  # images as shown to the policy
    tool_images: list[Image.Image]  # what the tools read (index 0 may be the original)
    parsed: list[ParsedTurn] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    n_tool_errors: int = 0
    n_format_errors: int = 0
    tokens: int = 0
    turn_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] | None = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    answer: str | None = None
    finish: str | None = None
    image_key: str | None = None  # the shared question image it holds (_Images)


def _choices(q: dict) -> dict[str, str] | None:
    c = q.get("choices")
    if c is None:
        return None
    if isinstance(c, str):
        try:
            c = json.loads(c)
        except ValueError:
            return None
    return {str(k): str(v) for k, v in c.items()} if isinstance(c, dict) and c else None


def _question_image(q: dict, image_root: Path | None) -> Image.Image:
    img = q.get("image")
    if isinstance(img, Image.Image):
        return img.convert("RGB") if img.mode != "RGB" else img
    path = Path(q["image_path"])
    if image_root is not None and not path.is_absolute():
        path = Path(image_root) / path
    with Image.open(path) as im:
        return im.convert("RGB")


def _count_tokens(g: Generation) -> int:
    if g.token_ids is not None:
        return len(g.token_ids)
    return math.ceil(len(g.text or "") / 4)


class _Images:
    """The question images of the episodes in play, opened once per image and shared by the episodes that show it
    (the k episodes of a question): ``(original, shown)`` by the question's image path, dropped with the last
    episode that holds it. Questions that carry a PIL image are not cached."""

    def __init__(self, cfg: EngineConfig, image_root: Path | None):
        self.cfg, self.root = cfg, image_root
        self.held: dict[str, list] = {}  # path -> [original, shown, episodes holding it]

    def take(self, q: dict) -> tuple[Image.Image, Image.Image, str | None]:
        cfg = self.cfg
        if isinstance(q.get("image"), Image.Image) or "image_path" not in q:
            original = _question_image(q, self.root)
            return original, policy_view(original, cfg.min_pixels, cfg.max_pixels, cfg.factor), None
        key = str(q["image_path"])
        if key not in self.held:
            original = _question_image(q, self.root)
            self.held[key] = [original, policy_view(original, cfg.min_pixels, cfg.max_pixels, cfg.factor), 0]
        entry = self.held[key]
        entry[2] += 1
        return entry[0], entry[1], key

    def drop(self, key: str | None) -> None:
        if key is not None:
            self.held[key][2] -= 1
            if not self.held[key][2]:
                del self.held[key]


def _start(i: int, q: dict, sys_prompt: str, cfg: EngineConfig, images: _Images, absolute: bool) -> _Episode:
    original, shown, key = images.take(q)
    tool0 = original if (cfg.tool_image0 == "original" and not absolute) else shown
    messages = [
        {"role": "system", "content": sys_prompt},
        {"role": "user", "content": [{"type": "image", "image": shown}, {"type": "text", "text": str(q["question"])}]},
    ]
    return _Episode(i, q, messages, [shown], [tool0], image_key=key)


def _apply_generation(ep: _Episode, g: Generation, cfg: EngineConfig) -> ParsedTurn | None:
    """Record one reply. Returns the parsed turn when it asks for a tool call to execute, else None."""
    text = g.text if isinstance(g.text, str) else ("" if g.text is None else str(g.text))
    if g.finish_reason == "error":
        ep.finish = "backend_error"
        return None
    msg: dict = {"role": "assistant", "content": text}
    if g.token_ids is not None:
        msg["token_ids"] = [int(t) for t in g.token_ids]  # what the policy sampled: rendered and trained as is
    ep.messages.append(msg)
    ep.turn_tokens.append(_count_tokens(g))
    ep.tokens += ep.turn_tokens[-1]
    if ep.token_ids is not None:
        ep.token_ids = ep.token_ids + list(g.token_ids) if g.token_ids is not None else None
    if ep.logprobs is not None:
        ep.logprobs = ep.logprobs + [float(x) for x in g.logprobs] if g.logprobs is not None else None
    turn = parse_turn(text, TOOL_NAMES)
    ep.parsed.append(turn)
    usable = turn.action != "invalid" and (turn.well_formed or cfg.lenient)
    if not turn.well_formed:
        ep.n_format_errors += 1
    if usable and turn.action == "answer":
        ep.answer = turn.answer
        ep.finish = "answer"
        return None
    if usable and turn.action == "tool_call":
        return turn
    ep.messages.append({"role": "user", "content": [{"type": "text", "text": format_error_observation(turn.errors)}]})
    return None


def _after_turn(ep: _Episode, cfg: EngineConfig) -> None:
    if ep.finish is not None:
        return
    if len(ep.parsed) >= cfg.max_turns:
        ep.finish = "max_turns"
    elif ep.tokens >= cfg.max_total_tokens:
        ep.finish = "token_budget"


def _observe(ep: _Episode, turn: ParsedTurn, fut: Future) -> None:
    """Append the tool's observation (or an internal error) to the episode."""
    try:
        obs = fut.result()
    except StageError:
        raise  # a tool service past its failure budget stops the rollout with its message
    except Exception as exc:  # a tool box other than ours might raise: never crash the rollout
        obs = Observation(text=f"internal tool error: {type(exc).__name__}", error="internal tool error")
    imgs = [im if im.mode == "RGB" else im.convert("RGB") for im in (obs.images or [])]
    ep.tool_calls.append(
        dict(turn=len(ep.parsed) - 1, name=turn.tool_name, arguments=turn.arguments, error=obs.error,
             latency_s=round(float(obs.latency_s), 6))
    )
    if obs.error is not None:
        ep.n_tool_errors += 1
    content: list[dict] = [{"type": "text", "text": format_tool_response(obs.text, len(imgs))}]
    content += [{"type": "image", "image": im} for im in imgs]
    ep.messages.append({"role": "user", "content": content})
    ep.shown.extend(imgs)
    ep.tool_images.extend(imgs)


def _score(ep: _Episode, weights: RewardWeights) -> Trajectory:
    q = ep.question
    gold = [str(q["answer"])] + [str(a) for a in (q.get("aliases") or [])]
    if ep.answer is not None:
        jr = rule_judge(ep.answer, gold, choices=_choices(q))
        correct, judge = jr.correct, f"{jr.judge}:{jr.method}"
    else:
        correct, judge = False, "rule:no_answer"
    rb = compute_reward(correct, format_ok(ep.parsed, ep.n_tool_errors), weights)
    qid = str(q.get("question_id", ep.idx))
    return Trajectory(
        question_id=qid,
        episode_id=f"{qid}/{ep.idx}",
        messages=ep.messages,
        images=ep.shown,
        tool_calls=ep.tool_calls,
        parsed_turns=ep.parsed,
        n_turns=len(ep.parsed),
        n_tool_calls=len(ep.tool_calls),
        n_tool_errors=ep.n_tool_errors,
        n_format_errors=ep.n_format_errors,
        answer=ep.answer,
        finish_reason=ep.finish or "max_turns",
        correct=rb.correct,
        reward=rb.total,
        reward_answer=rb.answer,
        reward_format=rb.format,
        judge=judge,
        token_ids=ep.token_ids if ep.parsed else None,
        logprobs=ep.logprobs if ep.parsed else None,
        n_generated_tokens=ep.tokens,
        turn_tokens=ep.turn_tokens,
    )


def stream_episodes(
    questions: Iterable[dict],
    backend: PolicyBackend,
    toolbox: Any,
    cfg: EngineConfig = EngineConfig(),
    *,
    seed: int = 0,
    image_root: str | Path | None = None,
    weights: RewardWeights = RewardWeights(),
) -> Iterator[tuple[int, Trajectory]]:
    """Play one episode per question, at most ``cfg.max_live_episodes`` at a time; yields ``(index, trajectory)``
    as each episode finishes (finishing order; index order within a step).

    ``questions`` is read lazily: a question is taken (and its image opened) only when a slot is free, so a
    generator of millions of questions plays in bounded memory. A finished episode leaves the engine at once: the
    engine keeps nothing of it, and a backend with a ``release(dialogues)`` method (:class:`HFBackend
    <mars.agent.hf_backend.HFBackend>`) is told to drop its cache entries.
    A question is a dict with ``question``, ``answer`` and optionally ``question_id``, ``aliases``, ``choices``
    (JSON string or dict) and either ``image`` (a PIL image) or ``image_path`` (relative to ``image_root``).
    ``toolbox`` is a :class:`~mars.tools.toolbox.ToolBox` (anything with ``call(name, arguments, images)``).
    """
    sys_prompt = {"full": system_prompt, "compact": compact_system_prompt,
                  "direct": lambda _: DIRECT_SYSTEM_PROMPT}[cfg.prompt](TOOL_SCHEMAS)
    absolute = getattr(getattr(toolbox, "cfg", None), "coords", "relative") == "absolute"
    images = _Images(cfg, Path(image_root) if image_root is not None else None)
    release = getattr(backend, "release", None)
    pending = enumerate(questions)
    active: list[_Episode] = []
    step = 0
    with ThreadPoolExecutor(max_workers=cfg.tool_workers, thread_name_prefix="mars-tool") as pool:
        while True:
            while len(active) < cfg.max_live_episodes:
                nxt = next(pending, None)
                if nxt is None:
                    break
                active.append(_start(nxt[0], dict(nxt[1]), sys_prompt, cfg, images, absolute))
            if not active:
                return
            gens = backend.generate(
                [ep.messages for ep in active],
                max_new_tokens=cfg.max_new_tokens_per_turn,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=seed + step,
            )
            if len(gens) != len(active):
                raise RuntimeError(f"backend returned {len(gens)} generations for {len(active)} dialogues")
            calls: list[tuple[_Episode, ParsedTurn]] = []
            for ep, g in zip(active, gens):
                turn = _apply_generation(ep, g, cfg)
                if turn is not None:
                    calls.append((ep, turn))
            futures = [
                pool.submit(toolbox.call, t.tool_name, t.arguments, list(ep.tool_images)) for ep, t in calls
            ]
            for (ep, turn), fut in zip(calls, futures):
                _observe(ep, turn, fut)
            for ep in active:
                _after_turn(ep, cfg)
            step += 1
            done = [ep for ep in active if ep.finish is not None]
            active = [ep for ep in active if ep.finish is None]
            if done and release is not None:
                release([ep.messages for ep in done])
            for ep in done:
                images.drop(ep.image_key)
                yield ep.idx, _score(ep, weights)


def run_episodes(
    questions: Sequence[dict],
    backend: PolicyBackend,
    toolbox: Any,
    cfg: EngineConfig = EngineConfig(),
    *,
    seed: int = 0,
    image_root: str | Path | None = None,
    weights: RewardWeights = RewardWeights(),
) -> list[Trajectory]:
    """Every episode of :func:`stream_episodes`, in question order (all trajectories are kept: for a batch)."""
    out: dict[int, Trajectory] = dict(stream_episodes(questions, backend, toolbox, cfg, seed=seed,
                                                      image_root=image_root, weights=weights))
    return [out[i] for i in range(len(out))]
