"""`sekv warm`: a warm process runs each later command as the `sekv` executable would have (same
output, exit status, standard input, Ctrl-C), and stops serving when the code changes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TEXT = (
    "The lighthouse keeper's dog is called Biscuit. The station log is kept in a red book.\n\n"
    "Every evening the lamp is lit at dusk and the weather is written down by hand.\n"
)


def sekv(env: dict[str, str], *args: str, warm: bool = True, **kwargs) -> subprocess.Popen:
    """`sekv ARGS` as a shell starts it: Ctrl-C not ignored, whatever this process inherited
    (a background job of a non-interactive shell ignores it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "sekv_cli", *args],
        env={**env, "SEKV_WARM": "1" if warm else "0"},
        stdin=kwargs.pop("stdin", subprocess.DEVNULL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )


def run(env: dict[str, str], *args: str, warm: bool = True, stdin: str | None = None):
    child = sekv(env, *args, warm=warm, stdin=subprocess.PIPE if stdin is not None else None)
    out, err = child.communicate(stdin, timeout=180)
    return child.returncode, out, err


def served(env: dict[str, str]) -> int | None:
    code, out, err = run(env, "warm", "--status", "--json")
    assert code == 0, err
    state = json.loads(out)["warm"]
    return None if state is None else state["served"]


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tiny_model_dirs):
    """A warm process for a home of its own (its socket in a temporary folder of its own), a
    document and a tiny model; stopped after the module."""
    root = tmp_path_factory.mktemp("warm")
    (root / "tmp").mkdir()
    env = {
        **os.environ,
        "SEKV_HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "OMP_NUM_THREADS": "1",
    }
    doc = root / "log.md"
    doc.write_text(TEXT)
    model = str(tiny_model_dirs["llama"])
    code, out, err = run(env, "warm", "--idle", "10")
    assert code == 0 and "sekv is warm" in out, err
    yield env, doc, model
    run(env, "warm", "--stop")


def test_a_command_runs_in_the_warm_process_as_it_would_directly(warm):
    env, doc, model = warm
    ask = ("ask", str(doc), "What is the dog called?", "--model", model, "--max-new-tokens", "6")
    direct = run(env, *ask, warm=False)  # builds the store; the next two find it
    assert direct[0] == 0, direct[2]
    before = served(env)
    warmed = run(env, *ask)
    again = run(env, *ask, warm=False)
    assert served(env) == before + 1  # the warm process ran it, and only it
    assert warmed[0] == again[0] == 0 and warmed[1] == again[1]
    # an error: the same line, the same status
    missing = ("ask", str(doc.with_name("missing.md")), "q", "--model", model)
    failed = run(env, *missing)
    assert failed == run(env, *missing, warm=False) and failed[0] == 1 and "Error:" in failed[2]


def test_standard_input_reaches_the_command(warm):
    env, doc, model = warm
    chat = ("chat", str(doc), "--model", model, "--max-new-tokens", "4")
    piped = "/sources\nWhere is the log kept?\n/quit\n"
    warmed, direct = run(env, *chat, stdin=piped), run(env, *chat, warm=False, stdin=piped)
    assert warmed[0] == direct[0] == 0
    assert warmed[1] == direct[1] and "> Where is the log kept?" in warmed[1]


def test_ctrl_c_reaches_the_command(warm):
    env, doc, model = warm
    outcomes = []
    for use_warm in (True, False):
        child = sekv(env, "chat", str(doc), "--model", model, warm=use_warm, stdin=subprocess.PIPE)
        assert child.stderr is not None
        line = ""
        while "Ask a question" not in line:  # the chat waits for a question
            line = child.stderr.readline()
            assert line, "chat ended before it asked"
        time.sleep(1)  # into its input(): Ctrl-C there ends the chat quietly
        child.send_signal(signal.SIGINT)
        child.wait(timeout=60)  # before its input closes: the chat ends for Ctrl-C, not EOF
        _, err = child.communicate(timeout=60)
        outcomes.append((child.returncode, err))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == 0


def test_a_command_from_other_code_ends_the_warm_process(warm):
    """Commands run directly from then on (sekv was upgraded or edited under it)."""
    from sekv_cli import warm_process

    env, doc, _ = warm
    saved = {k: os.environ.get(k) for k in ("SEKV_HOME", "TMPDIR")}
    os.environ.update({k: env[k] for k in saved})
    import tempfile

    tempfile.tempdir = None  # TMPDIR is read again
    try:
        sock = warm_process.connect(warm_process.socket_path())
        assert sock is not None
        with sock:
            warm_process.send(sock, {"stamp": "other code", "argv": ["--version"]})
            assert sock.makefile("rb").readline() == b"stopping\n"
        deadline = time.monotonic() + 10
        while warm_process.socket_path().exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not warm_process.socket_path().exists()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        tempfile.tempdir = None
    assert served(env) is None
    code, out, _ = run(env, "--version")
    assert code == 0 and out.startswith("sekv ")


def test_without_a_warm_process_commands_run_directly(tmp_path):
    env = {**os.environ, "SEKV_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}
    assert served(env) is None
    code, out, _ = run(env, "warm", "--stop")
    assert code == 0 and "No warm process runs" in out
    assert not Path(tmp_path / f"sekv-{os.getuid()}").exists()
