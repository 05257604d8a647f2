"""The answering methods' CLI names, in the order of ``sekv_core.methods.METHODS``.

Plain tuples the CLI can show and check without importing torch (``sekv --help`` stays fast);
a test keeps them equal to the registry's keys.
"""

USER_METHODS: tuple[str, ...] = ("sekv", "full", "retrieve")  # what `sekv ask` and `chat` offer
BENCH_METHODS: tuple[str, ...] = (  # benchmark peers: `sekv bench` only
    "sekv-training-free",
    "sekv-trained",
    "streaming",
    "h2o",
    "snapkv",
    "chunkkv",
    "static",
    "blocks",
    "truncate",
)
METHOD_NAMES: tuple[str, ...] = USER_METHODS + BENCH_METHODS
