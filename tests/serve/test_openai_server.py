"""`mars serve` over real HTTP: same text and log-probs as the in-process backend, images included; the official
``openai`` client against it (usage counts, streaming, errors)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
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


def start_mars_serve(ckpt: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`mars serve` on a free 127.0.0.1 port in its own process (stderr to ``log``); its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "mars.cli", "serve", "--checkpoint", str(ckpt), "--port",
                              str(port), "--model-name", "tiny"], env=sub_env(), stdout=subprocess.DEVNULL, stderr=err)
    return p, f"http://127.0.0.1:{port}"


def wait_serving(p: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            if p.poll() is not None:
                raise AssertionError(f"mars serve exited with {p.returncode}:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.3)
    raise AssertionError(f"mars serve did not come up at {url}:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok, proc, model = tiny_stack()
    root = tmp_path_factory.mktemp("serve")
    save_checkpoint(model, tok, proc, root / "ckpt")
    p, url = start_mars_serve(root / "ckpt", root / "serve.log")
    try:
        wait_serving(p, url, root / "serve.log")
        yield url, HFBackend(model, proc)
    finally:
        p.terminate()
        p.wait(timeout=20)


def vqa_messages() -> list[dict]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image(10))}},
                                     {"type": "text", "text": "what year?"}]},
    ]


def prompt_tokens_by_processor(proc) -> int:
    """The prompt of :func:`vqa_messages`, as ChatML written out here, tokenised by the processor itself."""
    text = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            "what year?<|im_end|>\n<|im_start|>assistant\n")
    return int(proc(text=[text], images=[image(10)], return_tensors="pt")["input_ids"].shape[1])


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_completion_matches_backend_with_image_and_logprobs(server):
    url, backend = server
    messages = vqa_messages()
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


def test_the_matched_stop_string_is_named_in_stop_reason(server):
    """Like vLLM: the stop string that ended the generation is cut from the text and named in ``stop_reason`` (so
    a client restores what the model wrote, e.g. ``</answer>`` after an opened ``<tool_call>``); null without one."""
    url, backend = server
    direct = backend.generate([to_internal(vqa_messages())], max_new_tokens=10, temperature=0.0, stop=())[0]
    tok = backend.tokenizer
    stop = tok.decode(direct.token_ids[:1])  # the first generated token's text: the stop matches right after it
    assert stop.strip() and len(direct.token_ids) > 1
    body = {"model": "tiny", "messages": vqa_messages(), "max_tokens": 10, "temperature": 0.0, "logprobs": True,
            "stop": ["</never>", stop]}
    choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == "" and len(choice["logprobs"]["content"]) == 1
    plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "stop": []}, timeout=60).json()["choices"][0]
    assert plain["stop_reason"] is None and plain["message"]["content"] == direct.text


def test_openai_client_image_data_url_logprobs_and_usage(server):
    url, backend = server
    expected_prompt = prompt_tokens_by_processor(backend.processor)
    r = client(url).chat.completions.create(model="tiny", messages=vqa_messages(), max_tokens=8, temperature=0,
                                            logprobs=True, stop=[])
    direct = backend.generate([to_internal(vqa_messages())], max_new_tokens=8, temperature=0.0, stop=())[0]
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == direct.text
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(direct.logprobs, abs=1e-3)
    assert r.usage.prompt_tokens == expected_prompt > 40  # the image's tokens included
    assert r.usage.completion_tokens == len(direct.token_ids) == len(r.choices[0].logprobs.content) > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_openai_client_streams_the_same_completion(server):
    url, backend = server
    args = dict(model="tiny", messages=vqa_messages(), max_tokens=8, temperature=0, logprobs=True, stop=[])
    whole = client(url).chat.completions.create(**args)
    chunks = list(client(url).chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    with_choice = [c for c in chunks if c.choices]
    assert with_choice[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choice) == whole.choices[0].message.content
    streamed_lps = [t.logprob for c in with_choice if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed_lps == [t.logprob for t in whole.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in with_choice][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choice[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.prompt_tokens == prompt_tokens_by_processor(backend.processor)
    # on the wire: server-sent events ending with [DONE], no usage chunk unless asked
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      json={**args, "messages": vqa_messages(), "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(payloads) == 2 and all(p["choices"] for p in payloads)


def test_openai_client_gets_clear_errors(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 8192 tokens") as err:
        c.chat.completions.create(model="tiny", messages=vqa_messages(), max_tokens=100_000)
    assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="only data: URLs"):  # refused before any event is sent
        c.chat.completions.create(model="tiny", stream=True, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="tiny", messages=vqa_messages(), temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.chat.completions.create(model="tiny", messages=vqa_messages(), n=2)


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([{"role": "wizard", "content": "hi"}], "role must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "data: URLs"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}],
         "not valid base64"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "must be text or image_url"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 7}}]}], "image_url must be"),
        ([{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}], "text must be a string"),
        ([], "messages: List should have at least 1 item"),
    ],
)
def test_bad_requests_get_400_with_a_message(server, messages, needle):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_max_tokens_zero_is_refused_not_replaced(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": vqa_messages(), "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
