"""`sekv chat`: a REPL over a document's cached store (model and store loaded once) that keeps
the conversation: earlier questions and answers are read again before each new question."""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from pathlib import Path

from rich.text import Text

from sekv_core.errors import SekvError
from sekv_core.paths import sekv_home
from sekv_core.threads import resolve_threads

from .errors import handle_errors, warn
from .loading import open_library
from .options import (
    BUDGET_OPTION,
    MAX_NEW_TOKENS_OPTION,
    MAX_TOKENS_OPTION,
    METHOD_OPTION,
    MODEL_OPTION,
    PATHS_ARGUMENT,
    SEED_OPTION,
    TEMPERATURE_OPTION,
    THREADS_OPTION,
    TOP_P_OPTION,
    MethodName,
    answer_settings,
    sampling,
)
from .output import stream_text
from .render import print_sources, print_zoom
from .terminal import err, one_line, printable
from .words import how_many

HELP = """Earlier questions and answers are read again before each new question;
the oldest drop when they no longer fit the model's window.
Commands:
  /reset      forget the conversation: the next question is read alone
  /sources    the last answer's sources again
  /zoom       toggle why each source was zoomed, after each answer
  /budget N   tokens reconstructed per layer and KV head (sekv)
  /help       this help
  /quit       leave (Ctrl-D too)"""


@handle_errors
def chat(
    paths: list[Path] = PATHS_ARGUMENT,
    model: str | None = MODEL_OPTION,
    method: MethodName = METHOD_OPTION,
    budget: int | None = BUDGET_OPTION,
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    temperature: float = TEMPERATURE_OPTION,
    top_p: float = TOP_P_OPTION,
    seed: int | None = SEED_OPTION,
    max_tokens: int = MAX_TOKENS_OPTION,
    threads: int | None = THREADS_OPTION,
) -> None:
    """Ask many questions about the documents at PATH...; each is answered from the stored
    memory, no re-reading, after the conversation so far (/reset forgets it)."""
    settings = answer_settings(method, budget, temperature, top_p, seed)
    library, _ = open_library(
        paths, model, method, settings, resolve_threads(threads), max_tokens=max_tokens
    )
    from sekv_core.api import AskOptions  # torch: the library has loaded it
    from sekv_core.conversation import Conversation

    conversation = Conversation(library)
    options = AskOptions(max_new_tokens, stream_text, sampling(temperature, top_p, seed))
    told_dropping = False  # said once per chat
    interactive = sys.stdin.isatty()
    if interactive:
        keep_history()
    show_zoom = False
    last = None  # the last answer
    rows = library.documents()
    alone = len(rows) == 1
    name = one_line(Path(rows[0]["path"]).name) if alone else how_many(len(rows), "document")
    size = (
        how_many(rows[0]["tokens"], "token")
        if len(rows) == 1 and rows[0]["tokens"] is not None
        else how_many(sum(r["words"] or 0 for r in rows), "word")
    )
    err.print(
        Text(name, style="bold")
        + Text(f": {size}, method {method}. Ask a question; /help for commands.")
    )
    while True:
        try:
            line = input("> " if interactive else "").strip()
        except (EOFError, KeyboardInterrupt):
            err.print()
            return
        if not line:
            continue
        if not interactive:  # piped: the transcript shows what was asked
            sys.stdout.write(f"> {printable(line)}\n")
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd in ("/quit", "/exit"):
                return
            if cmd == "/help":
                err.print(Text(HELP))
            elif cmd == "/reset":
                conversation.reset()
                err.print("conversation cleared: the next question is read alone")
            elif cmd == "/sources":
                if last is not None and last.sources:
                    print_sources(last, library.collection)
                elif last is not None:
                    err.print("the last answer points to no passage of the documents")
                else:
                    err.print("no sources yet: ask a question first")
            elif cmd == "/zoom":
                show_zoom = not show_zoom
                err.print(f"zoom explanations {'on' if show_zoom else 'off'}")
            elif cmd == "/budget" and method != "sekv":
                err.print(f"/budget applies to --method sekv only; {method} does not zoom")
            elif cmd == "/budget" and arg.strip().isdigit() and int(arg) > 0:
                library.settings.budget = int(arg)  # every document's session reads it
                err.print(f"budget {how_many(int(arg), 'token')}")
            else:
                err.print(Text(f"unknown or malformed command {line!r}; /help lists them"))
            continue
        try:
            last = conversation.answer(line, options)
        except KeyboardInterrupt:
            err.print("\n(interrupted)")
            continue
        except SekvError as exc:  # this question cannot be answered; the chat goes on
            err.print(Text(f"Error: {exc}"), soft_wrap=True)
            continue
        sys.stdout.write("\n")
        if conversation.dropped and not told_dropping:
            told_dropping = True
            warn("earlier turns no longer fit the window; dropping the oldest (/reset clears)")
        print_sources(last, library.collection)
        if show_zoom:
            print_zoom(last)


HISTORY_LINES = 1000


def keep_history() -> Callable[[], None] | None:
    """Line editing for input(), with the questions of earlier chats kept in
    ``$SEKV_HOME/chat_history`` (readline; nothing where it is missing or the file is not
    writable). Returns the function that saves it, registered to run at exit."""
    try:
        import readline
    except ImportError:
        return None
    path = sekv_home() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # the first chat
    readline.set_history_length(HISTORY_LINES)

    def save() -> None:
        try:
            readline.write_history_file(path)
        except OSError:
            pass

    atexit.register(save)
    return save
