"""What the speed benchmark runs in: the machine, a fresh store home, a CPU-heavy neighbour,
and `sekv` commands run as child processes (whole-process wall time and peak RSS).

Kept apart from :mod:`.speed` (the measurements) because all of it is about processes and the
environment, not the engine.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sekv_core.errors import SekvError
from sekv_core.paths import sekv_home

HOME_ENV = "SEKV_HOME"
# kept from the user's home: the converted default model, routers, the compiled native kernels
SHARED = ("models", "routers", "native")
HOG = (
    "import torch\n"
    "a = torch.randn(1024, 1024)\n"
    "a @ a\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    a @ a\n"
)


def machine(device: str) -> dict[str, Any]:
    """The machine the figures were measured on: CPU model, cores, torch threads and version."""
    import torch

    return {
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else None."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else None


@contextmanager
def fresh_home(parent: Path) -> Iterator[Path]:
    """A new, empty ``$SEKV_HOME`` under ``parent`` for the duration (restored after).

    Its stores start empty, so the first SeKV session builds its store here, timed; the user's
    converted default model, trained routers and compiled kernels are linked in, so models load
    as fast and route as they would outside the benchmark.
    """
    user = sekv_home()
    home = Path(tempfile.mkdtemp(prefix="home-", dir=parent))
    for name in SHARED:
        (user / name).mkdir(exist_ok=True)
        (home / name).symlink_to(user / name, target_is_directory=True)
    old = os.environ.get(HOME_ENV)
    os.environ[HOME_ENV] = str(home)
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop(HOME_ENV, None)
        else:
            os.environ[HOME_ENV] = old


@contextmanager
def cpu_neighbour() -> Iterator[subprocess.Popen]:
    """A second process doing torch matmuls at torch's default threads until the block ends
    (it is started, and spinning, before the block runs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True, env=env
    )  # fmt: skip
    try:
        if hog.stdout is not None:
            hog.stdout.readline()  # "ready": torch imported, the first matmul done
        yield hog
    finally:
        hog.kill()
        hog.wait()


CHILD = (
    "import atexit, sys\n"
    "def peak():\n"
    "    try:\n"
    "        lines = open('/proc/self/status').read().splitlines()\n"
    "    except OSError:\n"
    "        return\n"
    "    for line in lines:\n"
    "        if line.startswith('VmHWM:'):\n"
    "            open(sys.argv[1], 'w').write(line.split()[1])\n"
    "atexit.register(peak)\n"
    "from sekv_cli.main import app\n"
    "app(prog_name='sekv', args=sys.argv[2:])\n"
)


def sekv_command(args: list[str], model: str | None, threads: int) -> dict[str, Any]:
    """Run ``sekv ARGS --json`` as a child process; its JSON, wall time and peak RSS.

    The wall time is the whole process's (interpreter start, imports, model load, the work), as
    a user at a shell sees it. Peak RSS is the child's own high-water mark (``VmHWM``, Linux;
    None elsewhere): ``ru_maxrss`` would not do, a child starts from its parent's high-water
    mark on Linux, and this parent holds a model.
    """
    args = [*args, "--json", "--threads", str(threads), *(["--model", model] if model else [])]
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak-kib"
        start = time.perf_counter()
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(peak), *args], capture_output=True, text=True
        )
        wall_s = time.perf_counter() - start
        if child.returncode != 0:
            raise SekvError(f"`sekv {' '.join(args)}` failed: {child.stderr.strip()[-500:]}")
        kib = peak.read_text() if peak.exists() else ""
    return {
        "wall_s": round(wall_s, 3),
        "peak_rss_bytes": int(kib) * 1024 if kib.isdigit() else None,
        "json": json.loads(child.stdout),
    }


