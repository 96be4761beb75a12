"""The ``agent`` params section: one rollout and tool configuration shared by sft, rl and evaluate.

What it does
    :class:`AgentParams` is loaded from params.yaml's ``agent`` section (with the profile's overrides) by every
    stage that plays episodes, so the teacher's trajectories, RL's rollouts and evaluation run under the same
    limits, prompt, image resolution, tools and reward weights: training and evaluation cannot disagree.
    :meth:`AgentParams.engine` and :meth:`AgentParams.tools` build the :class:`~mars.agent.engine.EngineConfig`
    and :class:`~mars.tools.toolbox.ToolConfig`; :meth:`AgentParams.toolbox` opens the index stage's output.

Run: ``python -c "from mars.params import load_params; from mars.agent.config import AgentParams;
print(load_params('agent', AgentParams))"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mars.agent.engine import EngineConfig
from mars.rl.rewards import RewardWeights

__all__ = ["AgentParams"]


@dataclass(frozen=True)
class AgentParams:
    max_turns: int = 6
    max_new_tokens_per_turn: int = 128
    max_total_tokens: int = 384
    min_pixels: int = 56 * 56  # the policy's view of each image (Qwen smart_resize bounds)
    max_pixels: int = 224 * 224
    factor: int = 28  # image sides are multiples of the model's patch x merge: Qwen2.5-VL 28, Qwen3-VL 32
    prompt: str = "compact"  # full | compact
    tool_image0: str = "original"  # original | shown: what zoom crops for image 0
    lenient: bool = False
    tool_workers: int = 4
    max_live_episodes: int = 64  # episodes in play at once: 64 on a CPU; a vLLM endpoint takes hundreds
    coords: str = "relative"  # relative (0..1000) | absolute (pixels)
    zoom_min_pixels: int = 56 * 56
    zoom_max_pixels: int = 224 * 224
    text_k: int = 2
    max_snippet_chars: int = 160
    max_output_chars: int = 600
    image_k: int = 3
    thumb_size: int = 56
    reward_answer: float = 1.0
    reward_format: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        self.engine()  # validate now, with EngineConfig's messages
        self.tools()
        RewardWeights(answer=self.reward_answer, format=self.reward_format)

    def check_processor(self, processor, where: str) -> None:
        """Raise unless the model's processor cuts images into ``factor``-px merged tokens (patch x merge), so the
        views and crops the tools make are the sizes the model sees (a Qwen3-VL model needs ``agent.factor: 32``)."""
        ip = processor.image_processor
        got = int(ip.patch_size) * int(ip.merge_size)
        if got != self.factor:
            raise ValueError(f"{where}: the model's processor uses {ip.patch_size}-px patches merged {ip.merge_size}x"
                             f"{ip.merge_size} ({got} px per token side), but agent.factor is {self.factor}; set "
                             f"agent.factor: {got} in params.yaml")

    def engine(self, temperature: float = 0.0, top_p: float = 1.0) -> EngineConfig:
        return EngineConfig(
            max_turns=self.max_turns,
            max_new_tokens_per_turn=self.max_new_tokens_per_turn,
            max_total_tokens=self.max_total_tokens,
            temperature=temperature,
            top_p=top_p,
            tool_workers=self.tool_workers,
            max_live_episodes=self.max_live_episodes,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            factor=self.factor,
            lenient=self.lenient,
            tool_image0=self.tool_image0,
            prompt=self.prompt,
        )

    def tools(self):
        from mars.tools.toolbox import ToolConfig

        return ToolConfig(
            coords=self.coords,
            factor=self.factor,
            min_pixels=self.zoom_min_pixels,
            max_pixels=self.zoom_max_pixels,
            text_k=self.text_k,
            max_snippet_chars=self.max_snippet_chars,
            max_output_chars=self.max_output_chars,
            image_k=self.image_k,
            thumb_size=self.thumb_size,
        )

    def weights(self) -> RewardWeights:
        return RewardWeights(answer=self.reward_answer, format=self.reward_format)

    def toolbox(self, index_dir: str | Path, gallery_dir: str | Path):
        from mars.tools.toolbox import ToolBox

        return ToolBox.from_dirs(index_dir, gallery_dir, self.tools())
