"""Latency of the agent's tools through :class:`~mars.tools.toolbox.ToolBox`: in-process vs over HTTP.

What it does
    Measures p50/p99 wall-clock latency of ``image_zoom_in``, ``image_search`` and ``text_search`` called
    through ``ToolBox.call`` (validation included, no ToolCache) on the default world if
    ``--world-dir`` (``data/world``: the world stage's parquet tables, ``raw/``, ``gallery/``) and
    ``--index-dir`` (``data/index``, with ``manifest.json``) exist; otherwise it generates a mid-size world
    into a temporary directory with :func:`mars.world.generate.generate_world` and builds the
    :class:`~mars.tools.text_index.TextIndex` and :class:`~mars.tools.image_index.ImageIndex` there.

    Arguments are realistic: each scene of ``world_truth`` is shown as the policy sees it
    (:func:`mars.tools.imaging.policy_view`, ``max_pixels`` 224*224 and then a larger ``--large-pixels``);
    zoom boxes are the true emblem boxes (relative 0..1000 grid) with a random 10-40% margin;
    ``image_search`` runs on the dialogue ``[view, crop]`` with the crop of the target emblem (``img_idx=1``);
    ``text_search`` queries are entity names plus a fact word ("founded", "founder", "city", ...).

    Baseline, measured in the same run and interleaved call by call: the same calls through the HTTP tool
    service (:func:`mars.tools.service.create_app` served by uvicorn in a thread of this process, on
    127.0.0.1) with :class:`~mars.tools.service.RemoteToolBox` (images PNG-encoded both ways). The table
    gives in-process p50/p99, over-HTTP p50/p99 and their ratios (HTTP / in-process). Server and client
    share this process (and its GIL), so the HTTP numbers are an upper bound for a separate server on an
    idle machine.

Deviation from the paper
    The paper's tools call web APIs (seconds per call); ours search an offline world (docs/design.md, The
    embedded default world).

How to run
    python bench/bench_tools.py                  # 200 calls per tool and view size
    python bench/bench_tools.py --calls 50 --world-dir data/world --index-dir data/index
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.data import schemas  # noqa: E402
from mars.data.io import read_table  # noqa: E402
from mars.tools.imaging import policy_view  # noqa: E402
from mars.tools.service import RemoteToolBox, create_app  # noqa: E402
from mars.tools.toolbox import ToolBox, ToolConfig  # noqa: E402

FACT_WORDS = ("founded", "founder", "city", "founded year", "who founded", "located")


def mid_spec(seed: int):
    from mars.world.generate import WorldSpec

    return WorldSpec(seed=seed, n_entities=200, n_distractors=60, docs_per_entity=3, gallery_per_entity=5,
                     heldout_per_entity=1, gallery_size=128, n_scenes=30, scene_long_side_min=2048,
                     scene_long_side_max=3072, emblems_per_scene_min=3, emblems_per_scene_max=5, planted=False)


def load_world(ns: argparse.Namespace, tmp: Path):
    """(toolbox, world_truth, raw_images, entities, raw_dir, description)."""
    wd, idx = ns.world_dir, ns.index_dir
    names = ("entities", "raw_images", "world_truth")
    if all((wd / f"{n}.parquet").is_file() for n in names) and (idx / "manifest.json").is_file():
        tables = {n: read_table(wd / f"{n}.parquet", schemas.schema_for(n)) for n in names}
        box = ToolBox.from_dirs(idx, wd / "gallery", ToolConfig())
        return box, tables["world_truth"], tables["raw_images"], tables["entities"], wd / "raw", f"world {wd}"
    from mars.tools.embedders import load_embedder
    from mars.tools.image_index import ImageIndex
    from mars.tools.text_index import TextIndex
    from mars.world.generate import generate_world

    spec = mid_spec(ns.seed)
    t0 = time.perf_counter()
    w = generate_world(spec, tmp / "raw", tmp / "gallery", progress=False, workers=ns.workers)
    t1 = time.perf_counter()
    TextIndex.build(w.corpus).save(tmp / "index/text")
    ImageIndex.build(w.gallery, tmp / "gallery", load_embedder("color_layout"), show_progress=False).save(
        tmp / "index/image")
    (tmp / "index/manifest.json").write_text(json.dumps({"embedder": "color_layout"}))
    t2 = time.perf_counter()
    box = ToolBox.from_dirs(tmp / "index", tmp / "gallery", ToolConfig())
    desc = (f"generated world ({spec.n_entities} entities, {w.corpus.num_rows} docs, {w.gallery.num_rows} gallery "
            f"images, {spec.n_scenes} scenes; generate {t1 - t0:.1f}s, index {t2 - t1:.1f}s)")
    return box, w.world_truth, w.raw_images, w.entities, tmp / "raw", desc


def rel_box(x0: float, y0: float, x1: float, y1: float, W: int, H: int, rng: random.Random) -> list[float]:
    """The emblem box with a random 10-40% margin, on the relative 0..1000 grid."""
    mx, my = (x1 - x0) * rng.uniform(0.1, 0.4), (y1 - y0) * rng.uniform(0.1, 0.4)
    b = [max(0.0, x0 - mx) / W, max(0.0, y0 - my) / H, min(W, x1 + mx) / W, min(H, y1 + my) / H]
    return [round(v * 1000, 1) for v in b]


def build_calls(box: ToolBox, truth, raw, entities, raw_dir: Path, view_pixels: list[tuple[str, int]], seed: int):
    """{tool label: [(name, arguments, images), ...]}."""
    rng = random.Random(seed)
    path_of = {r["scene_id"]: r["path"] for r in raw.to_pylist() if r["scene_id"]}
    by_scene: dict[str, list[dict]] = {}
    for r in truth.to_pylist():
        if r["scene_id"] in path_of:
            by_scene.setdefault(r["scene_id"], []).append(r)
    calls: dict[str, list] = {}
    for label, max_px in view_pixels:
        zooms, searches = [], []
        for sid, rows in sorted(by_scene.items()):
            with Image.open(raw_dir / path_of[sid]) as im:
                view = policy_view(im, 56 * 56, max_px)
            W, H = rows[0]["scene_width"], rows[0]["scene_height"]
            for r in rows:
                args = {"bbox_2d": rel_box(r["x0"], r["y0"], r["x1"], r["y1"], W, H, rng),
                        "label": "emblem", "img_idx": 0}
                zooms.append(("image_zoom_in", args, [view]))
                if r["is_target"]:
                    obs = box.call("image_zoom_in", args, [view])
                    assert obs.ok, obs.text
                    searches.append(("image_search", {"img_idx": 1}, [view, obs.images[0]]))
        calls[f"image_zoom_in view<={label}"] = zooms
        calls[f"image_search view<={label}"] = searches
    names = [r["name"] for r in entities.to_pylist() if not r["is_distractor"]]
    calls["text_search"] = [("text_search", {"query": f"{n} {rng.choice(FACT_WORDS)}"}, []) for n in names]
    return calls


def serve(box: ToolBox):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(box), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000.0, q))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per tool and view size")
    ap.add_argument("--world-dir", type=Path, default=Path("data/world"))
    ap.add_argument("--index-dir", type=Path, default=Path("data/index"))
    ap.add_argument("--large-pixels", type=int, default=1280 * 28 * 28, help="the larger policy view's max_pixels")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1, help="processes for world generation")
    ns = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="mars_bench_tools_") as td:
        box, truth, raw, entities, raw_dir, desc = load_world(ns, Path(td))
        print(f"# {desc}")
        large = "1280*28*28" if ns.large_pixels == 1280 * 28 * 28 else str(ns.large_pixels)
        views = [("224*224", 224 * 224), (large, ns.large_pixels)]
        calls = build_calls(box, truth, raw, entities, raw_dir, views, ns.seed)
        server, thread, url = serve(box)
        remote = RemoteToolBox(url, timeout_s=60.0, concurrency=1)
        rows = []
        try:
            for label, pool in calls.items():
                if not pool:
                    continue
                for name, args, imgs in pool[: ns.warmup]:
                    box.call(name, args, imgs)
                    remote.call(name, args, imgs)
                local_t, http_t, errors, mismatch = [], [], 0, 0
                for i in range(ns.calls):
                    name, args, imgs = pool[i % len(pool)]
                    t0 = time.perf_counter()
                    a = box.call(name, args, imgs)
                    t1 = time.perf_counter()
                    b = remote.call(name, args, imgs)
                    t2 = time.perf_counter()
                    local_t.append(t1 - t0)
                    http_t.append(t2 - t1)
                    errors += (not a.ok) + (not b.ok)
                    mismatch += a.text != b.text
                rows.append((label, len(pool), local_t, http_t, errors, mismatch))
        finally:
            remote.close()
            server.should_exit = True
            thread.join(timeout=10)

    print(f"# {ns.calls} calls per row, interleaved in-process / over HTTP (uvicorn thread + RemoteToolBox)")
    head = (f"{'tool':<32} {'args':>5} {'in-proc p50':>11} {'p99':>8} {'HTTP p50':>9} {'p99':>8} "
            f"{'ratio p50':>9} {'p99':>6} {'err':>4}")
    print(head)
    print("-" * len(head))
    for label, n, lt, ht, err, mis in rows:
        lp50, lp99, hp50, hp99 = pct(lt, 50), pct(lt, 99), pct(ht, 50), pct(ht, 99)
        print(f"{label:<32} {n:>5} {lp50:>11.2f} {lp99:>8.2f} {hp50:>9.2f} {hp99:>8.2f} "
              f"{hp50 / lp50:>8.1f}x {hp99 / lp99:>5.1f}x {err + mis:>4}")
    print("(ms; ratio = over HTTP / in-process; err counts error observations and in-process/HTTP text mismatches)")
    return 1 if any(r[4] or r[5] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
