"""Router files: a trained zoom router (:mod:`sekv_core.zoom.zoomnet`) on disk, and which one an
answer uses.

Weights live in one safetensors file whose metadata holds a JSON manifest (format, shape, model
fingerprint, settings, metrics); the optimizer state for resuming sits beside it
(``<file>.state``). Every way a file can be unusable is one :class:`RouterFileError`; ``auto``
skips a damaged one with a warning and uses the next choice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import SekvError, one_line
from .paths import sekv_home
from .zoom.zoomnet import NetShape, ZoomNet

FORMAT = "sekv-zoom-router"
FORMAT_VERSION = 3  # 3: features read from the sketch alone (span mass estimate, mean key)


@dataclass
class RouterFile:
    """A trained router on disk: weights + manifest (+ optimizer state beside it), and the file
    it was read from."""

    net: ZoomNet
    manifest: dict[str, Any]
    path: Path


def save_router(path: Path, net: ZoomNet, manifest: dict[str, Any], optim: dict | None) -> None:
    """Write weights (atomically) and, when given, the optimizer state to ``<path>.state``;
    where either is a symbolic link, the file it points at is written and the link stays."""
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "shape": asdict(net.shape),
        **manifest,
    }
    metadata = {"manifest": json.dumps(meta)}
    tensors = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    if optim is not None:
        _save_through(path.with_name(path.name + ".state"), optim, metadata)
    _save_through(path, tensors, metadata)


def _save_through(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Save ``tensors`` as the file ``path`` names, whole or not at all (a temporary sibling,
    then a rename): where ``path`` is a symbolic link, as the file it points at."""
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(target)


class RouterFileError(SekvError):
    """A router file that cannot be used: ``problem`` says why (it reads after the path)."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(
            f"the router file {path} {problem}; delete it and train a new one with `sekv train`"
        )


def raw_manifest(path: Path) -> Any:
    """The parsed JSON manifest in a router file's metadata, unchecked."""
    if not path.is_file():
        what = "is a directory, not a router file" if path.is_dir() else "does not exist"
        raise SekvError(
            f"no router file at {path} ({what}); pass auto or a file written by "
            f"`sekv train --out {path}`"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("manifest")
    except Exception as exc:  # safetensors raises its own types for a damaged header
        raise RouterFileError(
            path, f"is not a sekv router file (not a readable safetensors file: {one_line(exc)})"
        ) from None
    if text is None:
        raise RouterFileError(path, "is not a sekv router file (its metadata holds no manifest)")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RouterFileError(
            path, f"is damaged: its manifest is not JSON ({one_line(exc)})"
        ) from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def shape_problem(shape: Any) -> str | None:
    """What is wrong with a manifest's ``shape`` (None: it makes a :class:`NetShape`)."""
    if not isinstance(shape, dict):
        return "its manifest has no shape object"
    known = {f.name for f in fields(NetShape)}
    required = {f.name for f in fields(NetShape) if f.default is MISSING}
    if missing := sorted(required - shape.keys()):
        return f"its manifest's shape lacks {', '.join(missing)}"
    if unknown := sorted(shape.keys() - known):
        return f"its manifest's shape has unknown fields {', '.join(unknown)}"
    if bad := [k for k in sorted(shape) if not _positive_int(shape[k])]:
        return f"its manifest's shape.{bad[0]} is {shape[bad[0]]!r}, not a positive integer"
    if shape["num_heads"] % shape["num_kv_heads"]:
        return "its manifest's shape has num_heads not a multiple of num_kv_heads"
    return None


def manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a router manifest (None: nothing): the fields loading and answering
    read (format, shape, the model it was trained for, the spans it routed over)."""
    if not isinstance(manifest, dict):
        return f"is damaged: its manifest is a JSON {type(manifest).__name__}, not an object"
    found = (manifest.get("format"), manifest.get("version"))
    if found != (FORMAT, FORMAT_VERSION):
        return f"is a {found[0]} v{found[1]} file, not a {FORMAT} v{FORMAT_VERSION}"
    if problem := shape_problem(manifest.get("shape")):
        return f"is damaged: {problem}"
    model = manifest.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("fingerprint"), str):
        return "is damaged: its manifest names no model fingerprint"
    spans = manifest.get("routing", {})
    spans = spans.get("span_tokens") if isinstance(spans, dict) else "?"
    if spans is not None and not (isinstance(spans, list) and len(spans) == 2):
        return "is damaged: its manifest's routing.span_tokens is not [min, max]"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the router file at ``path`` (SekvError saying what is wrong)."""
    manifest = raw_manifest(path)
    if problem := manifest_problem(manifest):
        raise RouterFileError(path, problem)
    return manifest


def expected_shapes(shape: NetShape) -> dict[str, torch.Size]:
    """The tensors a router of ``shape`` holds, by name (built on the meta device: nothing is
    allocated, whatever sizes a damaged manifest claims)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in ZoomNet(shape).state_dict().items()}


def weights_problem(state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> str | None:
    """What keeps ``state`` (tensors read from a file) from being the ``expected`` weights."""
    if missing := sorted(expected.keys() - state.keys()):
        return f"is damaged: it lacks the tensors {', '.join(missing)}"
    if extra := sorted(state.keys() - expected.keys()):
        return f"is damaged: it holds unexpected tensors {', '.join(extra)}"
    for name, want in expected.items():
        got = state[name]
        if got.shape != want:
            return (
                f"is damaged: tensor {name} is {list(got.shape)}, its manifest's shape needs "
                f"{list(want)}"
            )
        if not got.is_floating_point() or not torch.isfinite(got).all():
            return f"is damaged: tensor {name} holds non-finite or non-float values"
    return None


def read_weights(path: Path, shape: NetShape) -> dict[str, torch.Tensor]:
    """The router's tensors in ``path``, checked against those of a net of ``shape``."""
    try:
        with safe_open(str(path), framework="pt") as f:
            # routers trained with a rank gate (factorised stores) keep its weights: not read
            state = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("rank.")}
    except Exception as exc:  # a truncated or overwritten data section
        raise RouterFileError(
            path, f"is damaged: its tensors cannot be read ({one_line(exc)})"
        ) from None
    if problem := weights_problem(state, expected_shapes(shape)):
        raise RouterFileError(path, problem)
    return state


