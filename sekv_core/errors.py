class SekvError(Exception):
    """An error the user can act on; the CLI prints `Error: <message>` and exits 1."""