def first_byte(args: list[str], model: str | None, threads: int, warm: bool = False) -> float:
    """Seconds from starting ``sekv ARGS`` (plain text, as at a shell) to the first byte it
    writes on stdout: interpreter start-up, imports, model and store loads and the first
    token, as a person waits for them. The rest of its output is read and dropped. ``warm``:
    through the `sekv` executable's own entry, which hands the command to a warm process
    where `sekv warm` started one."""
    args = [*args, "--threads", str(threads), *(["--model", model] if model else [])]
    entry = ["-m", "sekv_cli"] if warm else ["-c", CHILD, os.devnull]
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, *entry, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "SEKV_WARM": "1"},  # the warm process takes it where one runs
    )
    assert child.stdout is not None
    first = child.stdout.read(1)
    after = time.perf_counter() - start
    _, err = child.communicate()
    if child.returncode != 0 or not first:
        raise SekvError(f"`sekv {' '.join(args)}` failed: {err.decode(errors='replace')[-500:]}")
    return round(after, 3)


@contextmanager
def warm_process() -> Iterator[Callable[[], int]]:
    """`sekv warm` for the current ``$SEKV_HOME`` for the duration (`sekv warm --stop` after);
    yields a function that counts the commands it has run."""
    env = {**os.environ, "SEKV_WARM": "1"}

    def sekv_warm(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "sekv_cli", "warm", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env)

    started = sekv_warm("--idle", "10")
    if started.returncode != 0:
        raise SekvError(f"`sekv warm` failed: {started.stderr[-500:]}")

    def served() -> int:
        state = json.loads(sekv_warm("--status", "--json").stdout or "{}").get("warm")
        return state["served"] if state else 0

    try:
        yield served
    finally:
        sekv_warm("--stop")


def process_runs(
    path: Path, question: str, tokens: int, model: str | None, threads: int
) -> dict[str, Any]:
    """`sekv ingest` (a fresh store build), then `sekv ask` on the cached store and with
    ``--method full``, each a child process in its own empty ``$SEKV_HOME``; then each ask
    again as plain text, timed to its first byte on stdout (:func:`first_byte`).

    Full KV's ask stands for its prefill's peak RSS (decoding ``tokens`` more adds little).
    Answers are not teacher-forced here: each stops at its own end, ``tokens_generated`` says
    how long it was.
    """
    with tempfile.TemporaryDirectory() as tmp, fresh_home(Path(tmp)):
        build = sekv_command(["ingest", str(path)], model, threads)
        ask = ["ask", str(path), question, "--max-new-tokens", str(tokens)]
        sekv = sekv_command(ask, model, threads)
        full = sekv_command([*ask, "--method", "full"], model, threads)
        sekv["first_byte_s"] = first_byte(ask, model, threads)
        full["first_byte_s"] = first_byte([*ask, "--method", "full"], model, threads)
        with warm_process() as served:
            sekv["first_byte_warm_s"] = first_byte(ask, model, threads, warm=True)
            full["first_byte_warm_s"] = first_byte([*ask, "--method", "full"], model, threads, True)
            if served() != 2:
                raise SekvError("the warm process did not run the two timed commands")
    return {
        "build": {
            "wall_s": build["wall_s"],
            "peak_rss_bytes": build["peak_rss_bytes"],
            "cache_hit": build["json"]["store"]["cache_hit"],
        },
        "ask_sekv": answer_run(sekv),
        "ask_full": answer_run(full),
    }


def answer_run(run: dict[str, Any]) -> dict[str, Any]:
    """What a child `sekv ask --json` run reports: wall, peak RSS, tokens, its first token's
    time after the process started (interpreter start-up, imports, model and store loads
    included), its own timings."""
    data = run["json"]
    return {
        "wall_s": run["wall_s"],
        "first_token_after_start_s": data["timings"].get("first_token_after_start_s"),
        "first_byte_s": run.get("first_byte_s"),
        "first_byte_warm_s": run.get("first_byte_warm_s"),
        "peak_rss_bytes": run["peak_rss_bytes"],
        "tokens_generated": data["tokens_generated"],
        "cache_hit": data["store"].get("cache_hit"),
        "timings": data["timings"],
    }
