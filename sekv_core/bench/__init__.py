"""Benchmarks: figures measured side by side in one run (ratios against full KV)."""
