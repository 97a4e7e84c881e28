"""`adaptive-spec serve`: an OpenAI-compatible server. Only `--engine vllm` exists: vLLM's server with
the speculation-length plug-in (see `adaptive_spec.integrations.vllm.serve`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..control.online_cost import COST_MODELS
from ..integrations.vllm.controller import ControllerSettings
from .common import add_calibrate_option, add_latency_option
from ..integrations.vllm.engine import EngineSpec
from ..integrations.vllm.profile import find_vllm_profile, start_line
from ..integrations.vllm.serve import run_serve


def add_serve_command(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="an OpenAI-compatible server (vLLM with the plug-in)",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", choices=("vllm",), default="vllm")
    parser.add_argument("--pair", default=None, help="a named target/draft pair (default qwen-coder)")
    parser.add_argument("--target", default=None, help="target model name or directory (instead of --pair)")
    parser.add_argument("--draft", default=None, help="draft model name or directory, 'ngram', or 'none'")
    parser.add_argument("--policy", default="goodput", help="the plug-in's policy (any name `generate` takes)")
    parser.add_argument("--profile", default="auto",
                        help="a latency profile JSON file or a learned state, 'auto' (the best vLLM profile in "
                             "profiles/ for these models: one of this machine first) or 'none' (learn online)")
    parser.add_argument("--cost-model", choices=COST_MODELS, default=None,
                        help="the policy's online cost correction: cells (per (batch, K) cell) or shared (parameters "
                             "shared by every cell); default cells, shared with --save-learned or a learned --profile")
    parser.add_argument("--save-learned", metavar="FILE", default=None,
                        help="write the shared cost model's learned state here as the server runs (every 256 "
                             "learned steps and at exit); pass it as --profile next time")
    add_calibrate_option(parser)
    add_latency_option(parser)
    parser.add_argument("--max-k", type=int, default=6, help="num_speculative_tokens: the cap on any k")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache size on CPU (GiB)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="clients must send it as a bearer token (passed to vLLM)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: vLLM binds all cores; use 1 on a shared machine)")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds to wait for the server's /health before giving up")
    parser.add_argument("--dry-run", action="store_true", help="print the command that would run and exit")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: passed to vLLM's server as is")


def run_serve_command(args) -> int:
    save = os.path.abspath(args.save_learned) if args.save_learned else None  # the server may run elsewhere
    options = dict(max_k=args.max_k, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib, threads=args.threads)
    if args.target:
        spec = EngineSpec(args.target, None if args.draft in (None, "none") else args.draft, **options)
    else:
        spec = EngineSpec.for_pair(args.pair or "qwen-coder", **options)
        if args.draft:
            spec = EngineSpec(spec.target, None if args.draft == "none" else args.draft, **options)
    profile = args.profile if args.profile not in ("auto", "none") else None
    if args.profile == "auto":
        found = find_vllm_profile(spec)
        profile = str(found) if found is not None else None
    if args.policy != "off":
        print(start_line(args.profile, profile), file=sys.stderr)
    if args.calibrate and args.policy == "off":
        raise ValueError("--calibrate sweeps draft lengths for a policy that reads step costs; --policy off reads none")
    settings = ControllerSettings(args.policy, profile, args.cost_model, save, args.calibrate, args.slo_tpot)
    spec = dataclasses.replace(spec, settings=settings)
    if args.policy != "off" and not args.dry_run:
        _, cost_model = settings.build()  # a bad policy or profile fails here, before vLLM spends a minute starting
        if save and cost_model is None:
            print(f"[--save-learned: policy {args.policy!r} reads no step costs; nothing will be written]",
                  file=sys.stderr)
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    if args.ready_timeout <= 0:
        raise ValueError(f"--ready-timeout must be positive, got {args.ready_timeout}")
    return run_serve(spec, args.host, args.port, extra, api_key=args.api_key, dry_run=args.dry_run,
                     ready_timeout=args.ready_timeout)
