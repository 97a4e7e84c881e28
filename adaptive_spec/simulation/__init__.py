"""Acceptance traces, a trace-driven simulator, the hindsight oracle and three more ceilings.

Everything here is pure numpy/pandas (no torch) except `recorder`, which runs models and is
imported only when a trace is recorded.

- `trace_file`: the trace format (CSV + JSON header line), `load_trace`, `save_trace`, `make_trace`.
- `replay`: the replay semantics (one uniform per position, leading runs, caps).
- `simulator`: `simulate(traces, profile, policy, batch_size=..., rate=..., ...)`.
- `oracle`: the hindsight DP (exact at batch size 1) and the batch upper bound.
- `ceilings`: `request-static-oracle` (each request's best fixed k in hindsight),
  `confidence-oracle` (each step's best expected goodput from the true acceptance probabilities) and
  `confidence-bound` (batch 1: what the draft's confidence can buy a policy, at most).
"""

from .oracle import dp_schedule
from .replay import expected_emitted_iid
from .simulator import simulate
from .trace_file import RequestTrace, Trace, TraceError, load_trace, load_traces, make_trace, save_trace

__all__ = ["simulate", "dp_schedule", "expected_emitted_iid", "RequestTrace", "Trace", "TraceError",
           "load_trace", "load_traces", "make_trace", "save_trace"]
