"""Faults and bad input, one test (or a parametrised group) per row of the fault table; real servers on 127.0.0.1,
real subprocesses, real DVC and Prefect.

| fault | what the pipeline does | tests |
|---|---|---|
| LLM judge endpoint: 500s, timeouts, malformed JSON, a 50 MB body | each request gives up after ``retries`` + 1 attempts (500, timeout) or at once (not JSON, body over ``max_response_bytes``); the evaluation stops with ``JudgeUnavailable`` naming the fault (its budget: no unavailable verdict); the chunk being judged is not stored, finished chunks are kept and a rerun scores only the rest | ``test_judge_endpoint_fault_*`` |
| synthesis endpoint: the same faults | every failed request is an ``endpoint_error`` reject, counted; past ``max_failure_rate`` the run stops early with an error naming the endpoint and the count; nothing is returned to write | ``test_synthesis_endpoint_fault_*`` |
| rollout endpoint (``OpenAIBackend``): the same faults | every failed request ends its episode as ``backend_error``, counted in ``backend.errors`` and ``llm.failures``; bounded time. an evaluation stores no chunk with such an episode and stops, naming the endpoint (``EndpointDown``); the chunks before it are kept for the rerun | ``test_policy_endpoint_fault_*``, ``test_dead_policy_endpoint_stops_the_evaluation`` |
| an endpoint answering 50 MB, or a body that never ends | refused unread when declared over ``max_response_bytes`` (32 MiB), cut there when streamed; never retried; memory bounded by the cap | ``test_a_50mb_answer_is_refused_unread_and_an_endless_one_cut_at_the_cap`` |
| a full disk (``RLIMIT_FSIZE``) during an artifact write | ``OSError`` EFBIG; the previous artifact (file or stage directory) stays intact and readable, no temp file or staging directory is left; the error names the file | ``test_full_disk_*`` |
| two ``dvc repro`` at once | the second fails at once with DVC's lock message naming the first's PID; the first finishes; nothing half-written | ``test_two_dvc_repro_at_once_the_second_is_refused_and_says_why`` |
| a Prefect flow run while ``dvc repro`` holds the repository | the flow fails with "locked by another run: PID n (dvc repro)" (``pipelines.dvc.DvcLocked``) | ``test_flow_run_while_dvc_repro_holds_the_repository_fails_saying_so`` |
| the tool service killed and restarted during a rollout | calls retry through the outage and every episode finishes, each call counted once; a service that stays down stops the run on its failure budget (``ToolServiceDown``) | ``test_tool_service_*`` |

Time bounds are derived from the clients' settings: attempts x ``timeout_s`` plus the backoff waits, times the
rounds a pool needs, plus ``SLACK_S`` for a loaded machine; the servers' slow answers take far longer than that.
Run: ``.venv/bin/python -m pytest tests/test_faults.py -q``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image

from mars.agent.backends import OpenAIBackend, ScriptedBackend
from mars.agent.engine import EngineConfig, run_episodes
from mars.agent.protocol import format_answer, format_tool_call
from mars.eval.run import ResultStore, evaluate_model
from mars.llm_client import ChatClient, LLMError
from mars.rl.judge import JudgeUnavailable, LLMJudge
from mars.synth.llm import LLMSynthesizer
from tests.conftest import REPO, dvc, sh, sub_env
from tests.test_prefect_flow import last_flow_run
from tests.tools.test_service import free_port, wait_up, world  # noqa: F401  (world: a fixture)
from tests.tools.test_web import FakeAPI, chat_answer

PATH = "/v1/chat/completions"
TIMEOUT_S = 0.3  # each attempt's timeout in these tests
BACKOFF_S = 0.01
SLOW_S = 20.0  # how long a "timeout" server takes to answer: a client that waited would blow every bound below
SLACK_S = 10.0  # start-up, scheduling and a loaded machine
BODY_50MB = 50 * 2**20


def bound_s(attempts: int, *, rounds: int = 1, timeout_s: float = TIMEOUT_S, backoff_s: float = BACKOFF_S) -> float:
    """The longest a caller may take: ``rounds`` of requests that each make ``attempts`` attempts timing out, with
    the backoff waits between them (``backoff_s * 2**k``), plus ``SLACK_S``."""
    per_request = attempts * timeout_s + sum(backoff_s * 2**k for k in range(attempts - 1))
    return rounds * per_request + SLACK_S


@cache
def body_50mb() -> bytes:
    """A valid chat completion of 50 MB."""
    return json.dumps(chat_answer("x" * BODY_50MB)).encode()


# fault -> (the server's answer, retried by the client?, what the error says)
FAULTS = {
    "http_500": ((500, {"error": {"message": "internal error"}}), True, "HTTP 500"),
    "timeout": ((200, chat_answer("<judge>Yes</judge>"), SLOW_S, {}), True, "Timeout"),
    "malformed_json": ((200, b'{"id": "c1", "choices": [{"message": {"content": "<judge>Ye'), False, "not JSON"),
    "body_50mb": (None, False, "max_response_bytes"),
}


def fault_step(fault: str) -> tuple:
    step, _, _ = FAULTS[fault]
    return (200, body_50mb()) if step is None else step


def attempts_of(fault: str, retries: int) -> int:
    return retries + 1 if FAULTS[fault][1] else 1


@pytest.fixture()
def api():
    srv = FakeAPI()
    yield srv
    srv.close()


def png(colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buf, format="PNG")
    return buf.getvalue()


def bench_rows(n: int) -> list[dict]:
    """BENCH_QUESTIONS-shaped rows: one image, gold "Paris"."""
    return [{"benchmark": "faults", "id": f"q{i}", "question": "Which city is this?", "answers": ["Paris"],
             "images": [png()], "choices": None, "category": None, "difficulty": None, "type": "search"}
            for i in range(n)]


def guessing_policy() -> ScriptedBackend:
    return ScriptedBackend(lambda dialogue: format_answer("London", "A guess."))


# --- row: the LLM judge ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", list(FAULTS))
def test_judge_endpoint_fault_stops_the_evaluation_keeping_whole_chunks(api, tmp_path, fault):
    verdict = (200, chat_answer("<judge>No</judge>"))
    api.on(PATH, verdict, verdict, fault_step(fault))  # the first chunk's two verdicts, then the fault for good
    attempts = attempts_of(fault, retries=2)
    store = ResultStore(tmp_path / "progress", "judge-faults")
    policy = guessing_policy()
    with LLMJudge(f"{api.url}/v1", "j", retries=2, timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S) as judge:
        asked = []  # when each verdict was asked

        def timed(*args):
            asked.append(time.perf_counter())
            return judge.judge(*args)

        with pytest.raises(JudgeUnavailable, match=FAULTS[fault][2]) as ei:
            evaluate_model(bench_rows(4), lambda: policy, None, EngineConfig(), store, model="m", workflow="direct",
                           chunk_size=2, judge=timed)
        elapsed = time.perf_counter() - asked[-1]  # from the failing verdict's request to the stop
        assert (judge.llm.calls, judge.llm.failures) == (3, 1)  # the third verdict failed; nothing after it was asked
    assert "\n" not in str(ei.value) and f"judge at {api.url}{PATH}" in str(ei.value)
    assert len(api.paths(PATH)) == 2 + attempts
    assert elapsed < bound_s(attempts), elapsed
    # the judged chunk was stored whole, the failed one not at all
    assert len(store.chunks()) == 1
    table = store.table()
    assert sorted(table.column("question_id").to_pylist()) == ["q0", "q1"]
    assert set(table.column("judge").to_pylist()) == {"llm:j:llm"}
    # the endpoint back: a rerun scores only the two missing samples, each sample once in all
    api.on(PATH, verdict)
    with LLMJudge(f"{api.url}/v1", "j", retries=2, timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S) as judge:
        assert evaluate_model(bench_rows(4), lambda: policy, None, EngineConfig(), store, model="m",
                              workflow="direct", chunk_size=2, judge=judge.judge) == 2
    ids = store.table().column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == 4


# --- row: LLM question synthesis --------------------------------------------------------------------------------


def synth_items(root: Path, n: int) -> list[dict]:
    for i in range(n):
        Image.new("RGB", (96, 64), (20 * i % 256, 90, 160)).save(root / f"img{i}.png")
    return [{"id": f"i{i}", "image_path": f"img{i}.png", "caption": "a coloured card"} for i in range(n)]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_synthesis_endpoint_fault_stops_early_past_the_failure_budget(api, tmp_path, fault):
    api.on(PATH, fault_step(fault))
    n, concurrency = 12, 2
    attempts = attempts_of(fault, retries=1)
    with LLMSynthesizer(f"{api.url}/v1", "m", max_retries=1, timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S,
                        concurrency=concurrency, max_failure_rate=0.5, progress=False) as synth:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError) as ei:
            synth.synthesize(synth_items(tmp_path, n), tmp_path)
        elapsed = time.perf_counter() - t0
        calls, failures = synth.llm.calls, synth.llm.failures
    msg = str(ei.value)
    found = re.search(rf"synthesis endpoint {re.escape(api.url + PATH)} \(model m\) failed (\d+) of {n} requests, "
                      r"more than the allowed 50% \(stopped early\)", msg)
    assert found, msg
    assert FAULTS[fault][2] in msg  # an example of the failure
    counted = int(found.group(1))
    # it stopped once more than half had failed: every request made failed, and at most the pool's in-flight ones
    # were made after the count
    assert n * 0.5 < counted <= failures == calls <= counted + concurrency < n
    assert len(api.paths(PATH)) == calls * attempts
    assert elapsed < bound_s(attempts, rounds=-(-calls // concurrency)), elapsed


# --- row: the rollout backend ----------------------------------------------------------------------------------


def scene_questions(n: int) -> list[dict]:
    return [{"question_id": f"q{i}", "question": "Which city is this?", "answer": "Paris",
             "image": Image.new("RGB", (64, 48), (200, 30, 30))} for i in range(n)]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_policy_endpoint_fault_ends_every_episode_as_a_counted_backend_error(api, fault):
    api.on(PATH, fault_step(fault))
    attempts = attempts_of(fault, retries=2)
    run_episodes(scene_questions(1), guessing_policy(), None, EngineConfig())  # imports and caches, untimed
    with OpenAIBackend(f"{api.url}/v1", "m", retries=2, timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S,
                       concurrency=4) as backend:
        t0 = time.perf_counter()
        trajs = run_episodes(scene_questions(4), backend, None, EngineConfig())
        elapsed = time.perf_counter() - t0
        assert (backend.llm.calls, backend.llm.failures) == (4, 4) and backend.requests == 4 * attempts
        assert len(backend.errors) == 4 and all(FAULTS[fault][2] in e and "\n" not in e for e in backend.errors)
    assert [t.finish_reason for t in trajs] == ["backend_error"] * 4
    assert all(t.answer is None and not t.correct and t.n_tool_calls == 0 for t in trajs)
    assert len(api.paths(PATH)) == 4 * attempts
    assert elapsed < bound_s(attempts), elapsed  # the four requests run at once


def test_dead_policy_endpoint_stops_the_evaluation_and_stores_nothing(api, tmp_path):
    api.on(PATH, (500, {"error": {"message": "internal error"}}))
    store = ResultStore(tmp_path / "progress", "dead-policy")
    with pytest.raises(RuntimeError, match="policy endpoint"):
        evaluate_model(bench_rows(4), lambda: OpenAIBackend(f"{api.url}/v1", "m", retries=1, backoff_s=BACKOFF_S),
                       None, EngineConfig(), store, model="m", workflow="direct", chunk_size=2)
    assert store.chunks() == []


# --- row: a 50 MB or endless answer ------------------------------------------------------------------------------


@contextlib.contextmanager
def endless_server(limit_bytes: int = 256 * 2**20):
    """An endpoint that answers 200 with a chunked body that goes on (up to ``limit_bytes``, so a client without a
    cap fails its test instead of hanging it)."""
    chunk = b"x" * 2**16

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                self.wfile.write(b'7\r\n{"a": "\r\n')
                for _ in range(limit_bytes // len(chunk)):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client hung up: what a cap does
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def traced_call(llm: ChatClient, body: dict) -> tuple[LLMError, float, int]:
    """(the error, seconds, peak bytes allocated by Python meanwhile) of one request that must fail."""
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(LLMError) as ei:
            llm.text(body)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return ei.value, elapsed, peak


def test_a_50mb_answer_is_refused_unread_and_an_endless_one_cut_at_the_cap(api):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cap = 32 * 2**20
    api.on(PATH, (200, body_50mb()))
    llm = ChatClient(f"{api.url}/v1", retries=2, timeout_s=5, backoff_s=BACKOFF_S)
    assert llm.max_response_bytes == cap  # the default
    err, elapsed, peak = traced_call(llm, body)
    assert re.fullmatch(rf"LLM endpoint at {re.escape(api.url + PATH)} answered HTTP 200 with a body over "
                        r"max_response_bytes \(33,554,432 bytes; Content-Length 52,\d{3},\d{3}\); not retried",
                        str(err)), str(err)
    assert err.status == 200 and not err.refused
    assert (llm.calls, llm.failures, llm.retries_done) == (1, 1, 0) and len(api.paths(PATH)) == 1
    assert peak < 8 * 2**20, peak  # the 50 MB were never read
    assert elapsed < bound_s(1, timeout_s=5), elapsed
    # a body with no length that goes on: cut at the cap (a read timeout never fires while bytes keep coming)
    with endless_server() as url:
        llm = ChatClient(url, retries=2, timeout_s=5, backoff_s=BACKOFF_S)
        err, elapsed, peak = traced_call(llm, body)
    assert re.search(r"answered HTTP 200 with a body over max_response_bytes \(33,554,432 bytes; cut at "
                     r"33,\d{3},\d{3}\); not retried$", str(err)), str(err)
    assert (llm.calls, llm.failures, llm.retries_done) == (1, 1, 0)
    assert cap < peak < cap + 16 * 2**20, peak  # what was read up to the cap, no more
    assert elapsed < bound_s(1, timeout_s=5), elapsed
    # no cap: the caller's choice (the 50 MB answer is read whole)
    api.on(PATH, (200, body_50mb()))
    assert len(ChatClient(f"{api.url}/v1", max_response_bytes=None).text(body)) == BODY_50MB
    with pytest.raises(ValueError, match="max_response_bytes"):
        ChatClient(f"{api.url}/v1", max_response_bytes=0)


# --- row: a full disk during an artifact write ----------------------------------------------------------------

FULL_DISK_CHILD = textwrap.dedent(
    """
    import json, random, resource, signal, string, sys
    from pathlib import Path
    import pyarrow as pa
    from mars.data.io import atomic_dir
    from mars.data.quality import write_artifacts
    from mars.data.suites import REJECT_REASONS

    mode, target, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(0)
    rows = [{"image_id": f"img-{i:06d}", "path": f"raw/{i}.jpg", "reason": REJECT_REASONS[i % len(REJECT_REASONS)],
             "detail": "".join(rng.choices(string.ascii_letters, k=40))} for i in range(20000)]
    big = pa.Table.from_pylist(rows)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        if mode == "file":
            write_artifacts({target: (big, "rejects")})
        else:
            with atomic_dir(target) as out:
                write_artifacts({out / "rejects.parquet": (big, "rejects")})
    except OSError as exc:
        print(json.dumps({"errno": exc.errno, "message": str(exc)}))
        raise SystemExit(3)
    print(json.dumps({"errno": None}))
    """
)
DISK_LIMIT = 64 * 1024  # bytes a file may have: the quality report fits, the new parquet does not


def good_rejects() -> pa.Table:
    from mars.data.suites import REJECT_REASONS

    return pa.Table.from_pylist([{"image_id": f"old-{i}", "path": f"raw/old-{i}.jpg", "reason": REJECT_REASONS[0],
                                  "detail": "kept"} for i in range(3)])


def run_full_disk(mode: str, target: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, mode, str(target), str(DISK_LIMIT)], cwd=REPO,
                          env=sub_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def full_disk_file(tmp_path_factory):
    """A good rejects.parquet (and its report), then a failed write of a bigger one under a file-size limit."""
    from mars.data.quality import write_artifacts

    root = tmp_path_factory.mktemp("full-disk-file")
    target = root / "rejects.parquet"
    write_artifacts({target: (good_rejects(), "rejects")})
    before = target.read_bytes()
    return root, target, before, run_full_disk("file", target)


def test_full_disk_during_an_artifact_write_keeps_the_previous_artifact(full_disk_file):
    from mars.data.io import read_table
    from mars.data.schemas import REJECTS

    root, target, before, result = full_disk_file
    assert result["errno"] == errno.EFBIG
    assert target.read_bytes() == before  # byte for byte
    assert read_table(target, REJECTS).column("image_id").to_pylist() == ["old-0", "old-1", "old-2"]
    assert sorted(p.name for p in root.iterdir()) == ["rejects.parquet", "rejects.parquet.quality.json"]  # no temp


def test_full_disk_error_names_the_file(full_disk_file):
    _, target, _, result = full_disk_file
    assert str(target) in result["message"], result["message"]


def test_full_disk_during_a_stage_write_keeps_the_previous_output_directory(tmp_path):
    from mars.data.io import read_table
    from mars.data.quality import write_artifacts
    from mars.data.schemas import REJECTS

    out = tmp_path / "curate"
    out.mkdir()
    write_artifacts({out / "rejects.parquet": (good_rejects(), "rejects")})
    (out / "notes.txt").write_text("previous run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_full_disk("dir", out)
    assert result["errno"] == errno.EFBIG
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the whole directory as it was
    assert read_table(out / "rejects.parquet", REJECTS).num_rows == 3
    assert [p.name for p in tmp_path.iterdir()] == ["curate"]  # no staging directory or backup left beside it


# --- row: two DVC runs at once --------------------------------------------------------------------------------

HOLD_STAGE = textwrap.dedent(
    """
    import pathlib, time
    pathlib.Path("started").write_text("1")
    deadline = time.time() + 120  # the test releases it much sooner
    while not pathlib.Path("release").exists() and time.time() < deadline:
        time.sleep(0.05)
    pathlib.Path("out.txt").write_text("held\\n")
    """
)


@pytest.fixture()
def hold_repo(tmp_path: Path) -> Path:
    """A git + DVC project whose one stage, ``hold``, runs until the file ``release`` appears."""
    root = tmp_path / "hold"
    root.mkdir()
    (root / "hold.py").write_text(HOLD_STAGE)
    (root / "dvc.yaml").write_text("stages:\n  hold:\n    cmd: python hold.py\n    deps: [hold.py]\n"
                                   "    outs: [out.txt]\n")
    (root / "params.yaml").write_text("pipeline:\n  retries: 0\n")
    (root / ".gitignore").write_text("/out.txt\n/started\n/release\n")
    sh(["git", "init", "-q", "-b", "main"], root)
    dvc(["init", "-q"], root)
    dvc(["config", "core.analytics", "false"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-q", "-m", "hold"], root)
    return root


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def holding(repo: Path):
    """A ``dvc repro`` in ``repo`` held inside its stage; yields the process, then releases it and waits."""
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=sub_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (repo / "started").exists() or proc.poll() is not None, "the held stage to start")
        assert proc.poll() is None, proc.communicate()[0]
        yield proc
    finally:
        (repo / "release").touch()
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_two_dvc_repro_at_once_the_second_is_refused_and_says_why(hold_repo):
    from pipelines.dvc import DvcLocked, stage_is_current

    with holding(hold_repo) as first:
        second = dvc(["repro"], hold_repo, check=False)
        out = second.stdout + second.stderr
        assert second.returncode != 0
        assert re.search(rf"'{re.escape(str(hold_repo / 'out.txt'))}' is busy, it is being blocked by:\s*"
                         rf"\(PID {first.pid}\): \S*dvc\S* repro", out), out
        assert "Running stage" not in out
        # what the flow asks first, refused the same way, in words
        with pytest.raises(DvcLocked) as ei:
            stage_is_current("hold", hold_repo)
        assert str(ei.value).startswith(f"dvc status hold: the DVC repository {hold_repo} is locked by another "
                                        f"run: PID {first.pid} (dvc repro) is running a stage that uses ")
        assert not (hold_repo / "out.txt").exists()
    assert first.returncode == 0
    assert (hold_repo / "out.txt").read_text() == "held\n"
    # the refused run left nothing behind: the first's result is recorded and up to date
    assert stage_is_current("hold", hold_repo)
    assert "Running stage" not in dvc(["repro"], hold_repo).stdout


def test_flow_run_while_dvc_repro_holds_the_repository_fails_saying_so(hold_repo, prefect_api):
    home, api_url = prefect_api
    with holding(hold_repo) as holder:
        flow = sh([sys.executable, "-m", "mars.cli", "pipeline", "--repo", str(hold_repo)], hold_repo, check=False,
                  PREFECT_HOME=str(home), PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    said = f"is locked by another run: PID {holder.pid} (dvc repro)"
    assert flow.returncode != 0
    assert said in flow.stdout + flow.stderr, (flow.stdout + flow.stderr)[-3000:]
    run = last_flow_run(api_url)
    assert run["state"]["type"] == "FAILED"
    assert "DvcLocked" in run["state"]["message"] and said in run["state"]["message"], run["state"]
    assert holder.returncode == 0 and (hold_repo / "out.txt").read_text() == "held\n"


# --- row: the tool service killed during a rollout ------------------------------------------------------------


def serve_tools(root: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mars.cli", "serve-tools", "--index-dir", str(root / "index"),
                             "--gallery-dir", str(root / "gallery"), "--port", str(port)],
                            env=sub_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def search_policy(names: list[str], at_step_1, searches: int = 2) -> ScriptedBackend:
    """``searches`` text searches (names[i], names[i + 1], ...), then an answer; ``at_step_1()`` runs once,
    before the second searches."""
    done = threading.Event()

    def policy(dialogue: list[dict]) -> str:
        turns = sum(m["role"] == "assistant" for m in dialogue)
        if turns == 1 and not done.is_set():
            done.set()
            at_step_1()
        if turns < searches:
            i = int(next(p["text"] for p in dialogue[1]["content"] if p["type"] == "text").split()[-1])
            return format_tool_call("text_search", {"query": names[i + turns]}, think="look it up")
        return format_answer("1900", think="done")

    return ScriptedBackend(policy)


def numbered_questions(n: int) -> list[dict]:
    return [{"question_id": f"q{i}", "question": f"When was organisation number {i}", "answer": "1900",
             "image": Image.new("RGB", (64, 48), (90, 90, 90))} for i in range(n)]


def test_tool_service_killed_and_restarted_mid_rollout_every_episode_finishes(world):
    from mars.tools.service import RemoteToolBox
    from mars.tools.toolbox import ToolBox, ToolConfig

    root, tables = world
    names = tables.entities.column("name").to_pylist()
    port = free_port()
    procs = [serve_tools(root, port)]
    url = f"http://127.0.0.1:{port}"
    outage_s = 1.0
    killed = threading.Event()

    def kill_and_restart() -> None:  # the step-1 calls are sent while the service is down, then find it back
        killed.set()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        threading.Timer(outage_s, lambda: procs.append(serve_tools(root, port))).start()

    try:
        wait_up(url)
        remote = RemoteToolBox(url, retries=8, backoff_s=0.25, timeout_s=10, max_failure_rate=0.2, min_calls=4)
        trajs = run_episodes(numbered_questions(6), search_policy(names, kill_and_restart), remote,
                             EngineConfig(max_turns=4))
    finally:
        if killed.is_set():
            wait_for(lambda: len(procs) == 2, "the restart", timeout=10)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == -signal.SIGKILL  # the first service was killed mid-rollout
    assert [t.finish_reason for t in trajs] == ["answer"] * 6
    assert all(t.n_tool_calls == 2 and t.n_tool_errors == 0 for t in trajs)
    assert (remote.calls, remote.failures) == (12, 0)  # each call counted once, none failed, none dropped
    local = ToolBox.from_dirs(root / "index", root / "gallery", ToolConfig())
    for i, t in enumerate(trajs):
        # each observation is the service's answer to that episode's own query, once
        responses = [m["content"][0]["text"] for m in [m for m in t.messages if m["role"] == "user"][1:]]
        expected = [local.call("text_search", {"query": names[i + k]}, []).text for k in (0, 1)]
        assert [all(line in r for line in e.splitlines()) for r, e in zip(responses, expected)] == [True, True]
        # the second call went through the outage: it could not be served before the service came back
        assert [c["turn"] for c in t.tool_calls] == [0, 1] and t.tool_calls[1]["latency_s"] >= outage_s


def test_tool_service_down_for_good_stops_the_rollout_on_its_failure_budget(world):
    from mars.tools.service import RemoteToolBox, ToolServiceDown

    root, tables = world
    names = tables.entities.column("name").to_pylist()
    port = free_port()
    proc = serve_tools(root, port)

    def kill() -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    try:
        wait_up(f"http://127.0.0.1:{port}")
        remote = RemoteToolBox(f"http://127.0.0.1:{port}", retries=0, timeout_s=2, max_failure_rate=0.2,
                               min_calls=4)
        with pytest.raises(ToolServiceDown, match=r"failed \d+ of \d+ calls"):
            run_episodes(numbered_questions(6), search_policy(names, kill, searches=3), remote,
                         EngineConfig(max_turns=6))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
