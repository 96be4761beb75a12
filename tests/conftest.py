"""Shared fixtures: a git+DVC toy project built in tmp_path, and environment for subprocesses."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

GIT_ENV = {
    "GIT_AUTHOR_NAME": "mars-test",
    "GIT_AUTHOR_EMAIL": "test@mars.local",
    "GIT_COMMITTER_NAME": "mars-test",
    "GIT_COMMITTER_EMAIL": "test@mars.local",
    "DVC_NO_ANALYTICS": "1",
}


def sub_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GIT_ENV)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def sh(args: list[str], cwd: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=sub_env(**env), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def dvc(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "dvc", *args], cwd, check)


# A toy stage that uses the real params loader and writers: it reads its section, writes
# a text output derived from its input (if any) and a metrics file.
TOY_STAGE = textwrap.dedent(
    '''
    import argparse, json
    from dataclasses import dataclass
    from pathlib import Path
    from mars.stage import stage_args, write_metrics

    @dataclass(frozen=True)
    class Params:
        n: int = 1
        word: str = "x"
        seed: int = 0

    def main(section):
        import sys
        argv = sys.argv[2:]
        params, ins, outs = stage_args(section, Params, argv, inputs=(("src",) if "--src" in argv else ()), outputs=("out", "metrics"))
        text = ins["src"].read_text() if ins else ""
        outs["out"].parent.mkdir(parents=True, exist_ok=True)
        outs["out"].write_text(text + (params.word * params.n) + f"|{params.seed}\\n")
        if section == "c":  # c also writes a report directory, like the evaluate stage
            (outs["out"].parent / "c_report").mkdir(exist_ok=True)
            (outs["out"].parent / "c_report" / "report.html").write_text("<html>report</html>")
        write_metrics(outs["metrics"], {"n": params.n, "chars": len(text) + params.n})

    if __name__ == "__main__":
        import sys
        main(sys.argv[1])
    '''
)

TOY_PARAMS = textwrap.dedent(
    """
    base:
      seed: 3
      profile: default
    profiles:
      default: {a: {}, b: {}, c: {}}
      smoke: {a: {n: 1}, b: {}, c: {}}
    pipeline:
      retries: 0
    a:
      n: 2
      word: alpha
    b:
      n: 3
      word: beta
    c:
      n: 1
      word: gamma
    """
)


def _stage(name: str, src: str | None) -> str:
    dep_src = f"      - {src}\n" if src else ""
    arg_src = f" --src {src}" if src else ""
    return (
        f"  {name}:\n"
        f"    cmd: python toy.py {name} --out out/{name}.txt --metrics out/{name}.json{arg_src}\n"
        f"    deps:\n      - toy.py\n{dep_src}"
        f"    params:\n      - base\n      - {name}\n      - profiles.${{base.profile}}.{name}\n"
        f"    outs:\n      - out/{name}.txt\n"
        + ("      - out/c_report\n" if name == "c" else "")
        + f"    metrics:\n      - out/{name}.json:\n          cache: false\n"
    )


@pytest.fixture
def toy_repo(tmp_path: Path) -> Path:
    """A git + DVC project with stages a -> b and an independent c, committed."""
    root = tmp_path / "toy"
    root.mkdir()
    (root / "toy.py").write_text(TOY_STAGE)
    (root / "params.yaml").write_text(TOY_PARAMS)
    (root / "dvc.yaml").write_text("stages:\n" + _stage("a", None) + _stage("b", "out/a.txt") + _stage("c", None))
    (root / ".gitignore").write_text("/out/*.txt\n/out/c_report\n")
    sh(["git", "init", "-q", "-b", "main"], root)
    dvc(["init", "-q"], root)
    dvc(["config", "core.analytics", "false"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-q", "-m", "toy"], root)
    return root


@pytest.fixture
def clean_copy(tmp_path: Path) -> Path:
    """A copy of this repository's tracked files (no data, no venv), as a fresh git repo."""
    dst = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    sh(["git", "init", "-q", "-b", "main"], dst)
    sh(["git", "add", "-A"], dst)
    sh(["git", "commit", "-q", "-m", "copy"], dst)
    return dst


@contextlib.contextmanager
def serve_app(app, path: str = "/v1"):
    """Run an ASGI ``app`` with uvicorn in a thread on a free 127.0.0.1 port; yields its base URL + ``path``."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started, "the test server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}{path}"
    finally:
        srv.should_exit = True
        thread.join(5)
        sock.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A Prefect server on 127.0.0.1 in a temporary PREFECT_HOME: (home, API URL)."""
    from mars.cli import start_prefect_server, stop_process

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    proc = start_prefect_server(home, port, home / "server.log")
    try:
        yield home, f"http://127.0.0.1:{port}/api"
    finally:
        stop_process(proc)


@contextlib.contextmanager
def umask(value: int):
    """The process's umask set to ``value`` inside the block."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)
