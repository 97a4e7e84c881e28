"""`bench --engine vllm --url`'s client against a stand-in OpenAI-compatible server (no vLLM needed):
tokens credited per streamed chunk from the running usage counts, so a chunk that carries a
speculative step's several tokens counts them all; acceptance from the server's counters."""

from __future__ import annotations

import http.server
import json
import threading
from types import SimpleNamespace

import pytest

from adaptive_spec.assets.prompts import Prompt
from adaptive_spec.integrations.vllm.client_bench import Client, _acceptance, _only_model, _stream

CHUNK_TOKENS = (1, 3, 1, 4)  # tokens per streamed chunk: a first token, then speculative steps


class StandIn(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_GET(self):
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        StandIn.requests.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        total = 0
        for tokens in CHUNK_TOKENS:
            total += tokens
            chunk = {"choices": [{"delta": {"content": "x" * tokens}}], "usage": {"completion_tokens": total}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _args(**overrides):
    return SimpleNamespace(**{"max_new_tokens": 9, "no_chat": False, **overrides})


def test_every_token_of_a_multi_token_chunk_is_credited_at_its_arrival(base_url):
    prompt = Prompt("p0", None, "Count to nine.", "prompts")
    timing = _stream(Client(), base_url, "tiny", prompt, 0.0, _args(), seed=5, arrival=0.0)
    assert len(timing.token_times) == sum(CHUNK_TOKENS)  # 9 tokens, not 4 chunks
    assert len(timing.event_times) == len(CHUNK_TOKENS)
    assert timing.token_times[1] == timing.token_times[3] == timing.event_times[1]  # one chunk, one stamp
    path, body = StandIn.requests[-1]
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "Count to nine."}]
    assert body["seed"] == 5 and body["stream_options"]["continuous_usage_stats"] is True


def test_no_chat_sends_a_plain_completion(base_url):
    prompt = Prompt("p1", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None, "prompts")
    _stream(Client(), base_url, "tiny", prompt, 0.7, _args(no_chat=True), seed=1, arrival=0.0)
    path, body = StandIn.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == "a\n\nb" and body["temperature"] == 0.7


def test_the_only_served_model_is_found(base_url):
    assert _only_model(Client(), base_url) == "tiny"


def test_acceptance_from_the_counters_difference():
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    before, after = dict(zip(names, (10, 30, 20))), dict(zip(names, (20, 60, 35)))
    assert _acceptance(before, after) == {"acceptance_rate": 0.5, "mean_acceptance_length": 2.5}
    assert _acceptance({}, after) == {}  # a server without /metrics: no acceptance figures
