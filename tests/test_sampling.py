"""Generation controls: greedy by default, seeded sampling, repetition penalty, stop strings;
sampling and forcing reach decoding as arguments (no hidden state)."""

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core.decode import Forcing, TextStream, decode_tokens
from sekv_core.errors import SekvError
from sekv_core.sampling import Chooser, Sampling

runner = CliRunner()
DOC = "# Notes\n\n" + " ".join(f"Shelf {i} holds {i * 3} jars." for i in range(40))


class Chars:
    """A tokenizer whose tokens are characters (id = code point)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def stream_text(text: str, stop=()) -> tuple[list[str], TextStream]:
    stream, deltas = TextStream(Chars(), stop), []
    for ch in text:
        deltas.append(stream.push(ord(ch)))
        if stream.stopped:
            break
    deltas.append(stream.flush())
    return deltas, stream


def test_stop_strings_end_the_answer_before_them_and_hold_back_what_may_start_one():
    deltas, stream = stream_text("The code is 7781.\nQuestion: next", stop=["\nQuestion:"])
    assert stream.stopped and stream.text == "The code is 7781."
    assert "".join(deltas) == stream.text  # nothing of the stop string was shown
    deltas, stream = stream_text("a\nb", stop=["\nQuestion:"])
    assert not stream.stopped and "".join(deltas) == "a\nb"  # "\n" released at the end
    assert deltas[1] == ""  # held back while it might begin the stop string


def test_an_answer_ends_where_it_starts_repeating_a_sentence():
    text = "The budget was set at 100 crowns. The budget was set at 100 crowns. The budget"
    deltas, stream = stream_text(text)
    assert stream.stopped and stream.text == "The budget was set at 100 crowns."
    assert "".join(deltas) == stream.text  # nothing of the repeat was shown
    # a sentence that only begins like an earlier one is released once it differs
    text = "The code is 7781. The code is 7782. Done."
    deltas, stream = stream_text(text)
    assert not stream.stopped and "".join(deltas) == text
    assert deltas[text.index(" The code is 7782") + 10] == ""  # held while it could repeat
    # a repeat that the answer's end completes is dropped too; allowed on request
    deltas, stream = stream_text("Yes, the vault. Yes, the vault.")
    assert "".join(deltas) == "Yes, the vault."
    stream = TextStream(Chars(), allow_repeats=True)
    shown = "".join(stream.push(ord(ch)) for ch in "A b. A b. A b.") + stream.flush()
    assert shown == "A b. A b. A b." and not stream.stopped
    # line ends end sentences; one-word lines may repeat
    deltas, stream = stream_text("## Part 1.2\nNo.\nNo.\n## Part 1.2\nmore")
    assert stream.text == "## Part 1.2\nNo.\nNo."


class Pieces:
    """A tokenizer over a list of text pieces (id = index)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def ids(self, *pieces: str) -> list[int]:
        for piece in pieces:
            if piece not in self.pieces:
                self.pieces.append(piece)
        return [self.pieces.index(piece) for piece in pieces]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def stream_tokens(tokenizer: Pieces, ids: list[int]) -> tuple[list[str], TextStream]:
    stream, deltas = TextStream(tokenizer), []
    for token in ids:
        deltas.append(stream.push(token))
        if stream.stopped:
            break
    deltas.append(stream.flush())
    return deltas, stream


def test_a_token_loop_inside_a_sentence_ends_the_answer_after_its_first_unit():
    tok = Pieces()
    head = tok.ids("The", " keeper", " is", " 18", "-year", "-old", ",")
    unit = tok.ids(" a", " 1", "9", "-year", "-old", ",")
    deltas, stream = stream_tokens(tok, head + unit * 21)  # 133 tokens, as greedy decoding did
    assert stream.stopped and len(stream.ids) < 60
    assert stream.text == "The keeper is 18-year-old, a 19-year-old,"
    assert "".join(deltas) == stream.text  # the copies after the first were never shown
    breaker = tok.ids("BRE", "AKER", "-")
    deltas, stream = stream_tokens(tok, tok.ids("Shout") + breaker * 40)
    assert stream.stopped and stream.text in ("ShoutBREAKER-", "ShoutBREAKER-BREAKER")
    assert "".join(deltas) == stream.text


def test_a_repetition_short_of_a_loop_is_shown_whole():
    tok = Pieces()
    word = tok.ids(" BRE", "AKER", "-")
    ids = tok.ids("The", " code", " is") + word * 8 + tok.ids(" and", " that", " is", " all", ".")
    deltas, stream = stream_tokens(tok, ids)
    assert not stream.stopped and "".join(deltas) == tok.decode(ids)
    assert deltas[3 + 6] == ""  # held back while the copies could become a loop
    stream = TextStream(tok, allow_repeats=True)  # the benchmarks' forced answers
    assert "".join(stream.push(t) for t in word * 20) == tok.decode(word * 20)


def test_greedy_is_the_arg_max_and_the_penalty_demotes_used_tokens():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    assert Chooser(Sampling(repetition_penalty=1.0))(logits, [1]) == 1
    assert Chooser(Sampling(repetition_penalty=1.5))(logits, [1]) == 2  # 1 was used
    assert Sampling().plain and not Sampling(repetition_penalty=1.1).plain


