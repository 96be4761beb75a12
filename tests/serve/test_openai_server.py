"""`mars serve` over real HTTP: same text and log-probs as the in-process backend, images included."""

from __future__ import annotations

import base64
import io
import socket
import subprocess
import sys
import time

import httpx
import pytest

from mars.agent.hf_backend import HFBackend
from mars.model.build import save_checkpoint
from mars.serve.openai_server import to_internal
from tests.conftest import sub_env
from tests.model.test_hf_backend import tiny_stack
from tests.model.test_model import image


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok, proc, model = tiny_stack()
    ckpt = tmp_path_factory.mktemp("serve") / "ckpt"
    save_checkpoint(model, tok, proc, ckpt)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "mars.cli", "serve", "--checkpoint", str(ckpt), "--port", str(port),
                          "--model-name", "tiny"], env=sub_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if p.poll() is not None:
                raise AssertionError(p.stderr.read().decode())
            time.sleep(0.3)
    yield url, HFBackend(model, proc)
    p.terminate()
    p.wait(timeout=20)


def test_chat_completion_matches_backend_with_image_and_logprobs(server):
    url, backend = server
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image(10))}},
                                     {"type": "text", "text": "what year?"}]},
    ]
    body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0.0, "logprobs": True,
            "stop": []}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    direct = backend.generate([to_internal(messages)], max_new_tokens=10, temperature=0.0, stop=())[0]
    choice = out["choices"][0]
    assert choice["message"]["content"] == direct.text
    assert choice["finish_reason"] == direct.finish_reason
    lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert len(lps) == len(direct.token_ids) == out["usage"]["completion_tokens"]
    assert all(abs(a - b) < 1e-3 for a, b in zip(lps, direct.logprobs))
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([{"role": "wizard", "content": "hi"}], "role must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "data: URLs"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}],
         "not a base64-encoded image"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "must be text or image_url"),
    ],
)
def test_bad_requests_get_400_with_a_message(server, messages, needle):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