def load_router(path: Path, fingerprint: str | None = None, model_id: str = "") -> RouterFile:
    """Load a router file; refuse one trained for another model (fingerprint mismatch) and any
    damage (:class:`RouterFileError`)."""
    manifest = read_manifest(path)
    if fingerprint is not None and manifest["model"]["fingerprint"] != fingerprint:
        trained_for = manifest["model"].get("id", "another model")
        raise SekvError(
            f"the router {path} was trained for {trained_for}, not {model_id or 'this model'}; "
            "train one for this model with `sekv train`"
        )
    shape = NetShape(**manifest["shape"])
    state = read_weights(path, shape)  # checked before the net is allocated
    net = ZoomNet(shape)
    net.load_state_dict(state)
    net.requires_grad_(False)
    return RouterFile(net, manifest, path)


SHIPPED = Path(__file__).parent / "routers"  # trained routers shipped with the package


def user_router_path(model_id: str, fingerprint: str) -> Path:
    """Where `sekv train` writes a model's router by default (found by ``auto`` later)."""
    name = "".join(c if c.isalnum() or c in "-._" else "-" for c in model_id).strip("-")
    return sekv_home() / "routers" / f"{name[:60]}-{fingerprint[:8]}.safetensors"


def router_candidates() -> list[Path]:
    """Router files ``auto`` may use, in order: the user's (under $SEKV_HOME/routers), then the
    ones shipped with the package."""
    user = sorted((sekv_home() / "routers").glob("*.safetensors"))
    return [p for p in [*user, *sorted(SHIPPED.glob("*.safetensors"))] if p.is_file()]


def trained_for(manifest: Any) -> str | None:
    """The model fingerprint a (possibly damaged) manifest names; None if it names none."""
    model = manifest.get("model") if isinstance(manifest, dict) else None
    fingerprint = model.get("fingerprint") if isinstance(model, dict) else None
    return fingerprint if isinstance(fingerprint, str) else None


def auto_router(
    fingerprint: str, model_id: str, warn: Callable[[str], None] | None
) -> RouterFile | None:
    """The first router trained for this model that loads (the user's, else the shipped one),
    else None (training-free). A file that may be this model's but cannot be used is skipped,
    and ``warn`` is told which router is used instead; other models' routers are passed over."""
    skipped: list[RouterFileError] = []
    found, used = None, None
    for path in router_candidates():
        try:
            if trained_for(raw_manifest(path)) not in (fingerprint, None):
                continue  # another model's router
            found, used = load_router(path, fingerprint, model_id), path
            break
        except RouterFileError as exc:
            skipped.append(exc)
    if warn is not None:
        instead = f"the router {used}" if used else "the training-free router"
        for exc in skipped:
            fix = "reinstall sekv" if exc.path.parent == SHIPPED else "delete or retrain it"
            warn(
                f"skipping the router file {exc.path}, which {exc.problem}; using {instead} "
                f"instead; {fix}"
            )
    return found


def resolve_router(
    choice: str,
    fingerprint: str,
    model_id: str = "",
    warn: Callable[[str], None] | None = None,
) -> RouterFile | None:
    """The trained router ``choice`` names, or None for training-free routing.

    ``auto``: a router trained for this model (the user's, else the shipped one), else none,
    skipping damaged files with a ``warn``; anything else: a router file path (refused if
    trained for another model or damaged).
    """
    if choice == "auto":
        return auto_router(fingerprint, model_id, warn)
    return load_router(Path(choice).expanduser(), fingerprint, model_id)
