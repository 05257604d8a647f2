"""Ground-truth QA on documents with a `.qa.json` beside them: each method, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sekv_core.config import MethodSettings
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.errors import SekvError
from sekv_core.methods import PrefillSlot
from sekv_core.models import LoadedModel

from .rows import resident_share


def bench_qa(
    loaded: LoadedModel,
    paths: list[Path],
    methods: list[str],
    settings: MethodSettings | None = None,
) -> list[dict[str, Any]]:
    """Per document and method: questions answered correctly (answer string contained)."""
    rows = []
    for path in paths:
        qa_file = path.with_suffix(".qa.json")
        if not qa_file.is_file():
            raise SekvError(f"no ground truth for '{path}': expected {qa_file}")
        items = json.loads(qa_file.read_text())
        document = load_document(path)
        prefills = PrefillSlot()  # the eviction methods' full prefill, once per document
        for method in methods:
            settings = settings or MethodSettings()
            session = Session(loaded, document, method, settings, prefills=prefills)
            hits, memory = [], {}
            for item in items:
                answer = session.ask(item["question"], max_new_tokens=48)
                hits.append(item["answer"].lower() in answer.answer.lower())
                memory = answer.memory
            rows.append(
                {
                    "document": path.name,
                    "method": method,
                    "correct": sum(hits),
                    "questions": len(items),
                    "hits": "".join("1" if h else "0" for h in hits),
                    "resident_share": resident_share(memory, 4),
                }
            )
    return rows
