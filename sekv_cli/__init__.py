"""The sekv command line (thin: parse, call sekv_core, render)."""

import os

# Progress goes through Rich on stderr; silence the tqdm bars of libraries (read at tqdm import).
os.environ.setdefault("TQDM_DISABLE", "1")
# Idle OpenMP threads sleep instead of spinning (the machine is often shared). OpenMP reads this
# once, when torch loads it: it must be set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
