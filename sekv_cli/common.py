"""The names ``sekv_cli.train`` still imports from here, until it imports them from the modules
that hold them (:mod:`.options`, :mod:`.errors`, :mod:`.loading`, :mod:`.output`,
:mod:`.terminal`); then this module goes. Nothing else imports it.
"""

from __future__ import annotations

from .errors import handle_errors
from .loading import check_home, load_model_quietly
from .options import JSON_OPTION, MODEL_OPTION, THREADS_OPTION
from .output import print_json
from .terminal import err

__all__ = [
    "JSON_OPTION",
    "MODEL_OPTION",
    "THREADS_OPTION",
    "check_home",
    "err",
    "handle_errors",
    "load_model_quietly",
    "print_json",
]
