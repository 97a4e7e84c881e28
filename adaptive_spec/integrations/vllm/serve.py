"""`adaptive-spec serve --engine vllm`: vLLM's OpenAI-compatible server with the scheduler plug-in.

A thin wrapper: it resolves the project's model names to local directories, and runs

    ADAPTIVE_SPEC_VLLM_POLICY=goodput ADAPTIVE_SPEC_VLLM_PROFILE=none \\
    vllm serve TARGET_DIR --dtype float32 --enforce-eager --no-async-scheduling \\
        --speculative-config '{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 6}' \\
        --scheduler-cls adaptive_spec.integrations.vllm.AdaptiveScheduler

which is the equivalent to type by hand (`--dry-run` prints it). Anything after `--` goes to vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from .engine import SCHEDULER_CLASS, EngineSpec


def serve_command(spec: EngineSpec, host: str, port: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and the environment variables it needs."""
    kwargs = spec.llm_kwargs()
    argv = ["vllm", "serve", kwargs["model"], "--dtype", spec.dtype, "--enforce-eager", "--no-async-scheduling",
            "--max-model-len", str(spec.max_model_len), "--max-num-seqs", str(spec.max_num_seqs),
            "--host", host, "--port", str(port), "--served-model-name", Path(spec.target).name]
    speculative = spec.speculative_config()
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative)]
        if spec.adaptive:
            argv += ["--scheduler-cls", SCHEDULER_CLASS]
    env = {k: v for k, v in spec.environment().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return argv + list(extra), env


def run_serve(spec: EngineSpec, host: str, port: int, extra: list[str], dry_run: bool = False) -> int:
    argv, env = serve_command(spec, host, port, extra)
    if dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
        return 0
    vllm = Path(sys.executable).with_name("vllm")
    if not vllm.exists():
        raise FileNotFoundError("vLLM is not installed in this environment (scripts/setup.sh --vllm builds "
                                ".venv-vllm; run its adaptive-spec)")
    os.execve(str(vllm), [str(vllm)] + argv[1:], {**os.environ, **env})
