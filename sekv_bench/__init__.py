"""Benchmarks: figures measured side by side in one run (shares of the fp16 full KV cache).

An application on top of the engine (:mod:`sekv_core`), which never imports it:

- :mod:`.suite` plans and runs every method x memory share on every task sample;
  :mod:`.report` summarises the rows (tables, the stated goal, plots from :mod:`.plots`);
- :mod:`.fidelity` compares each method's next-token distributions with full KV's;
- :mod:`.needle`, :mod:`.qa`, :mod:`.ingest`, :mod:`.book`: the smaller benchmarks;
- :mod:`.speed` SeKV vs full KV speed (decode, first token, build, process wall), with
  :mod:`.speed_env` (the machine, child processes, a busy neighbour);
- :mod:`.tasks`, :mod:`.haystack`, :mod:`.score`: generated samples and their scoring;
- :mod:`.diagnostics`: the oracle router and the routing probe (recall against the oracle, the
  exact span attention the picks hold) — measured here, outside the answer path;
- :mod:`.rows`: what every results row shares (memory shares, grouping, old runs' keys).
"""
