"""Fidelity with the values' codebook on another basis (ninth study): identity, or the
eigenvectors of o_proj's metric per KV head group (from the model's weights), the ranges
refitted on it; the codebook is stored as usual, so loading needs nothing else.

Run (one thread, one SEKV_HOME per mode):
    SEKV_HOME=/tmp/h-output python docs/history/values-basis-fidelity.py output bench fidelity \
        --methods sekv --tasks needle,multikey,qa --lengths 2000,4000 --depths 0.25,0.75 \
        --seeds 1 --every-span --threads 1
"""
import sys, torch
import sekv_core.codec as codec
import sekv_core.models as models
from sekv_core.narrow import narrowed
from sekv_core.summary import stored
MODE = sys.argv.pop(1)
MODEL = {}
orig_load = models.load_model
def load(*a, **k):
    lm = orig_load(*a, **k); MODEL["m"] = lm.model; return lm
models.load_model = load
import sekv_cli.main  # noqa
for mod in list(sys.modules.values()):
    if getattr(mod, "load_model", None) is orig_load:
        mod.load_model = load
def out_basis(L, H, D):
    m = MODEL["m"]; cfg = m.config; Hq = cfg.num_attention_heads; G = Hq // H
    out = []
    for l in range(L):
        W = m.model.layers[l].self_attn.o_proj.weight.float()
        hs = []
        for h in range(H):
            M = sum(W[:, (h * G + g) * D:(h * G + g + 1) * D].T @ W[:, (h * G + g) * D:(h * G + g + 1) * D] for g in range(G))
            _, e = torch.linalg.eigh(M)
            hs.append(e.flip(-1))
        out.append(torch.stack(hs))
    return torch.stack(out)
orig_fit = codec.Codebook.fit.__func__
def fit(cls, rows, spec, setting="code"):
    cb = orig_fit(cls, rows, spec, setting)
    x = rows.float(); L, H, S, D = x.shape
    if S == 0:
        return cb
    basis = torch.eye(D).expand(L, H, D, D).contiguous() if MODE == "identity" else narrowed(out_basis(L, H, D))
    basis = stored(basis)
    span = torch.stack([((x[l] - cb.mean[l][:, None]) @ basis[l]).abs().amax(dim=1).clamp(min=1e-6) for l in range(L)])
    return cls(basis, cb.mean, stored(span), cb.tiers)
codec.Codebook.fit = classmethod(fit)
sekv_cli.main.app(prog_name="sekv")
