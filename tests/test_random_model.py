"""scripts/random_model.py: a random model of the default model's shape with a long window,
that the engine loads from its directory and answers with beyond the default's 8,192 tokens."""

import importlib.util
from pathlib import Path

from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.models import load_model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "random_model.py"


def script():
    spec = importlib.util.spec_from_file_location("random_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_model_has_the_default_models_shape(default_model):
    config, module = default_model.model.config, script()
    for name, value in module.SHAPE.items():
        assert getattr(config, name) == value, name
    assert config.rope_parameters == module.ROPE
    assert abs(config.rms_norm_eps - module.RMS_EPS) < 1e-9


def test_random_model_loads_and_reads_past_the_default_window(tmp_path):
    out = script().write_model(tmp_path / "m", window=12_000, layers=2, vocab=600, small=True)
    loaded = load_model(str(out), device="cpu")
    assert loaded.model.config.max_position_embeddings == 12_000
    assert loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n")
    from sekv_bench.haystack import NEEDLES, haystack

    text = haystack(loaded.tokenizer, 9_000, 0.5, NEEDLES[0])
    (tmp_path / "doc.txt").write_text(text)
    for method in ("full", "sekv"):
        session = Session(loaded, load_document(tmp_path / "doc.txt"), method)
        assert session.doc_tokens > 8_192  # beyond the default model's window
        answer = session.ask(NEEDLES[0].question, 3)
        assert answer.tokens_generated >= 1
