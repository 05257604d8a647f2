"""A warm sekv: a background process that has already imported torch, transformers and sekv —
what a cold command spends its first seconds on — and forks a child to run each `sekv` command.

``sekv warm`` starts one for the current ``$SEKV_HOME`` and code. From then on the `sekv`
executable (:mod:`.launch`) hands its command line, working directory, environment and its
three standard streams (the file descriptors themselves, passed over a Unix socket) to the warm
process, whose fresh child runs the command exactly as the executable would have: same output,
terminal and exit status; Ctrl-C and other signals to the executable are passed on to the
child. The warm process ends after ``idle`` seconds without a command, on ``sekv warm --stop``,
or when a command comes from other code (sekv upgraded or edited: that command, and every one
after, runs directly until ``sekv warm`` starts a fresh one).

Nothing is loaded but modules: each child still loads its model and store, so a warm process
holds no document and needs no locking beyond what a plain command takes.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sekv_core.errors import SekvError
from sekv_core.paths import home_path

ENV = "SEKV_WARM"  # "0": never hand a command to a warm process
IDLE_S = 30 * 60
START_S = 120.0  # what a start may take on a slow, shared machine (imports only)
HEADER = struct.Struct(">Q")  # a request's length, before its JSON
STREAMS = ("stdin", "stdout", "stderr")
# descriptors passed over Unix sockets and fork: POSIX (the peer's uid is checked on Linux)
SUPPORTED = hasattr(socket, "send_fds") and hasattr(os, "fork") and hasattr(socket, "AF_UNIX")


def socket_path() -> Path:
    """The warm process's socket for this ``$SEKV_HOME``: in a private per-user folder under
    the temporary directory (a Unix socket's path must stay short)."""
    home = os.path.abspath(home_path())
    digest = hashlib.sha256(home.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"sekv-{os.getuid()}" / f"warm-{digest}.sock"


def private_folder(path: Path) -> bool:
    """Whether ``path``'s folder exists, belongs to this user and no one else may enter it."""
    try:
        st = path.parent.lstat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0 and path.parent.is_dir()


def code_stamp() -> str:
    """This interpreter and sekv's source files (paths, sizes, modification times): a warm
    process serves only commands from the same code."""
    digest = hashlib.sha256(sys.executable.encode("utf-8", "surrogateescape"))
    for package in ("sekv_cli", "sekv_core"):
        root = Path(__file__).resolve().parent.parent / package
        for path in sorted(root.rglob("*.py")):
            st = path.stat()
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "replace"))
    return digest.hexdigest()[:24]


# --- the executable's side ------------------------------------------------------------------


