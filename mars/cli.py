"""The ``mars`` command line.

- ``mars params check``: validate params.yaml (base, the active profile, every stage in
  dvc.yaml against its ``Params`` dataclass, the pipeline section) before any work.
- ``mars stage NAME [args]``: run one stage's ``main`` (what dvc.yaml calls).
- ``mars pipeline [--stages ...] [--set key=value ... [--name NAME]]``: run the Prefect flow (with ``--set``: as one
  DVC experiment).
- ``mars serve --checkpoint DIR``: an OpenAI-compatible chat-completions server for a local
  checkpoint (:mod:`mars.serve.openai_server`) on 127.0.0.1.
- ``mars serve-tools --index-dir data/index --gallery-dir data/world/gallery``: the tool
  service (:mod:`mars.tools.service`) on 127.0.0.1.
- ``mars ui [--port 4200]``: start a local Prefect server on 127.0.0.1 (analytics off,
  PREFECT_HOME in ./.prefect) and serve the pipeline deployment.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mars.params import ParamsError, load_params, read_params_file


def prefect_env(home: str | Path, api_url: str | None = None) -> dict[str, str]:
    """Environment for a project-local Prefect: analytics off, PREFECT_HOME under the project."""
    env = dict(os.environ)
    env["PREFECT_HOME"] = str(Path(home).resolve())
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["DO_NOT_TRACK"] = "1"
    env.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def start_prefect_server(home: str | Path, port: int, log_path: str | Path | None = None) -> subprocess.Popen:
    """Start ``prefect server start`` on 127.0.0.1:port and wait until its API answers."""
    import httpx

    env = prefect_env(home)
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    url = f"http://127.0.0.1:{port}/api/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {proc.returncode}; see {log_path or 'its output'}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_process(proc)
    raise RuntimeError(f"prefect server did not answer on {url} within 120 s")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def params_check(params_path: str, repo: str) -> int:
    from pipelines.dvc import read_dag
    from pipelines.flow import load_pipeline_params

    doc = read_params_file(params_path)
    from mars.params import load_base

    base = load_base(doc, params_path)
    names = list(read_dag(repo))
    for name in names:
        module = importlib.import_module(f"stages.{name}")
        load_params(name, module.Params, params_path)
    from mars.agent.config import AgentParams

    load_params("agent", AgentParams, params_path)  # the section the episode-playing stages share
    load_pipeline_params(repo)
    print(f"{params_path}: ok (profile {base.profile}; stages {', '.join(names) or 'none'})")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def ui(port: int, repo: str) -> int:
    home = Path(repo).resolve() / ".prefect"
    home.mkdir(exist_ok=True)
    print(f"starting the Prefect server (PREFECT_HOME={home}) ...", flush=True)
    server = start_prefect_server(home, port, home / "server.log")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`/`timeout` stop the server too
    api = f"http://127.0.0.1:{port}/api"
    print(f"Prefect UI: http://127.0.0.1:{port}  (API {api}); Ctrl-C stops both", flush=True)
    try:
        return subprocess.call(
            [sys.executable, "-m", "pipelines.deploy", "--repo", repo], env=prefect_env(home, api)
        )
    except KeyboardInterrupt:
        return 0
    finally:
        stop_process(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mars", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("params", help="validate params.yaml")
    p.add_argument("action", choices=["check"])
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--repo", default=".")
    s = sub.add_parser("stage", help="run one stage (as dvc.yaml does)")
    s.add_argument("name")
    s.add_argument("args", nargs=argparse.REMAINDER)
    pl = sub.add_parser("pipeline", help="run the Prefect pipeline flow", add_help=False)
    pl.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("serve", help="OpenAI-compatible server for a local checkpoint (see --help)", add_help=False)
    sub.add_parser("serve-tools", help="serve the agent's tools over HTTP (see --help)", add_help=False)
    u = sub.add_parser("ui", help="local Prefect server + the pipeline deployment")
    u.add_argument("--port", type=int, default=4200)
    u.add_argument("--repo", default=".")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # pass-through commands: their own parsers see every remaining argument
        if argv[:1] == ["pipeline"]:
            from pipelines.flow import main as flow_main

            return flow_main(argv[1:])
        if argv[:1] == ["serve"]:
            from mars.serve.openai_server import main as serve_main

            return serve_main(argv[1:])
        if argv[:1] == ["serve-tools"]:
            from mars.tools.service import main as serve_tools_main

            return serve_tools_main(argv[1:])
        if argv[:1] == ["stage"] and len(argv) > 1 and not argv[1].startswith("-"):
            return importlib.import_module(f"stages.{argv[1]}").main(argv[2:]) or 0
        ns = parser.parse_args(argv)
        if ns.cmd == "params":
            return params_check(ns.params, ns.repo)
        if ns.cmd == "ui":
            return ui(ns.port, ns.repo)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
