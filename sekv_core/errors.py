class SekvError(Exception):
    """An error the user can act on; the CLI prints `Error: <message>` and exits 1."""


class ArgumentError(SekvError, ValueError):
    """An argument out of range, named in the message: a ValueError to Python callers, one
    ``Error:`` line in the CLI."""


def one_line(exc: BaseException, limit: int = 160) -> str:
    """An exception as one short line (library errors span lines and name internals)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
