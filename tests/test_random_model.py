"""scripts/random_model.py: a random model of the default model's shape with a long window,
that the engine loads from its directory and answers with beyond the default's 8,192 tokens."""

import subprocess
import sys
from pathlib import Path

from sekv_bench.haystack import NEEDLES, haystack
from sekv_bench.random_model import RMS_EPS, ROPE, SHAPE
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.models import load_model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "random_model.py"


def test_random_model_has_the_default_models_shape(default_model):
    config = default_model.model.config
    for name, value in SHAPE.items():
        assert getattr(config, name) == value, name
    assert config.rope_parameters == ROPE
    assert abs(config.rms_norm_eps - RMS_EPS) < 1e-9


def test_random_model_loads_and_reads_past_the_default_window(tmp_path):
    out = tmp_path / "m"
    args = [str(out), "--window", "12000", "--layers", "2", "--vocab", "600", "--narrow"]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True)
    loaded = load_model(str(out), device="cpu")
    assert loaded.model.config.max_position_embeddings == 12_000
    assert loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n")
    (tmp_path / "doc.txt").write_text(haystack(loaded.tokenizer, 9_000, 0.5, NEEDLES[0]))
    for method in ("full", "sekv"):
        session = Session(loaded, load_document(tmp_path / "doc.txt"), method)
        assert session.doc_tokens > 8_192  # beyond the default model's window
        assert session.ask(NEEDLES[0].question, 3).tokens_generated >= 1
