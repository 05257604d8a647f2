"""Start-up: help, usage errors and bad input are answered without importing torch or
transformers (a subprocess: the test session itself has torch loaded)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from typer.testing import CliRunner
    from sekv_cli.main import app

    runner = CliRunner()
    results = []
    for args, env in json.loads(sys.argv[1]):
        r = runner.invoke(app, args, env=env)
        results.append({"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr})
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    print(json.dumps({"results": results, "heavy": heavy}))
    """
)


def run_light(cases: list[tuple[list[str], dict[str, str]]]) -> list[dict]:
    """Invoke the app on each case in one fresh interpreter; check torch never loaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SEKV_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert out["heavy"] == [], f"imported {out['heavy']}"
    return out["results"]


def test_help_usage_and_bad_input_need_no_torch(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    missing = str(tmp_path / "missing.pdf")
    cases = [
        (["--help"], {}),
        (["-h"], {}),
        (["ask", "--help"], {}),
        (["ask", "-h"], {}),
        (["bench", "suite", "-h"], {}),
        (["ask", missing, "q"], {}),
        (["ask", str(doc), "   "], {}),
        (["ask", str(doc), "q", "--method", "bogus"], {}),
        (["ask", str(doc), "q", "--threads", "0"], {}),
        (["ask", str(doc)], {}),
        (["ask", str(doc), "q"], {"SEKV_THREADS": "x"}),
    ]
    res = run_light(cases)
    for r in res[:5]:
        assert r["code"] == 0 and "Usage:" in r["stdout"], r
    assert "ask" in res[0]["stdout"] and res[0]["stdout"] == res[1]["stdout"]
    assert "--threads" in res[2]["stdout"] and res[2]["stdout"] == res[3]["stdout"]
    errors = {5: "cannot read .*no such file", 6: "question is empty", 10: "SEKV_THREADS"}
    for i, pattern in errors.items():
        lines = res[i]["stderr"].strip().splitlines()
        assert res[i]["code"] == 1 and len(lines) == 1, res[i]
        assert lines[0].startswith("Error: ") and re.search(pattern, lines[0]), lines
        assert res[i]["stdout"] == ""
    for r in res[7:10]:
        assert r["code"] == 2, r  # usage errors


def test_method_names_match_the_registry():
    from sekv_core.method_names import METHOD_NAMES
    from sekv_core.methods import METHODS

    assert METHOD_NAMES == tuple(METHODS)


def test_users_get_three_methods_and_the_engine_asks_methods_what_method_declares():
    """`sekv ask` offers sekv, full and retrieve; the rest are benchmark peers. What the engine
    asks of a method is declared on Method (with a default), never probed with getattr."""
    from pathlib import Path

    from sekv_core.method_names import BENCH_METHODS, USER_METHODS
    from sekv_core.methods import METHODS, Method

    assert USER_METHODS == ("sekv", "full", "retrieve")
    assert not set(USER_METHODS) & set(BENCH_METHODS)
    assert {"sekv-training-free", "sekv-trained", "h2o", "snapkv"} <= set(BENCH_METHODS)
    assert Method.reads_books is False and "question_position" in vars(Method)
    assert {n for n, m in METHODS.items() if m.reads_books} == {
        "sekv", "sekv-training-free", "sekv-trained", "retrieve", "truncate",
    }  # fmt: skip
    core = Path(__file__).resolve().parents[1] / "sekv_core"
    for path in (core / "engine.py", *sorted((core / "methods").glob("*.py"))):
        text = path.read_text()
        assert "getattr(" not in text and "hasattr(" not in text, path
