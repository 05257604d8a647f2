"""The `sekv` executable: a command goes to the warm process where one runs
(:mod:`.warm_process`), else it runs here. ``python -m sekv_cli.launch --warm-process IDLE_S``
is the warm process itself (``sekv warm`` starts it)."""

from __future__ import annotations

import sys


def main() -> None:
    from .warm_process import forward

    code = forward(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from .main import app

    app(prog_name="sekv")


def run_app(argv: list[str]) -> int:
    """Run ``sekv ARGV`` in this process; the exit status the executable would end with."""
    from .main import app

    try:
        app(args=argv, prog_name="sekv")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--warm-process"]:
        from .warm_process import serve

        serve(float(sys.argv[2]), run_app)
    else:
        main()
