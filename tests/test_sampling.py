"""Generation controls: greedy by default, seeded sampling, repetition penalty, stop strings."""

import pytest
import torch
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core.decode import TextStream
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


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(repetition_penalty=0)]
)
def test_bad_settings_are_errors(bad):
    with pytest.raises(SekvError):
        Sampling(**bad)


def ask(tmp_path, model, *extra):
    doc = tmp_path / "d.md"
    doc.write_text(DOC)
    args = ["ask", str(doc), "Which shelf holds 9 jars?", "--model", str(model), "--no-sources"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "12", *map(str, extra)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_cli_generation_controls(tmp_path, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    greedy = ask(tmp_path, model)
    assert ask(tmp_path, model) == greedy  # the default is greedy: reproducible
    sampled = [ask(tmp_path, model, "--temperature", 1.2, "--seed", 5) for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert ask(tmp_path, model, "--repetition-penalty", 1.3)  # answers
    assert len(greedy) > 3, greedy
    cut = greedy[2:4]
    stopped = ask(tmp_path, model, "--stop", cut)
    assert greedy.startswith(stopped) and cut not in stopped
    result = runner.invoke(app, ["ask", str(tmp_path / "d.md"), "Q?", "--top-p", "2"])
    assert result.exit_code == 2  # a usage error, before anything loads
