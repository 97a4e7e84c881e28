"""What skipping the draft at K = 0 saves, side by side in one vLLM engine.

    python -m adaptive_spec.integrations.vllm.upkeep_bench --pair qwen-coder --batch-sizes 1,4

For each batch size and round, the same requests run twice, once with vLLM's draft upkeep
(`ADAPTIVE_SPEC_VLLM_LAZY_DRAFT=0`) and once lazy: `--off-steps` steps at K = 0, then K = 3. It prints
per run the median K = 0 step, the step that resumes drafting (where the lazy draft catches up over
the prompt and every skipped token) and the median K = 3 step after it, in milliseconds. Step times
are the intervals between the scheduler's calls to the policy. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


class OffThenOn:
    """k = 0 for `off_steps` choices, then `k`; stamps each choice (one per step) and keeps every
    step record (the lazy-draft tests use it too)."""

    name = "off-then-on"

    def __init__(self, off_steps: int, k: int):
        self.calls, self.off_steps, self.k, self.stamps, self.records = 0, off_steps, k, [], []

    def choose(self, views):
        self.calls += 1
        self.stamps.append(time.perf_counter())
        return [0 if self.calls <= self.off_steps else self.k] * len(views)

    def observe(self, record):
        self.records.append(record)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen-coder")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--off-steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    from vllm import SamplingParams

    from . import lazy_draft
    from .controller import SpecController
    from .engine import EngineSpec, make_llm
    from .scheduler import scheduler_of

    k = 3
    llm = make_llm(EngineSpec.for_pair(args.pair, max_k=k, threads=args.threads))
    scheduler = scheduler_of(llm)
    rng = np.random.default_rng(0)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [{"prompt_token_ids": rng.integers(100, 20000, size=args.context).tolist()} for _ in range(batch)]
        for round_ in range(args.rounds):
            for mode in ("upkeep", "lazy"):
                os.environ[lazy_draft.LAZY_ENV] = "0" if mode == "upkeep" else "1"
                policy = OffThenOn(args.off_steps, k)
                controller = SpecController(policy)
                scheduler.use_controller(controller)
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.off_steps + 6 * (k + 1),
                                                     ignore_eos=True), use_tqdm=False)
                steps = np.diff(policy.stamps)  # steps[i]: the step that began with choice i
                rows.append({"batch": batch, "round": round_, "mode": mode,
                             "k0_ms": round(float(np.median(steps[4:args.off_steps - 1])) * 1e3),
                             "resume_ms": round(float(steps[args.off_steps]) * 1e3),
                             "k3_ms": round(float(np.median(steps[args.off_steps + 2:])) * 1e3),
                             "k3_steps": len(steps) - args.off_steps - 2,
                             "acceptance": round(controller.stats.accepted / max(controller.stats.drafted, 1), 3)})
                print(json.dumps(rows[-1]), flush=True)
    os.environ.pop(lazy_draft.LAZY_ENV, None)
    for batch in sorted({row["batch"] for row in rows}):
        mean = {mode: np.mean([r["k0_ms"] for r in rows if r["batch"] == batch and r["mode"] == mode])
                for mode in ("upkeep", "lazy")}
        print(f"batch {batch}: K = 0 step, lazy / upkeep = {mean['lazy'] / mean['upkeep']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
