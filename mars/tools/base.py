"""The agent's tool protocol: the :class:`Observation` a tool returns and the tools' JSON schemas.

What it does
    :class:`Observation` is what every tool call gives back to the policy: ``text`` (always set, also for
    errors, so the model can read what went wrong), ``images`` (crops or thumbnails, inserted into the
    dialogue after the text), ``error`` (``None`` on success; otherwise the same message as ``text``, used to
    count model-caused tool errors for the format reward) and ``latency_s`` (wall-clock time of the call).

    :data:`TOOL_SCHEMAS` describes the three tools in the OpenAI function-calling format
    (``{"type": "function", "function": {"name", "description", "parameters"}}``), ready to pass as
    ``tools=`` to a chat template (Qwen2.5-VL's template renders them into the system prompt).
    :data:`TOOL_NAMES` lists their names.

    - ``image_zoom_in(bbox_2d, label, img_idx)``: crop image ``img_idx`` of the dialogue at ``bbox_2d``.
    - ``image_search(img_idx)``: reverse image search for image ``img_idx`` (titles plus thumbnails).
    - ``text_search(query)``: keyword search over the text corpus (numbered snippets).

Deviation from the paper
    MARS's tools search the live web (text search API, reverse image search). Here they search an offline,
    generated world (docs/design.md, The embedded default world). The boxes follow the reference release and
    Qwen2.5-VL grounding: relative coordinates on a 0..1000 grid by default (``ToolConfig.coords =
    "absolute"`` switches to pixels of the image as shown to the policy).

How to run
    >>> from mars.tools.base import TOOL_SCHEMAS, Observation
    >>> tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS)
    The implementation of the tools is :class:`mars.tools.toolbox.ToolBox`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

__all__ = ["Observation", "TOOL_NAMES", "TOOL_SCHEMAS", "ZOOM", "IMAGE_SEARCH", "TEXT_SEARCH", "TOOL_ARGS"]

ZOOM = "image_zoom_in"
IMAGE_SEARCH = "image_search"
TEXT_SEARCH = "text_search"


@dataclass
class Observation:
    """The result of one tool call. ``error`` is ``None`` on success; on failure ``text`` repeats it."""

    text: str
    images: list[Image.Image] = field(default_factory=list)
    error: str | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


TOOL_SCHEMAS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": ZOOM,
            "description": (
                "Zoom in on a region of an image of the dialogue: crops image img_idx at bbox_2d and returns the "
                "crop, enlarged, as a new image. Use it to see small details such as an emblem in a large scene."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "bbox_2d": {
                        "type": "array",
                        "items": {"type": "number"},
                        "minItems": 4,
                        "maxItems": 4,
                        "description": (
                            "The region [x1, y1, x2, y2] with x1 < x2 and y1 < y2, in relative coordinates from 0 "
                            "to 1000 across the image's width and height ((0, 0) is the top-left corner)."
                        ),
                    },
                    "label": {"type": "string", "description": "A short name for what is in the region."},
                    "img_idx": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "Index of the image to crop, counting every image of the dialogue from 0 "
                        "(0 is the original image).",
                    },
                },
                "required": ["bbox_2d", "label", "img_idx"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": IMAGE_SEARCH,
            "description": (
                "Reverse image search: finds gallery images similar to image img_idx and returns their titles and "
                "thumbnails. Works best on a tight crop around one object (zoom in first)."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "img_idx": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "Index of the image to search with, counting every image of the dialogue "
                        "from 0.",
                    },
                },
                "required": ["img_idx"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": TEXT_SEARCH,
            "description": "Keyword search over encyclopedic text documents; returns numbered snippets with titles.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "A few keywords, e.g. an entity name and a fact."},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]

TOOL_NAMES: tuple[str, ...] = tuple(s["function"]["name"] for s in TOOL_SCHEMAS)

# name -> accepted argument names, in schema order (all are required)
TOOL_ARGS: dict[str, tuple[str, ...]] = {
    s["function"]["name"]: tuple(s["function"]["parameters"]["properties"]) for s in TOOL_SCHEMAS
}