def test_seeded_sampling_repeats_and_top_p_keeps_the_likeliest():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    draws = [Chooser(Sampling(temperature=1.5, seed=7)) for _ in range(2)]
    a = [draws[0](logits, []) for _ in range(20)]
    b = [draws[1](logits, []) for _ in range(20)]
    assert a == b and len(set(a)) > 1  # the same seed, the same draws; and they vary
    top = Chooser(Sampling(temperature=1.0, top_p=0.01, seed=1))
    assert {top(logits, []) for _ in range(10)} == {int(logits.argmax())}


def test_a_temperature_too_small_to_divide_by_is_greedy():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0], [40.0, -35.0, 39.0, 0.0]])
    for tiny in (1e-38, 1e-12, 5e-5):
        for row in logits:
            chosen = Chooser(Sampling(temperature=tiny, top_p=0.9, seed=1))(row[None], [])
            assert chosen == int(row.argmax()), tiny
    assert Sampling(temperature=1e-38).plain and not Sampling(temperature=1e-3).plain


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_p=float("nan")),
        dict(repetition_penalty=0),
        dict(repetition_penalty=float("inf")),
    ],
)
def test_bad_settings_are_errors(bad):
    with pytest.raises(SekvError):
        Sampling(**bad)


class Steps:
    """A step function over fixed logits: token ``t`` is followed by ``(t + 1) % V`` mostly."""

    def __init__(self, vocab: int = 16) -> None:
        self.vocab, self.fed = vocab, []

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.fed.append(ids[0].tolist())
        logits = torch.zeros(1, self.vocab)
        logits[0, (int(ids[0, -1]) + 1) % self.vocab] = 3.0
        return logits


def test_decode_tokens_takes_sampling_and_forcing_as_arguments():
    greedy = list(decode_tokens(Steps(), [0], set(), 6))
    assert greedy == [1, 2, 3, 4, 5, 6]  # no sampling: the arg-max
    draws = [list(decode_tokens(Steps(), [0], set(), 30, Sampling(5.0, seed=3))) for _ in "ab"]
    assert draws[0] == draws[1] != greedy[:30]  # seeded draws, away from the arg-max
    forcing = Forcing([9, 9, 2])
    steps = Steps()
    assert list(decode_tokens(steps, [0], {9}, 8, Sampling(5.0), forcing)) == [9, 9, 2]
    assert steps.fed == [[0], [9], [9]]  # fed as given (a stop token included), not drawn
    assert len(forcing.logprobs) == 3 and forcing.logprobs[0].shape == (16,)
    record = Forcing()  # no tokens: the method's own choices, recorded
    assert list(decode_tokens(Steps(), [0], {3}, 8, forcing=record)) == [1, 2]
    assert len(record.logprobs) == 3  # the stop token's step too


def test_no_context_variables_or_module_state_in_the_engine():
    """Sampling, forcing and shared prefills are passed as arguments, never kept on the side."""
    root = Path(__file__).resolve().parents[1] / "sekv_core"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "contextvars" not in text and "ContextVar" not in text, path
        tree = ast.parse(text)
        for node in tree.body:  # module-level mutable dicts named like a cache
            if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                assert not any("last" in n or "cache" in n.lower() for n in names), (path, names)


def test_session_passes_sampling_to_the_method(tiny_loaded, tmp_path):
    """Session.ask hands its sampling and forcing to the method's generate."""
    from sekv_core.documents import load_document
    from sekv_core.engine import Session

    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    session = Session(tiny_loaded, load_document(doc), "full")
    seen = []
    generate = session.method.generate

    def spy(question_ids, max_new_tokens, sampling=None, forcing=None):
        seen.append((sampling, forcing))
        return generate(question_ids, max_new_tokens, sampling, forcing)

    session.method.generate = spy
    chosen, forcing = Sampling(1.0, seed=1), Forcing([5, 6])
    session.ask("Which shelf?", 4, sampling=chosen)
    session.ask("Which shelf?", 4, forcing=forcing)
    assert seen == [(chosen, None), (None, forcing)] and len(forcing.logprobs) == 2


def ask(tmp_path, model, *extra):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    args = ["ask", str(doc), "Which shelf holds 9 jars?", "--model", str(model), "--json"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", *map(str, extra)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["answer"]


def test_cli_generation_controls(tmp_path, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    greedy = ask(tmp_path, model)
    assert ask(tmp_path, model) == greedy  # the default is greedy: reproducible
    sampled = [ask(tmp_path, model, "--temperature", 1.2, "--seed", 5) for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert ask(tmp_path, model, "--temperature", "1e-38") == greedy  # too small: greedy


@pytest.mark.parametrize(
    "options, says",
    [
        (["--top-p", "2"], "not in (0, 1]"),
        (["--temperature", "inf"], "not a finite number"),
        (["--temperature", "nan"], "not a finite number"),
        (["--temperature", "-1"], "negative"),
        (["--temperature", "1", "--top-p", "nan"], "not a finite number"),
        (["--seed", "3"], "--seed: it applies to sampling only"),
        (["--top-p", "0.9"], "--top-p: it applies to sampling only"),
        (["--temperature", "0", "--seed", "3"], "add --temperature above 0"),
    ],
)
def test_sampling_options_without_sense_are_usage_errors(tmp_path, options, says):
    """Exit 2 and why, before anything loads (no model named: none is needed to refuse)."""
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    for command in (["ask", str(doc), "Q?"], ["chat", str(doc)]):
        result = runner.invoke(app, [*command, *options], terminal_width=200)
        assert result.exit_code == 2, result.output
        assert says in " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split()), result.output
