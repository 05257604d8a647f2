"""Router files on disk: every damage is a clean error; ``auto`` skips a damaged file
with a warning and uses the next choice (real files, a tiny model, the CLI end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from sekv_cli.main import app
from sekv_core import router_files
from sekv_core.errors import SekvError
from sekv_core.router_files import RouterFileError, load_router, resolve_router, save_router
from sekv_core.zoom.zoomnet import NetShape, ZoomNet

runner = CliRunner()
DOC = " ".join(f"Shelf {i} holds {i * 3} jars." for i in range(40))


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    """The tiny llama (its fingerprint is what routers are matched by)."""
    from sekv_core.models import load_model

    return load_model(str(tiny_model_dirs["llama"]), device="cpu")


def shape_of(loaded) -> NetShape:
    spec = loaded.spec
    return NetShape(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, 3)


def write_router(path: Path, loaded, fingerprint: str | None = None) -> Path:
    """A valid router file for ``loaded`` (or claiming the model ``fingerprint``)."""
    model = {"id": "tiny", "fingerprint": fingerprint or loaded.fingerprint}
    manifest = {"model": model, "routing": {"span_tokens": [16, 64]}}
    save_router(path, ZoomNet(shape_of(loaded)), manifest, None)
    return path


def contents(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["manifest"])


def with_manifest(path: Path, edit) -> None:
    """Rewrite ``path`` with its manifest passed through ``edit`` (a dict -> any JSON value)."""
    tensors, manifest = contents(path)
    save_file(tensors, str(path), metadata={"manifest": json.dumps(edit(manifest))})


def with_tensors(path: Path, edit) -> None:
    """Rewrite ``path`` with its tensors passed through ``edit`` (dict -> dict), same manifest."""
    tensors, manifest = contents(path)
    save_file(edit(tensors), str(path), metadata={"manifest": json.dumps(manifest)})


def set_key(d: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    inner = d
    for key in parents:
        inner = inner[key]
    if value is DELETE:
        del inner[last]
    else:
        inner[last] = value
    return d


DELETE = object()


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def raw_metadata(path: Path, metadata: dict[str, str]) -> None:
    tensors, _ = contents(path)
    save_file(tensors, str(path), metadata=metadata)


# name -> (how to damage a valid router file in place, what the error says)
DAMAGES = {
    "manifest-list": (lambda p: with_manifest(p, lambda m: [m]), "manifest is a JSON list"),
    "manifest-not-json": (
        lambda p: raw_metadata(p, {"manifest": "{not json"}),
        "manifest is not JSON",
    ),
    "no-manifest": (lambda p: raw_metadata(p, {"other": "x"}), "holds no manifest"),
    "wrong-format": (
        lambda p: with_manifest(p, lambda m: set_key(m, "version", 2)),
        "v2 file, not a sekv-zoom-router v3",
    ),
    "no-shape": (
        lambda p: with_manifest(p, lambda m: set_key(m, "shape", DELETE)),
        "no shape object",
    ),
    "shape-field-missing": (
        lambda p: with_manifest(p, lambda m: set_key(m, "shape.num_heads", DELETE)),
        "shape lacks num_heads",
    ),
    "shape-field-unknown": (
        lambda p: with_manifest(p, lambda m: set_key(m, "shape.width", 3)),
        "unknown fields width",
    ),
    "shape-wrong-type": (
        lambda p: with_manifest(p, lambda m: set_key(m, "shape.num_layers", "2")),
        r"shape.num_layers is '2', not a positive integer",
    ),
    "shape-inconsistent": (
        lambda p: with_manifest(p, lambda m: set_key(m, "shape.num_kv_heads", 3)),
        "not a multiple of num_kv_heads",
    ),
    "model-not-object": (
        lambda p: with_manifest(p, lambda m: set_key(m, "model", "tiny")),
        "names no model fingerprint",
    ),
    "span-tokens-wrong-type": (
        lambda p: with_manifest(p, lambda m: set_key(m, "routing.span_tokens", 16)),
        r"routing.span_tokens is not \[min, max\]",
    ),
    "tensor-missing": (
        lambda p: with_tensors(p, lambda t: {k: v for k, v in t.items() if "threshold" not in k}),
        "lacks the tensors gate.threshold",
    ),
    "tensor-extra": (
        lambda p: with_tensors(p, lambda t: {**t, "gate.extra": torch.zeros(2)}),
        "unexpected tensors gate.extra",
    ),
    "tensor-mis-shaped": (
        lambda p: with_tensors(p, lambda t: {**t, "gate.threshold": torch.zeros(2, 3)}),
        r"tensor gate.threshold is \[2, 3\], its manifest's shape needs \[2, 4\]",
    ),
    "tensor-not-finite": (
        lambda p: with_tensors(p, lambda t: {**t, "gate.threshold": torch.full((2, 4), torch.nan)}),
        "non-finite",
    ),
    "shape-disagrees-with-tensors": (
        lambda p: with_manifest(p, lambda m: set_key(m, "shape.num_layers", 3)),
        r"gate.\w+ is \[2, .*needs \[3, ",
    ),
    "shape-huge": (  # refused before anything of that size is allocated
        lambda p: with_manifest(p, lambda m: set_key(m, "shape.num_layers", 10**12)),
        r"needs \[1000000000000, ",
    ),
    "not-safetensors": (
        lambda p: p.write_bytes(b"PK\x03\x04 this is a zip, not a router" * 40),
        "not a readable safetensors file",
    ),
    "empty-file": (lambda p: p.write_bytes(b""), "not a readable safetensors file"),
    "truncated-half": (lambda p: truncate(p, 0.5), "not a readable safetensors file"),
    "truncated-end": (lambda p: truncate(p, 0.98), "not a readable safetensors file"),
}


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, tmp_path, tiny) -> tuple[Path, str]:
    """A router file for the tiny model, damaged one way; and what its error says."""
    damage, says = DAMAGES[request.param]
    path = write_router(tmp_path / f"{request.param}.safetensors", tiny)
    damage(path)
    return path, says


def test_every_damage_is_one_clean_error(damaged, tiny):
    path, says = damaged
    with pytest.raises(RouterFileError, match=says) as info:
        load_router(path, tiny.fingerprint, tiny.model_id)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "sekv train" in message
    # an explicitly named file is refused the same way (the CLI's exit 1)
    with pytest.raises(RouterFileError, match=says):
        resolve_router(str(path), tiny.fingerprint, tiny.model_id)


def test_a_valid_file_still_loads(tmp_path, tiny):
    path = write_router(tmp_path / "ok.safetensors", tiny)
    assert load_router(path, tiny.fingerprint).net.shape == shape_of(tiny)


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_no_router_file_names_the_choices(tmp_path, tiny, make):
    path = tmp_path / "r.safetensors"
    if make == "directory":
        path.mkdir()
    with pytest.raises(SekvError, match="no router file at .*pass auto or a file"):
        resolve_router(str(path), tiny.fingerprint)


def test_auto_skips_a_damaged_user_router_and_names_the_next_choice(damaged, tiny, sekv_home):
    path, _ = damaged
    user = sekv_home / "routers" / path.name
    user.parent.mkdir(parents=True)
    path.replace(user)
    warnings: list[str] = []
    assert resolve_router("auto", tiny.fingerprint, tiny.model_id, warnings.append) is None
    assert len(warnings) == 1, warnings
    assert f"skipping the router file {user}" in warnings[0]
    assert "using the training-free router instead" in warnings[0]


def test_auto_falls_through_to_the_next_router_for_the_model(tmp_path, tiny, sekv_home):
    routers = sekv_home / "routers"
    broken = write_router(routers / "a-broken.safetensors", tiny)
    with_tensors(broken, lambda t: {})
    good = write_router(routers / "b-good.safetensors", tiny)
    warnings: list[str] = []
    router = resolve_router("auto", tiny.fingerprint, tiny.model_id, warnings.append)
    assert router is not None and router.manifest["model"]["fingerprint"] == tiny.fingerprint
    assert len(warnings) == 1 and str(broken) in warnings[0]
    assert f"using the router {good} instead" in warnings[0]


def test_auto_passes_over_other_models_routers_silently(tmp_path, tiny, sekv_home):
    other = write_router(sekv_home / "routers" / "other.safetensors", tiny, "f" * 32)
    with_tensors(other, lambda t: {})  # damaged too: not this model's, not this model's concern
    warnings: list[str] = []
    assert resolve_router("auto", tiny.fingerprint, tiny.model_id, warnings.append) is None
    assert warnings == []


def test_auto_skips_a_damaged_shipped_router(tmp_path, tiny, monkeypatch):
    shipped = tmp_path / "shipped"
    path = write_router(shipped / "tiny.safetensors", tiny)
    truncate(path, 0.5)
    monkeypatch.setattr(router_files, "SHIPPED", shipped)
    warnings: list[str] = []
    assert resolve_router("auto", tiny.fingerprint, tiny.model_id, warnings.append) is None
    assert len(warnings) == 1 and str(path) in warnings[0] and "reinstall sekv" in warnings[0]


def test_auto_without_a_warn_callback_still_skips(tmp_path, tiny, sekv_home):
    path = write_router(sekv_home / "routers" / "x.safetensors", tiny)
    with_manifest(path, lambda m: [m])
    assert resolve_router("auto", tiny.fingerprint, tiny.model_id) is None


# --- the CLI end to end ---------------------------------------------------------------------


def ask(tmp_path, model: Path, *extra: str):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    args = ["ask", str(doc), "Which shelf holds 9 jars?", "--model", str(model)]
    return runner.invoke(app, [*args, "--max-new-tokens", "2", *extra])


@pytest.mark.parametrize("damage", ["manifest-list", "tensor-mis-shaped", "truncated-half"])
def test_ask_warns_about_a_damaged_user_router_and_answers(
    damage, tmp_path, tiny, tiny_model_dirs, sekv_home
):
    path = write_router(sekv_home / "routers" / f"{damage}.safetensors", tiny)
    DAMAGES[damage][0](path)
    result = ask(tmp_path, tiny_model_dirs["llama"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and result.stdout.strip()
    warning = " ".join(result.stderr.split())  # Rich wraps long lines
    assert "Warning: skipping the router file" in warning and f"{damage}.safetensors" in warning
    assert "using the training-free router instead" in warning


def test_chat_warns_about_a_damaged_user_router(tmp_path, tiny, tiny_model_dirs, sekv_home):
    path = write_router(sekv_home / "routers" / "broken.safetensors", tiny)
    DAMAGES["tensor-missing"][0](path)
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    args = ["chat", str(doc), "--model", str(tiny_model_dirs["llama"])]
    result = runner.invoke(app, args, input="")
    assert result.exit_code == 0, result.output
    assert "broken.safetensors" in result.stderr and "Traceback" not in result.output


def test_a_benchmark_with_a_damaged_router_file_fails_cleanly(tmp_path, tiny, tiny_model_dirs):
    """A router file is named in `sekv bench` only (`sekv ask` finds the model's own)."""
    path = write_router(tmp_path / "mine.safetensors", tiny)
    DAMAGES["manifest-list"][0](path)
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    doc.with_suffix(".qa.json").write_text('[{"question": "Which shelf?", "answer": "9"}]')
    args = ["bench", "qa", str(doc), "--methods", "sekv", "--set", f"router={path}"]
    result = runner.invoke(app, [*args, "--model", str(tiny_model_dirs["llama"])])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: the router file "), result.stderr
    assert "manifest is a JSON list" in lines[0] and result.stdout == ""


def test_saving_to_a_link_writes_the_file_it_points_at(tmp_path, tiny):
    """A router file (and its optimizer state) reached by a symbolic link is replaced where
    the link points, whole; the links stay links, to the new files."""
    kept = tmp_path / "kept"
    kept.mkdir()
    target, state = kept / "router.safetensors", kept / "router.safetensors.state"
    write_router(target, tiny)
    save_file({"x": torch.zeros(1)}, str(state))
    link = tmp_path / "router.safetensors"
    link.symlink_to("kept/router.safetensors")  # relative, as a user links
    (tmp_path / "router.safetensors.state").symlink_to(state)
    net = ZoomNet(shape_of(tiny))
    manifest = {"model": {"id": "tiny", "fingerprint": tiny.fingerprint}, "step": 7}
    save_router(link, net, manifest, {"y": torch.ones(2)})
    assert link.is_symlink() and link.resolve() == target
    assert (tmp_path / "router.safetensors.state").is_symlink()
    assert contents(target)[1]["step"] == 7 and load_router(link).manifest["step"] == 7
    assert list(contents(state)[0]) == ["y"]
    assert sorted(p.name for p in kept.iterdir()) == [target.name, state.name]  # no temporary
