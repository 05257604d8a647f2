"""Experiment (not shipped): SeKV's zoom budget split unevenly across layers.

Usage: python layer_budgets.py FACTORS.json OUT_DIR [METHODS]

FACTORS.json holds one factor per layer (mean 1): layer l zooms round(budget * factor[l]) tokens
per KV head instead of the uniform budget. Runs the fidelity harness on the benchmark's 26
questions at 10 / 15 / 20% memory targets and prints one line per configuration.
"""

import json
import sys
from pathlib import Path

import sekv_core.attention as att
from sekv_core.bench.fidelity import run_fidelity
from sekv_core.bench.suite import SuiteConfig
from sekv_core.models import load_model
from sekv_core.zoom import SpanMemory


def main() -> None:
    factors = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    methods = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sekv"]
    uniform_route, uniform_clear = att.route, SpanMemory.clear

    def route(memory, policy, layer, q, scaling):
        budget = policy.budget
        policy.budget = int(round(budget * factors[layer]))
        try:
            return uniform_route(memory, policy, layer, q, scaling)
        finally:
            policy.budget = budget

    def clear(memory, capacity):  # the largest layer's pool may be rebuilt
        uniform_clear(memory, int(capacity * max(factors)))

    att.route, SpanMemory.clear = route, clear
    config = SuiteConfig(
        methods=methods,
        tasks=["needle", "multikey", "qa"],
        lengths=[2000, 4000],
        depths=[0.25, 0.75],
        budgets=[0.1, 0.15, 0.2],
        seeds=[1],
    )
    summary = run_fidelity(load_model(None), config, out)
    for c in summary["configs"]:
        print(c["label"], c["top1_agreement"], c["kl_per_token"], c["resident_ratio"])


if __name__ == "__main__":
    main()
