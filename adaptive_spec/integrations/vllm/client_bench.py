"""`adaptive-spec bench --engine vllm --url URL`: drive a running OpenAI-compatible server (ours from
`adaptive-spec serve`, or any vLLM) with a seeded Poisson arrival trace, as its users' traffic would,
and report the same TTFT / TPOT / ITL table as the in-process bench.

Each request streams with vLLM's running usage counts (`continuous_usage_stats`), so every chunk's
time stamp is credited with the exact number of tokens it carried: a speculative step that emits
four tokens in one chunk counts four. Acceptance comes from the server's `/metrics` counters before
and after the stream (vLLM's speculative counters; absent on a server without speculation). The
server's policy is whatever it was started with: this measures the deployment, not a policy sweep.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request

from ...results.result_file import result_document, save_result
from .bench import RequestTiming, _arrivals, _print_table, _summary

SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")


def run_client_bench(args, prompts) -> int:
    if getattr(args, "repeats", 1) != 1:
        raise ValueError("--repeats is for the in-process bench; with --url, raise --num-requests instead")
    base = args.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    client = Client(args.api_key)
    model = args.model or _only_model(client, base)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    count = args.num_requests or len(prompts)
    trace = _arrivals(args.rate, count, args.seed) if args.rate > 0 else None
    rows = []
    for temperature in temperatures:
        before = _spec_counters(client, base)
        if trace is None:  # batch 1: one request at a time
            timings = [_stream(client, base, model, prompts[i % len(prompts)], temperature, args, args.seed + i,
                               time.perf_counter(), i) for i in range(count)]
        else:
            timings = _replay(client, base, model, prompts, trace, temperature, args)
        row = _summary("server", temperature, timings, None, args.rate)
        row.update(_acceptance(before, _spec_counters(client, base)))
        rows.append(row)
        print(f"[server t={temperature} done]", file=sys.stderr)
    _print_table(rows)
    per_request = [row.pop("prompts") for row in rows]
    document = {"engine": "vllm-server", "url": base, "model": model,
                "settings": {"prompts": [p.id for p in prompts], "max_new_tokens": args.max_new_tokens,
                             "rate": args.rate, "requests": count, "seed": args.seed, "chat": not args.no_chat},
                "runs": rows}
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(document, handle, indent=1)
    if getattr(args, "save", None):
        runs = [{**row, "prompts": records} for row, records in zip(rows, per_request)]
        label = f"bench-server-{'batch1' if args.rate <= 0 else f'rate{args.rate:g}'}"
        save_result(args.save, label, result_document("bench", args, {**document, "runs": runs}))
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    return 0


def _replay(client, base, model, prompts, trace, temperature, args) -> list[RequestTiming]:
    """Start each request at its arrival offset on its own thread; wait for all."""
    timings: list[RequestTiming | None] = [None] * len(trace)
    errors: list[BaseException] = []
    start = time.perf_counter()

    def send(index: int) -> None:
        try:
            timings[index] = _stream(client, base, model, prompts[index % len(prompts)], temperature, args,
                                     args.seed + index, start + trace[index], index)
        except BaseException as error:  # reported below, after the others finish
            errors.append(error)

    threads = []
    for index, offset in enumerate(trace):
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        threads.append(threading.Thread(target=send, args=(index,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return timings


def _stream(client, base, model, prompt, temperature, args, seed, arrival, index=0) -> RequestTiming:
    body = {"model": model, "max_tokens": args.max_new_tokens, "temperature": temperature, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if args.no_chat:
        route = "completions"
        body["prompt"] = prompt.text if prompt.text is not None else "\n\n".join(m["content"] for m in prompt.messages)
    else:
        route = "chat/completions"
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text}]
    schema = getattr(prompt, "json_schema", None)
    if schema is not None:  # OpenAI's form, which our server passes to vLLM's structured outputs
        body["response_format"] = ({"type": "json_object"} if not schema else
                                   {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    timing, emitted = RequestTiming(arrival, prompt.source, index=index), 0
    with client.post(f"{base}/{route}", body) as response:
        for raw in response:  # server-sent events, one per line
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamp = time.perf_counter()
            usage = json.loads(line[len("data: "):]).get("usage") or {}
            new = usage.get("completion_tokens", emitted) - emitted
            if new > 0:
                emitted += new
                timing.token_times += [stamp] * new
                timing.event_times.append(stamp)
    return timing


def _only_model(client, base) -> str:
    with client.get(f"{base}/models") as response:
        names = [entry["id"] for entry in json.load(response)["data"]]
    if len(names) != 1:
        raise ValueError(f"{base} serves {names}: name one with --model")
    return names[0]


def _spec_counters(client, base) -> dict[str, float]:
    try:
        with client.get(base[: -len("/v1")] + "/metrics") as response:
            text = response.read().decode()
    except ValueError:  # no /metrics here: no acceptance figures
        return {}
    values = parse_metrics(text)
    return {name: values.get(name, 0.0) for name in SPEC_METRICS}


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text: each `vllm:` sample, summed over its label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        found = re.match(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if found:
            values[found.group(1)] = values.get(found.group(1), 0.0) + float(found.group(2))
    return values


def _acceptance(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}
    drafts, drafted, accepted = (after[name] - before[name] for name in SPEC_METRICS)
    out = {}
    if drafted:
        out["acceptance_rate"] = round(accepted / drafted, 4)
    if drafts:
        out["mean_acceptance_length"] = round(1 + accepted / drafts, 4)
    return out


class Client:
    """Plain HTTP with the standard library (thread-safe: one connection per request); an HTTP error
    becomes a ValueError with the server's own words."""

    def __init__(self, api_key: str | None = None, timeout: float = 600.0):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def get(self, url: str):
        return self._open(urllib.request.Request(url, headers=self.headers))

    def post(self, url: str, body: dict):
        headers = {**self.headers, "Content-Type": "application/json"}
        return self._open(urllib.request.Request(url, json.dumps(body).encode(), headers))

    def _open(self, request):
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raise ValueError(f"{request.full_url} answered {error.code}: {error.read()[:300].decode(errors='replace')}") from None
        except urllib.error.URLError as error:
            raise ValueError(f"cannot reach {request.full_url}: {error.reason}") from None
