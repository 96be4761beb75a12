"""The tool service over real HTTP on 127.0.0.1: parity, bursts, disconnects, a dying server."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image

from mars.tools.embedders import load_embedder
from mars.tools.image_index import ImageIndex
from mars.tools.service import RemoteToolBox, ToolServiceDown, create_app
from mars.tools.text_index import TextIndex
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.world.generate import WorldSpec, generate_world
from tests.conftest import sub_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


def start_tool_server(root: Path) -> tuple[subprocess.Popen, str]:
    """`mars serve-tools` in its own process, so a test can kill it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mars.cli", "serve-tools", "--index-dir", str(root / "index"),
         "--gallery-dir", str(root / "gallery"), "--port", str(port)],
        env=sub_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("svc")
    tables = generate_world(WorldSpec.smoke(), root / "raw", root / "gallery", progress=False)
    TextIndex.build(tables.corpus).save(root / "index/text")
    ImageIndex.build(tables.gallery, root / "gallery", load_embedder("color_layout"), show_progress=False).save(
        root / "index/image"
    )
    (root / "index/manifest.json").write_text('{"embedder": "color_layout"}')
    return root, tables


@pytest.fixture(scope="module")
def served(world):
    import uvicorn

    root, _ = world
    toolbox = ToolBox.from_dirs(root / "index", root / "gallery", ToolConfig())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(toolbox), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_up(url)
    yield url, toolbox
    server.should_exit = True
    thread.join(timeout=10)


def scene() -> Image.Image:
    img = Image.new("RGB", (448, 336), (200, 200, 200))
    img.paste((255, 0, 0), (100, 100, 200, 180))
    return img


def test_remote_matches_in_process(served, world):
    url, toolbox = served
    _, tables = world
    name = tables.entities.column("name")[0].as_py()
    remote = RemoteToolBox(url)
    for tool, args in [("text_search", {"query": f"When was {name} founded?"}),
                       ("image_zoom_in", {"bbox_2d": [100, 100, 600, 700], "label": "box", "img_idx": 0}),
                       ("image_zoom_in", {"bbox_2d": [600, 100, 100, 700], "label": "bad", "img_idx": 0}),
                       ("image_zoom_in", {"bbox_2d": [0, 0, 500, 500], "label": "second", "img_idx": 1}),
                       ("image_search", {"img_idx": 1}),
                       ("image_search", {"img_idx": 2}),
                       ("image_search", '{"img_idx": 1}'),
                       ("no_such_tool", {})]:
        images = [scene(), scene().crop((50, 50, 250, 250))]
        local, far = toolbox.call(tool, args, images), remote.call(tool, args, images)
        assert far.text == local.text and far.error == local.error
        assert [im.size for im in far.images] == [im.size for im in local.images]
    assert remote.failures == 0 and remote.calls == 8


def test_burst_of_200_concurrent_calls(served, world):
    url, _ = served
    _, tables = world
    names = tables.entities.column("name").to_pylist()
    remote = RemoteToolBox(url, concurrency=32)
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: remote.call("text_search", {"query": names[i % len(names)]}, []), range(200)))
    assert len(results) == 200 and all(r.error is None for r in results)
    assert remote.calls == 200 and remote.failures == 0


def test_survives_a_client_that_disconnects_mid_request(served):
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/tools/text_search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{\"arguments\": {\"query\": \"half")
    obs = RemoteToolBox(url).call("text_search", {"query": "observatory"}, [])
    assert obs.error is None


