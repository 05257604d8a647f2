"""`sekv chat` keeps the conversation: earlier turns in the next prompt, /reset, the oldest
turns dropped (said once) when the window fills; `--method` is a choice of the user's methods,
the benchmark baselines are not among them (tiny random models)."""

import os
import re

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.method_names import BENCH_METHODS, USER_METHODS
from sekv_core.methods import METHODS
from sekv_core.prompt import chat_template, encode_context, encode_question

runner = CliRunner()
FILLER = " ".join(f"Shelf {i} holds {i * 3} jars." for i in range(40))
TURN = "<|im_end|>\n<|im_start|>user\n"  # the tiny models' template between two turns


@pytest.fixture
def prompts(monkeypatch) -> dict[str, list]:
    """Records each answer's question part (the ids full KV reads) and each answer."""
    seen = {"ids": [], "answers": []}
    full, answer_from = METHODS["full"].generate, Session.answer

    def generate(self, question_ids, max_new_tokens, sampling=None, forcing=None):
        seen["ids"].append(list(question_ids))
        yield from full(self, question_ids, max_new_tokens, sampling, forcing)

    def recorded_answer(self, question, options):
        answer = answer_from(self, question, options)
        seen["answers"].append(answer.answer)
        return answer

    monkeypatch.setattr(METHODS["full"], "generate", generate)
    monkeypatch.setattr(Session, "answer", recorded_answer)
    return seen


def flat(output: str) -> str:
    """Terminal text on one line, without the error panel's frame."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


def chat(model_dir, doc, stdin: str, *options: str):
    args = ["chat", str(doc), "--model", str(model_dir), "--method", "full", *options]
    return runner.invoke(app, args, input=stdin)


def test_the_second_prompt_holds_the_first_turn(tmp_path, tiny_model_dirs, prompts):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    first, second = "Which shelf holds 9 jars?", "And how many does the next one hold?"
    result = chat(tiny_model_dirs["llama"], doc, f"{first}\n{second}\n", "--max-new-tokens", "6")
    assert result.exit_code == 0, result.output
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tpl = chat_template(tok)
    one, two = prompts["ids"]
    assert one == encode_question(tok, tpl, first)  # the first question is read alone
    answer = prompts["answers"][0]
    assert tok.decode(two) == tok.decode(one) + f"{answer}{TURN}{second}{tpl.tail}"
    assert "no longer fit" not in result.stderr


def test_reset_forgets_the_conversation(tmp_path, tiny_model_dirs, prompts):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    stdin = "Which shelf holds 9 jars?\n/help\n/reset\nAnd the next one?\n"
    result = chat(tiny_model_dirs["qwen2"], doc, stdin, "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "/reset" in result.stderr  # in /help
    assert "conversation cleared" in result.stderr
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    assert prompts["ids"][1] == encode_question(tok, chat_template(tok), "And the next one?")


def test_oldest_turns_drop_said_once(tmp_path, tiny_model_dirs, prompts):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tpl = chat_template(tok)
    room = 2048 - len(encode_context(tok, tpl, load_document(doc).text))  # full KV's window
    question = "Which shelf holds 9 jars?"
    reserve = room - len(encode_question(tok, tpl, question))  # no room for an earlier turn
    stdin = f"{question}\n{question}\n{question}\n"
    result = chat(tiny_model_dirs["llama"], doc, stdin, "--max-new-tokens", str(reserve))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("earlier turns no longer fit the window") == 1
    assert all(ids == prompts["ids"][0] for ids in prompts["ids"])  # each read alone


@pytest.mark.parametrize("command", [["ask", "{doc}", "q"], ["chat", "{doc}"]])
@pytest.mark.parametrize("method", ["bogus", *BENCH_METHODS])
def test_an_unknown_or_benchmark_method_is_a_usage_error_naming_the_choices(
    command, method, tmp_path
):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    args = [a.format(doc=doc) for a in command]
    result = runner.invoke(app, [*args, "--method", method], terminal_width=200)
    assert result.exit_code == 2
    assert f"'{method}' is not one of" in flat(result.output)
    assert all(f"'{name}'" in flat(result.output) for name in USER_METHODS)
    shown = runner.invoke(app, [command[0], "--help"], terminal_width=200)
    assert "sekv|full|retrieve" in shown.output
    assert not any(name in shown.output for name in BENCH_METHODS)


@pytest.mark.parametrize("command", [["ask", "{doc}", "q"], ["chat", "{doc}"]])
@pytest.mark.parametrize("method", ["full", "retrieve"])
def test_a_budget_with_a_method_that_does_not_zoom_is_a_usage_error(command, method, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    args = [a.format(doc=doc) for a in command]
    result = runner.invoke(app, [*args, "--method", method, "--budget", "8"])
    assert result.exit_code == 2, result.output
    assert f"--method sekv only; {method} does not zoom" in flat(result.output)


def test_retrieve_over_a_folder_names_each_source_file(tmp_path, tiny_model_dirs):
    """--method retrieve: the answer's sources are the passages it read that the answer drew
    on, each with its file; /sources shows them again."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.md").write_text("# Shelves\n\n" + FILLER)
    (folder / "b.md").write_text("The heron nests by the mill pond. " * 20)
    stdin = "Which shelf holds 9 jars?\n/sources\n"
    result = chat(tiny_model_dirs["llama"], folder, stdin, "--method", "retrieve")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("Sources\n") == 2 and "ask a question first" not in result.stderr
    cited = re.findall(r"^\[\d\] (\S+) p\. 1 ", result.stdout, re.M)
    assert cited and {os.path.basename(p) for p in cited} <= {"a.md", "b.md"}


def test_a_question_too_long_for_the_window_is_an_error_and_the_chat_goes_on(
    tmp_path, tiny_model_dirs, prompts
):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\n" + FILLER)
    too_long = "Which shelf holds " + " ".join(f"{i} jars" for i in range(2000)) + "?"
    result = chat(tiny_model_dirs["qwen2"], doc, f"{too_long}\nWhich shelf holds 9 jars?\n")
    assert result.exit_code == 0, result.output
    assert "Error: question too long" in result.stderr
    assert len(prompts["ids"]) == 1  # the next question is answered


def test_a_document_edited_during_the_chat_is_read_again_and_said(
    tmp_path, tiny_model_dirs, monkeypatch
):
    doc = tmp_path / "d.md"
    doc.write_text("# Notes\n\nThe code word is heron. " + FILLER)
    read: list[str] = []  # the text each answer read
    answer_from = Session.answer

    def edited_after_first(self, question, options):
        read.append(self.document.text)
        answer = answer_from(self, question, options)
        if len(read) == 1:  # the user edits the file while the chat is open
            stamp = doc.stat().st_mtime_ns + 10**9
            doc.write_text("# Notes\n\nThe code word is osprey. " + FILLER)
            os.utime(doc, ns=(stamp, stamp))
        return answer

    monkeypatch.setattr(Session, "answer", edited_after_first)
    stdin = "What is the code word?\n/reset\nWhat is the code word?\nAnd now?\n"
    result = chat(tiny_model_dirs["llama"], doc, stdin, "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("Warning: d.md changed on disk; reading it again") == 1
    assert ["heron" in text for text in read] == [True, False, False]
    assert all("osprey" in text for text in read[1:])
