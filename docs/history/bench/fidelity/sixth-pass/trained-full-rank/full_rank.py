"""sekv-trained with its rank gate open (every stored rank kept).

python full_rank.py ROUTER OUT  (the sixth pass's 26 questions at 10 / 15 / 20% targets)
"""

import json
import sys
from pathlib import Path

import sekv_core.methods.sekv as sm
from sekv_core.bench.fidelity import run_fidelity
from sekv_core.bench.suite import SuiteConfig
from sekv_core.methods.base import MethodSettings
from sekv_core.models import load_model

gated = sm.SeKV.new_policy


def new_policy(self):
    policy = gated(self)
    self.spans.rank_gate = None  # the trained relevance gate routes; every rank is kept
    return policy


sm.SeKV.new_policy = new_policy
cfg = SuiteConfig(
    methods=["sekv-trained"],
    tasks=["needle", "multikey", "qa"],
    lengths=[2000, 4000],
    depths=[0.25, 0.75],
    budgets=[0.1, 0.15, 0.2],
    seeds=[1],
    trained_router=sys.argv[1],
)
summary = run_fidelity(load_model(None), cfg, Path(sys.argv[2]), settings=MethodSettings())
print(json.dumps(summary["configs"], indent=1))