def png_b64(img: Image.Image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"arguments": {"img_idx": 0}, "images": {"0": "@@"}, "n_images": 1}, "image 0 is not valid base64"),
        ({"arguments": {"img_idx": 0}, "images": {"0": png_b64(Image.new("RGB", (8, 8)))}, "n_images": 10**12},
         "at most 64 images"),
        ({"arguments": {"img_idx": 0}, "images": {"3": png_b64(Image.new("RGB", (8, 8)))}, "n_images": 2},
         "image index 3 is outside 0..1"),
        ({"arguments": {"img_idx": 1}, "images": {"0": png_b64(Image.new("RGB", (8, 8)))}, "n_images": 2},
         "image 1 was not sent"),
        ({"arguments": {"img_idx": 0}, "image": []}, "image: Extra inputs are not permitted"),
        ({"arguments": {"img_idx": 0}, "images": [1]}, "images"),
    ],
)
def test_malformed_requests_are_refused_with_400(served, body, needle):
    url, _ = served
    r = httpx.post(f"{url}/v1/tools/image_search", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and needle in r.json()["error"]["message"]


def test_a_decompression_bomb_is_refused_before_decoding(served):
    from tests.test_hostile_input import b64, png_bomb

    url, _ = served
    body = {"arguments": {"img_idx": 0}, "images": [b64(png_bomb(8000, 8000, rows=8000))]}  # 64 Mpx in 8 KB
    r = httpx.post(f"{url}/v1/tools/image_search", json=body, timeout=30)
    assert r.status_code == 400 and "declares 8000x8000 = 64000000 pixels" in r.json()["error"]["message"]


def test_bad_tool_calls_are_observations_not_http_errors(served):
    url, toolbox = served
    for name, args in [("no_such_tool", {}), ("text_search", {"query": 5}), ("image_search", {"img_idx": 7})]:
        r = httpx.post(f"{url}/v1/tools/{name}", json={"arguments": args, "images": {}, "n_images": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["error"] == toolbox.call(name, args, [scene()]).error


def test_server_killed_mid_run_counts_failures_then_stops_the_run(world, tmp_path):
    root, tables = world
    proc, url = start_tool_server(root)
    try:
        wait_up(url)
        tolerant = RemoteToolBox(url, retries=1, backoff_s=0.01, timeout_s=2, max_failure_rate=1.0)
        strict = RemoteToolBox(url, retries=0, timeout_s=2, max_failure_rate=0.2, min_calls=10)
        names = tables.entities.column("name").to_pylist()
        observations = []
        for i in range(30):
            if i == 10:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            observations.append(tolerant.call("text_search", {"query": names[i % len(names)]}, []))
        assert all(o.error is None for o in observations[:10])
        assert all(o.error == "service_unavailable" for o in observations[10:])
        assert tolerant.calls == 30 and tolerant.failures == 20  # the run finished, failures counted
        with pytest.raises(ToolServiceDown, match="failed 10 of 10 calls"):
            for i in range(11):
                strict.call("text_search", {"query": "x"}, [])
    finally:
        if proc.poll() is None:
            proc.kill()


def test_rollout_finishes_with_counted_tool_failures_when_the_server_dies(world):
    """The engine keeps going through a dead tool service; failures land in the trajectories."""
    from mars.agent.backends import ScriptedBackend
    from mars.agent.engine import EngineConfig, run_episodes
    from mars.agent.protocol import format_answer, format_tool_call

    root, tables = world
    proc, url = start_tool_server(root)
    names = tables.entities.column("name").to_pylist()
    try:
        wait_up(url)
        remote = RemoteToolBox(url, retries=0, timeout_s=2, max_failure_rate=1.0)

        def policy(dialogue: list[dict]) -> str:
            turns = sum(m["role"] == "assistant" for m in dialogue)
            if turns == 1 and proc.poll() is None:  # the second step of the run: kill the service
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            if turns < 2:
                return format_tool_call("text_search", {"query": names[turns]}, think="look it up")
            return format_answer("1900", think="done")

        questions = [{"question_id": f"q{i}", "question": "When was it founded?", "answer": "1900",
                      "image": scene()} for i in range(4)]
        trajs = run_episodes(questions, ScriptedBackend(policy), remote, EngineConfig(max_turns=4))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [t.finish_reason for t in trajs] == ["answer"] * 4
    assert all(t.n_tool_calls == 2 and t.n_tool_errors == 1 for t in trajs)  # first call served, second failed
    assert remote.failures == 4 and remote.calls == 8
