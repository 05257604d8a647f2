"""A chat's memory: earlier questions and answers, read again before each new question.

The turns join the question part of the prompt (the local window after the document, see
:mod:`sekv_core.prompt`); the document's stored memory is untouched. When the question part and
the answer's reserve no longer fit the window, the oldest turns drop. No torch here: the CLI
holds one from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .config import check_int, check_question
from .prompt import Turn

if TYPE_CHECKING:
    from .api import Library
    from .engine import Answer, Session
    from .sampling import Sampling


class Conversation:
    """The turns of one chat over ``session``'s document (or a library's documents: each
    question goes where it routes), oldest first."""

    def __init__(self, session: Session | Library) -> None:
        self.session = session
        self.turns: list[Turn] = []
        self.dropped = 0  # turns the last question dropped to fit the window

    def ask(
        self,
        question: str,
        max_new_tokens: int = 128,
        on_text: Callable[[str], None] | None = None,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        allow_repeats: bool = False,
    ) -> Answer:
        """Answer ``question`` after the earlier turns that fit (see :meth:`Session.ask`), then
        remember it with its answer."""
        check_question(question)  # before the window is measured for it
        check_int("max_new_tokens", max_new_tokens, 1)
        kept = self.fitting(question, max_new_tokens)
        self.dropped = len(self.turns) - len(kept)
        self.turns = kept
        answer = self.session.ask(
            question, max_new_tokens, on_text, sampling, stop, kept, allow_repeats
        )
        self.turns.append((question.strip(), answer.answer))
        return answer

    def fitting(self, question: str, max_new_tokens: int) -> list[Turn]:
        """The newest turns whose question part, with ``question`` and ``max_new_tokens`` of
        answer, fits the window (none, if even the question alone does not)."""
        room, turns = self.session.room(question), list(self.turns)
        while turns and len(self.session.question_ids(question, turns)) + max_new_tokens > room:
            turns.pop(0)
        return turns

    def reset(self) -> None:
        """Forget every turn: the next question is read alone."""
        self.turns, self.dropped = [], 0
