"""Benchmarks: figures measured side by side in one run (ratios against full KV)."""


def resident_share(memory: dict[str, int], digits: int = 5) -> float:
    """An answer's resident memory as a share of the fp16 full KV cache of its document (every
    benchmark's ratio: the same whatever dtype the model runs in)."""
    return round(memory["resident_fp16_bytes"] / memory["full_kv_bytes_fp16"], digits)
