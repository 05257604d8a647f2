"""The span store: a document's spans, coded once, kept on disk, verified at every load.

The store knows nothing of zooming: :func:`sekv_core.ingest.open_or_build` (above the store and
the zoom) opens a valid store or builds one, and hands the streamed build the zoom's chunk reader.

- :mod:`.build` — the one-shot build: one prefill of a context that fits the model window.
- :mod:`.stream` — the streamed build of a longer context, chunk by chunk (told there once);
  :mod:`.partial` the store it grows, part by part, and the part files; :mod:`.checkpoint` its
  state between chunks (resume).
- :mod:`.write` — the one finishing path of both builds: code, then write atomically.
- :mod:`.load` — :class:`~.load.SpanStore`, verified and read in three stages; :mod:`.resident`
  its resident tier, one typed object (what a build writes and what answers read).
- :mod:`.format` — names, manifest and digest (every file: ``docs/store-format.md``);
  :mod:`.tensorfile` the one reader of the safetensors files.
- :mod:`.codes` — the offload tier's key and value codes (their specs: :mod:`sekv_core.code_specs`);
  :mod:`.entropy` (``sekv_core/native/rans.c``) — those records entropy-coded in blocks.
- :mod:`.shelf` — the stores on disk (`sekv stores`); one builder per store and the leftovers
  of killed builders: :mod:`sekv_core.locks` (below the store: a converted model is written
  the same way).
"""
