"""Benchmark results as data: paired bootstrap intervals (`intervals`), ratios between the
configurations of one run (`comparisons`) and the result files `--save` writes (`result_file`).
No torch or vLLM imports, so the report and its tests run anywhere."""

from .comparisons import compare, is_static, ratio_cell, rotated
from .intervals import RatioInterval, excludes_one, paired_ratio_interval, prompts_for_half_width, rate_interval
from .result_file import RESULT_SCHEMA_VERSION, load_result, save_result

__all__ = ["compare", "is_static", "ratio_cell", "rotated", "RatioInterval", "excludes_one", "paired_ratio_interval",
           "prompts_for_half_width", "rate_interval", "RESULT_SCHEMA_VERSION", "load_result", "save_result"]
