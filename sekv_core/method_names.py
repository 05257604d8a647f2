"""The answering methods' CLI names, in the order of ``sekv_core.methods.METHODS``.

A plain tuple the CLI can show and check without importing torch (``sekv --help`` stays fast);
a test keeps it equal to the registry's keys.
"""

METHOD_NAMES: tuple[str, ...] = (
    "sekv",
    "sekv-trained",
    "full",
    "streaming",
    "h2o",
    "snapkv",
    "chunkkv",
    "static",
    "blocks",
    "retrieve",
    "truncate",
)