def connect(path: Path) -> socket.socket | None:
    """A connection to the warm process at ``path``; None where none listens there."""
    if not private_folder(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def send(sock: socket.socket, request: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(request).encode("utf-8", "surrogateescape")
    socket.send_fds(sock, [HEADER.pack(len(body)) + body], fds or [])


def stream_settings() -> dict[str, Any] | None:
    """How this process's three standard streams encode text (a child writes as it would);
    None where one is missing or closed."""
    settings = {}
    for name in STREAMS:
        stream = getattr(sys, name)
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            return None
        settings[name] = {
            "encoding": stream.encoding,
            "errors": stream.errors,
            "line_buffering": stream.line_buffering,
        }
    return settings


def forward(argv: list[str]) -> int | None:
    """Run ``sekv ARGV`` in the warm process serving this home and code, and return its exit
    status; None where there is none (or ``SEKV_WARM=0``, or this is ``sekv warm`` itself, or
    it cannot take the command): the caller runs the command itself."""
    if os.environ.get(ENV, "").strip() == "0" or argv[:1] == ["warm"] or not SUPPORTED:
        return None
    path = socket_path()
    if not path.exists():
        return None
    settings = stream_settings()
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    if settings is None or (sock := connect(path)) is None:
        return None
    with sock:
        request = {"stamp": code_stamp(), "argv": argv, "cwd": cwd, "env": dict(os.environ)}
        try:
            send(sock, {**request, "streams": settings}, [0, 1, 2])
        except OSError:
            return None
        replies = sock.makefile("rb")
        first = replies.readline().split()
        if first[:1] != [b"pid"]:
            return None  # other code, or it is stopping: run here
        child = int(first[1])

        def pass_on(signum: int, _frame: object) -> None:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored here: ignored there
                signal.signal(signum, pass_on)
        last = replies.readline().split()
    if last[:1] != [b"exit"]:
        print(
            "Error: the warm sekv process ended before the command did; run `sekv warm --stop` "
            "and try again",
            file=sys.stderr,
        )
        return 1
    return int(last[1])


def ask_server(request: dict[str, Any]) -> list[str] | None:
    """One control request (``status``, ``stop``) to this home's warm process: its reply's
    words, or None where none runs."""
    if not SUPPORTED or (sock := connect(socket_path())) is None:
        return None
    with sock:
        try:
            send(sock, request)
            return sock.makefile("rb").readline().decode().split()
        except OSError:
            return None


def status() -> dict[str, Any] | None:
    """The warm process's state for this home and code (None: none runs, or it serves other
    code): when it started, commands served, seconds idle, its idle limit."""
    words = ask_server({"stamp": code_stamp(), "status": True})
    if not words or words[0] != "ok":
        return None
    started, served, idle, limit = (float(w) for w in words[1:5])
    return {"started": started, "served": int(served), "idle_s": idle, "idle_limit_s": limit}


def stop() -> bool:
    """End this home's warm process (commands it is running finish); whether one ran."""
    return ask_server({"stop": True}) is not None


def start(idle_s: float) -> dict[str, Any]:
    """Start a warm process for this home and code (one serving other code is stopped first)
    and wait until it takes commands; its :func:`status`."""
    if not SUPPORTED:
        raise SekvError("a warm process needs a POSIX system (Linux or macOS)")
    if (now := status()) is not None:
        return now
    stop()
    path = socket_path()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if not private_folder(path):
        raise SekvError(
            f"{path.parent} is not a private folder of this user; remove it, or set TMPDIR "
            "to a folder of your own"
        )
    log = path.with_suffix(".log")
    with open(log, "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "sekv_cli.launch", "--warm-process", str(idle_s)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            cwd="/",
            start_new_session=True,  # no terminal: Ctrl-C in this one does not end it
        )
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if (now := status()) is not None:
            return now
    tail = log.read_text(errors="replace")[-600:].strip()
    raise SekvError(f"the warm process did not start in {START_S:.0f} s (its log, {log}: {tail})")


# --- the warm process -----------------------------------------------------------------------


def preload() -> None:
    """Import what a command's first seconds go to (torch, transformers, the model families,
    the sentence embedder, sekv's engine). Imports only: no torch work runs before a fork."""
    import rich.console  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import typer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    import sekv_core.api  # noqa: F401
    import sekv_core.engine  # noqa: F401
    import sekv_core.index.embedder  # noqa: F401
    import sekv_core.methods.sekv  # noqa: F401
    import sekv_core.models  # noqa: F401

    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        pass


def serve(idle_s: float, run_app: Callable[[list[str]], int]) -> None:
    """Take commands on this home's socket until ``idle_s`` seconds pass without one and none
    runs, a stop request comes, or the socket is no longer this process's. Each command runs in
    a forked child as ``run_app(argv)``, which returns its exit status."""
    preload()
    stamp = code_stamp()
    path = socket_path()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    ours = path.stat().st_ino
    started = last = time.time()
    served = 0
    running: dict[int, socket.socket] = {}  # child pid: the executable waiting for it
    stopping = False
    try:
        while True:
            ready, _, _ = select.select([listener], [], [], 0.5)
            report_ended(running)
            if ready and not stopping:
                conn, _ = listener.accept()
                outcome = take(
                    conn, stamp, listener, running, (started, served, last, idle_s), run_app
                )
                if outcome == "command":
                    served += 1
                    last = time.time()
                stopping = outcome == "stop"
            idle = not running and time.time() - last > idle_s
            try:
                moved = path.stat().st_ino != ours
            except FileNotFoundError:
                moved = True
            if (stopping and not running) or idle or moved:
                break
    finally:
        listener.close()
        try:
            if path.stat().st_ino == ours:
                path.unlink()
        except FileNotFoundError:
            pass


def take(
    conn: socket.socket,
    stamp: str,
    listener: socket.socket,
    running: dict[int, socket.socket],
    state: tuple[float, int, float, float],
    run_app: Callable[[list[str]], int],
) -> str:
    """One connection: a command (forked), a status or stop request, or nothing usable.
    Returns "command", "stop" or ""."""
    fds: list[int] = []
    try:
        request, fds = receive(conn)
        if peer_uid(conn) not in (None, os.getuid()):
            conn.close()
            return ""
        if request.get("stop") or request.get("stamp") != stamp:
            conn.sendall(b"stopping\n")  # other code: the caller runs it; a fresh start is due
            conn.close()
            return "stop"
        if request.get("status"):
            started, served, last, idle_s = state
            conn.sendall(f"ok {started} {served} {time.time() - last} {idle_s}\n".encode())
            conn.close()
            return ""
        pid = os.fork()
        if pid == 0:
            for other in (listener, conn, *running.values()):
                other.close()
            run_command(request, fds, run_app)  # never returns
        conn.sendall(f"pid {pid}\n".encode())
        running[pid] = conn
        return "command"
    except (OSError, ValueError, KeyError):
        conn.close()
        return ""
    finally:
        for fd in fds:
            os.close(fd)


def peer_uid(conn: socket.socket) -> int | None:
    """The connecting process's user (Linux); None where the system does not say (the socket's
    folder is private to this user either way)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]


def receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request: its JSON and the file descriptors that came with it."""
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack(data[:8])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("request cut short")
        data += more
    conn.settimeout(None)
    (size,) = HEADER.unpack(data[: HEADER.size])
    return json.loads(
        data[HEADER.size : HEADER.size + size].decode("utf-8", "surrogateescape")
    ), fds


def report_ended(running: dict[int, socket.socket]) -> None:
    """Tell each executable whose child has ended its exit status (128 + N for signal N)."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        conn = running.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {128 - code if code < 0 else code}\n".encode())
            except OSError:
                pass
            conn.close()


def run_command(
    request: dict[str, Any], fds: list[int], run_app: Callable[[list[str]], int]
) -> None:
    """In the forked child: become the executable that asked (its streams, directory,
    environment, arguments), run the command, exit with its status."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name in enumerate(STREAMS):
            setattr(sys, name, reopen(fd, request["streams"][name]))
            setattr(sys, f"__{name}__", getattr(sys, name))
        sys.argv = ["sekv", *request["argv"]]
        code = run_app(request["argv"])
    except BaseException:  # noqa: BLE001 — the child must exit with a status, whatever happened
        traceback.print_exc()
    finally:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # done: a late Ctrl-C changes nothing
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def reopen(fd: int, settings: dict[str, Any]) -> io.TextIOWrapper:
    """A text stream over descriptor ``fd`` that encodes as the executable's did."""
    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffered,
        encoding=settings["encoding"],
        errors=settings["errors"],
        line_buffering=settings["line_buffering"],
        write_through=fd == 2,
    )
