"""`adaptive-spec serve`'s supervision of the server process, with a stand-in server (no vLLM needed):
the ready line, SIGTERM forwarded, a process left in the server's group killed, a server that dies
or never answers. tests/vllm/test_vllm_serve.py runs the real server end to end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from adaptive_spec.integrations.vllm.serve import _base_url, _supervise

# A stand-in for vLLM's API server: answers /health, starts a helper that ignores SIGTERM (as a stuck
# engine core would) and writes its pid to a file, and exits 0 on SIGTERM.
FAKE_SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys, threading
    port, pid_file = int(sys.argv[1]), sys.argv[2]
    helper = subprocess.Popen([sys.executable, "-c",
                               "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(pid_file, "w").write(str(helper.pid))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
""")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie has exited
        return handle.read().split()[2] != "Z"


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)


def test_ready_line_then_sigterm_is_forwarded_and_the_group_is_cleaned_up(tmp_path, capsys):
    port, pid_file = _free_port(), tmp_path / "helper.pid"
    base_url = _base_url("127.0.0.1", port)
    server = _start(FAKE_SERVER, str(port), str(pid_file))

    def stop_once_ready() -> None:  # what a user's Ctrl-C or a service manager's stop does
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{base_url}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_ready, daemon=True).start()
    assert _supervise(server, base_url, "m", ready_timeout=30) == 0
    assert f"ready at {base_url}/v1 (model 'm')" in capsys.readouterr().out
    helper = int(pid_file.read_text())
    assert server.returncode == 0  # it stopped on the forwarded SIGTERM, not on a kill
    time.sleep(0.2)
    assert not _alive(helper)  # it ignored SIGTERM: only the group kill ended it


def test_a_server_that_dies_before_ready_returns_its_exit_status(capsys):
    server = _start("import sys; sys.exit(3)")
    assert _supervise(server, _base_url("127.0.0.1", _free_port()), "m", ready_timeout=30) == 3
    assert "ready at" not in capsys.readouterr().out


def test_a_server_that_never_answers_is_stopped_after_the_ready_timeout(capsys):
    server = _start("import time; time.sleep(600)")
    started = time.monotonic()
    code = _supervise(server, _base_url("127.0.0.1", _free_port()), "m", ready_timeout=1.5)
    assert time.monotonic() - started < 20 and server.returncode is not None
    assert code != 0 and "no answer from" in capsys.readouterr().err


@pytest.mark.parametrize("host, shown", [("127.0.0.1", "http://127.0.0.1:80"), ("0.0.0.0", "http://127.0.0.1:80"),
                                         ("::1", "http://[::1]:80"), ("example.internal", "http://example.internal:80")])
def test_the_announced_url_is_one_a_local_client_can_open(host, shown):
    assert _base_url(host, 80) == shown
