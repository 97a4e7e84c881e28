"""Wall-clock figures that used to be test assertions, as a benchmark: it prints, it does not fail.

    .venv/bin/python scripts/bench_timings.py

- cost model: microseconds per `CostModel.step_seconds` query (the tests once asserted < 50 us);
- simulator: seconds to simulate 1000 requests of 256 tokens at static:2 (once asserted < 15 s;
  about 1 s on an idle 2-core CPU);
- online correction: a cost model fed the engine's own steps of tiny random models, its prediction
  against the measured step (once asserted within 2x either way), and the uncorrected default's.

Timings depend on the machine and on what else runs on it: compare figures from one machine only.
The functional checks behind each stay in tests/ (test_cost_model.py, test_simulation.py,
test_profiler.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' synthetic profiles and traces


def cost_model_query(n: int = 20000) -> dict:
    from adaptive_spec.control.cost_model import CostModel
    from test_cost_model import knee, make_profile, record

    model = CostModel.from_profile(make_profile(target=knee))
    for _ in range(20):
        model.observe(record(2, 600, 2, 0.1, 0.5, 0.01))
    started = time.perf_counter()
    for i in range(n):
        model.step_seconds(1 + i % 8, 600.0, i % 9)
    return {"us_per_step_seconds": round((time.perf_counter() - started) / n * 1e6, 2), "was_asserted_below_us": 50}


def simulator() -> dict:
    from adaptive_spec.simulation import simulate
    from test_simulation import PROFILE, synthetic

    trace = synthetic(8, 256, alpha=0.7).requests()
    started = time.perf_counter()
    report = simulate(trace, PROFILE, "static:2", num_requests=1000)
    return {"seconds": round(time.perf_counter() - started, 3), "generated_tokens": report["generated_tokens"],
            "was_asserted_below_s": 15}


def online_correction() -> dict:
    import numpy as np
    import torch

    from adaptive_spec.control.cost_model import CostModel
    from adaptive_spec.engine.engine import SpecEngine
    from adaptive_spec.profiling.profiler import random_model, resolve_config
    from adaptive_spec.sampling.params import SamplingParams

    class Learning:
        name = "learning"

        def __init__(self):
            self.model, self.records = CostModel.default(), []

        def choose(self, requests):
            return [2] * len(requests)

        def observe(self, record):
            self.records.append(record)
            self.model.observe(record)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = resolve_config("tiny-qwen2")
        policy = Learning()
        engine = SpecEngine(random_model(config, seed=0), random_model(config, seed=1), policy, max_k=2, seed=0)
        engine.generate([[1, 2, 3, 4], [5, 6, 7, 8]], SamplingParams(max_new_tokens=40, seed=1))
    finally:
        torch.set_num_threads(threads)
    steady = [r for r in policy.records if r.batch_size == 2 and r.batch_k == 2][-5:]
    measured = float(np.median([r.total_seconds for r in steady]))
    context = max(steady[-1].context_lengths)
    predicted = policy.model.step_seconds(2, context, 2)
    default = CostModel.default().step_seconds(2, context, 2)
    return {"measured_s": round(measured, 5), "predicted_over_measured": round(predicted / measured, 3),
            "default_over_measured": round(default / measured, 3), "was_asserted_within": "0.5x-2x"}


def main() -> int:
    figures = {"cost_model_query": cost_model_query(), "simulator": simulator(), "online_correction": online_correction()}
    for name, values in figures.items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in values.items()))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
