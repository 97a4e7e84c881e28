"""`adaptive-spec serve` end to end: the real command as a subprocess on a free loopback port, driven
with the `openai` client (vLLM depends on it) the way a user's application would.

Two servers in turn, the small model on one unbound thread: first with no speculation (the reference),
then with the n-gram drafter and the plug-in at static k = 3 (a policy that surely drafts, so that
the equality below is a test of speculation and not of a server that never drafted), with an API key.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from adaptive_spec.integrations.vllm.client_bench import parse_metrics
from vllm_cases import PROMPTS, SMALL_MODEL, require_vllm

require_vllm()
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.vllm, pytest.mark.real_models, pytest.mark.slow]

API_KEY = "test-key"
READY_SECONDS = 600  # generous: a cold start on a loaded 2-core machine takes about a minute
CHAT_PROMPTS = (PROMPTS["repeat"], PROMPTS["list"])
MAX_TOKENS = 32
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# the answer is in the prompt, so the n-gram drafter has runs of it to draft under the grammar
JSON_PROMPT = 'Ada is 36. Answer with JSON like {"name": "Bob", "age": 41}: {"name": "Ada", "age": 36}'
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A running `adaptive-spec serve`; its stdout is read line by line for the ready line."""

    def __init__(self, *options: str, log_path):
        command = [sys.executable, "-m", "adaptive_spec", "serve", "--target", SMALL_MODEL, "--threads", "1",
                   "--kv-cache-gib", "1", "--port", str(_free_port()), "--ready-timeout", str(READY_SECONDS),
                   *options]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        env={**os.environ, "NUMBA_NUM_THREADS": "1"})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.base_url = self._wait_ready()
        # The processes serving: the API server and its engine core (checked gone after stop()).
        self.descendants = psutil.Process(self.process.pid).children(recursive=True)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + READY_SECONDS + 30
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            found = re.search(r"ready at (http://\S+)/v1", line)
            if found:
                return found.group(1)
        self.process.kill()
        pytest.fail(f"serve never became ready (exit {self.process.poll()}):\n{self.log_tail()}")

    def log_tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as handle:
            return handle.read()[-4000:]

    def client(self, api_key: str = API_KEY):
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=300)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as response:
            return parse_metrics(response.read().decode())

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=120)
        self.log.close()
        return code

    def survivors(self) -> list:
        return [p for p in self.descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _chat(client, model: str, prompt: str, **options):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0.0, **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy chat completions from the same server command with speculation off (`--draft none`)."""
    server = Server("--draft", "none", log_path=tmp_path_factory.mktemp("serve") / "reference.log")
    try:
        client = server.client()
        texts = [_chat(client, SMALL_MODEL, prompt).choices[0].message.content for prompt in CHAT_PROMPTS]
        texts.append(_chat(client, SMALL_MODEL, JSON_PROMPT, response_format=RESPONSE_FORMAT).choices[0].message.content)
        assert server.metrics().get("vllm:spec_decode_num_drafts_total", 0.0) == 0.0  # really no drafter
    finally:
        code = server.stop()
    assert code == 0 and not server.survivors(), server.log_tail()
    return texts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server("--draft", "ngram", "--policy", "static:3", "--max-k", "3", "--api-key", API_KEY,
                     log_path=tmp_path_factory.mktemp("serve") / "speculative.log")
    yield running
    running.stop()


def test_greedy_chat_through_the_plugin_equals_vllm_without_speculation(server, reference):
    client = server.client()
    before = server.metrics()
    texts = [_chat(client, SMALL_MODEL, prompt).choices[0].message.content for prompt in CHAT_PROMPTS]
    after = server.metrics()
    assert texts == reference[:2]
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before.get("vllm:spec_decode_num_draft_tokens_total", 0)
    accepted = (after["vllm:spec_decode_num_accepted_tokens_total"]
                - before.get("vllm:spec_decode_num_accepted_tokens_total", 0))
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # speculation really ran on these requests


def test_json_schema_output_through_the_plugin_equals_vllm_without_speculation(server, reference):
    """vLLM's structured outputs beside our draft trimming: the grammar validates the drafts the
    plug-in kept, and the greedy output is the same JSON as without speculation."""
    before = server.metrics()
    text = _chat(server.client(), SMALL_MODEL, JSON_PROMPT, response_format=RESPONSE_FORMAT).choices[0].message.content
    after = server.metrics()
    assert text == reference[2]
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before.get("vllm:spec_decode_num_draft_tokens_total", 0)
    assert drafted > 0  # drafts really met the grammar


def test_a_streamed_chat_completion_equals_the_unstreamed_one(server, reference):
    stream = _chat(server.client(), SMALL_MODEL, CHAT_PROMPTS[0], stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 1 and "".join(pieces) == reference[0]


def test_concurrent_sampled_requests_all_complete(server):
    client, results = server.client(), {}

    def ask(index: int) -> None:
        response = client.completions.create(model=SMALL_MODEL, prompt=PROMPTS["code"], max_tokens=MAX_TOKENS,
                                             temperature=0.7, seed=index)
        results[index] = response

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r.usage.completion_tokens > 0 and r.choices[0].text for r in results.values())


def test_a_client_that_hangs_up_mid_stream_is_aborted_and_the_server_keeps_serving(server):
    import httpx

    body = {"model": SMALL_MODEL, "prompt": PROMPTS["prose"], "max_tokens": 512, "stream": True,
            "temperature": 0.7, "seed": 1}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        chunks = response.iter_lines()
        received = [line for line, _ in zip(chunks, range(3)) if line.startswith("data:")]
    assert received  # it really was mid-stream: tokens had arrived when the client left
    deadline = time.monotonic() + 60
    while server.metrics().get("vllm:num_requests_running", 0.0) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.metrics().get("vllm:num_requests_running", 0.0) == 0  # aborted, not run to 512 tokens
    assert _chat(server.client(), SMALL_MODEL, "Say hello.").choices[0].message.content


def test_metrics_count_drafts_proposed_and_accepted(server):
    values = server.metrics()
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= values["vllm:spec_decode_num_accepted_tokens_total"] > 0


def test_bad_requests_are_answered_with_4xx_and_the_server_survives(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        _chat(client, "no-such-model", "Hello")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SMALL_MODEL, prompt="Hello", max_tokens=-1)
    with pytest.raises(openai.AuthenticationError):
        _chat(server.client(api_key="wrong-key"), SMALL_MODEL, "Hello")
    with urllib.request.urlopen(f"{server.base_url}/health", timeout=30) as response:
        assert response.status == 200


def test_bench_url_drives_the_running_server_with_poisson_arrivals(server, tmp_path):
    command = [sys.executable, "-m", "adaptive_spec", "bench", "--engine", "vllm", "--url", f"{server.base_url}/v1",
               "--api-key", API_KEY, "--model", SMALL_MODEL, "--prompt", PROMPTS["repeat"], "--prompt",
               PROMPTS["code"], "--max-new-tokens", "16", "--temperatures", "0", "--rate", "4",
               "--num-requests", "4", "--save", str(tmp_path / "server.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout.strip().splitlines()[-1])
    (row,) = document["runs"]
    assert row["config"] == "server" and row["requests"] == 4 and row["regime"] == "poisson@4.0/s"
    assert row["tokens"] == 4 * 16  # greedy on these prompts runs to max_tokens
    assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0 and row["itl_p50_ms"] > 0
    assert row["acceptance_rate"] > 0  # from the server's counters: the plug-in drafted for these requests
    saved = json.loads((tmp_path / "server.json").read_text())
    assert saved["engine"] == "vllm-server" and len(saved["runs"][0]["prompts"]) == 4  # per-request figures


def test_sigterm_stops_the_server_and_every_process_it_started(server):
    assert server.descendants  # there was an API server (and engine core) to stop
    assert server.stop() == 0, server.log_tail()
    time.sleep(1)
    assert not server.survivors()
