"""The sekv command line (thin: parse, call sekv_core, render)."""

import os

# Progress goes through Rich on stderr; silence the tqdm bars of libraries (read at tqdm import).
os.environ.setdefault("TQDM_DISABLE", "1")
