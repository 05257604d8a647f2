"""A chat's memory: earlier questions and answers, read again before each new question.

The turns join the question part of the prompt (the local window after the document, see
:mod:`sekv_core.prompt`); the document's stored memory is untouched. When the question part and
the answer's reserve no longer fit the window, the oldest turns drop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .config import check_question
from .engine import MAX_NEW_TOKENS, Answer, AskOptions, Session
from .errors import ArgumentError
from .prompt import Turn

if TYPE_CHECKING:
    from .api import Library


class Conversation:
    """The turns of one chat over ``session``'s document (or a library's documents: each
    question goes where it routes), oldest first."""

    def __init__(self, session: Session | Library) -> None:
        self.session = session
        self.turns: list[Turn] = []
        self.dropped = 0  # turns the last question dropped to fit the window

    def ask(self, question: str, max_new_tokens: int = MAX_NEW_TOKENS, **options: Any) -> Answer:
        """Answer ``question`` (:meth:`answer`) under ``AskOptions(max_new_tokens, **options)``."""
        return self.answer(question, AskOptions(max_new_tokens, **options))

    def answer(self, question: str, options: AskOptions) -> Answer:
        """Answer ``question`` as ``options`` say after the earlier turns that fit (they are
        its ``history``), then remember it with its answer."""
        check_question(question)  # before the window is measured for it
        if options.history:
            raise ArgumentError("history: a Conversation reads its own turns; pass none")
        kept = self.fitting(question, options.max_new_tokens)
        self.dropped = len(self.turns) - len(kept)
        self.turns = kept
        answer = self.session.answer(question, replace(options, history=tuple(kept)))
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
