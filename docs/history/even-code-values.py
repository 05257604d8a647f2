"""Per-layer proxy for values (eighth study): the attention output's relative squared error
(the last 48 tokens' queries, exact attention weights) with the span values coded and decoded,
and the codes' order-0 entropy (with the row scale's two bytes for *x4), for *x4 and even
codes at the given steps.

Run (one thread): python docs/history/even-code-values.py sample_docs/handbook.pdf 0.25,0.3,0.4
"""
import sys, torch
import sekv_core.prefill as PF
from sekv_core.models import load_model
from sekv_core.documents import load_document
from sekv_core.codec import Codebook
from sekv_core.allocated import query_metric
from sekv_core.evencode import fit_even
torch.set_grad_enabled(False)
QN = 48
caught = {}
orig = PF._attention_with_moments
def grab(module, query, key, value, attention_mask, **kw):
    caught[module.layer_idx] = query[0][:, -QN:].float().clone()
    return orig(module, query, key, value, attention_mask, **kw)
PF._attention_with_moments = grab
lm = load_model()
doc = load_document(sys.argv[1])
ids = lm.tokenizer(doc.text, add_special_tokens=False)["input_ids"]
pre = PF.prefill(lm.model, ids)
K = pre.keys.float(); V = pre.values.float(); L, H, T, D = K.shape
Q = torch.stack([caught[i] for i in range(L)]); G = Q.shape[1] // H
SINKS = 4; body = torch.arange(SINKS, T - QN)
rows = V[:, :, body]
scale = D ** -0.5
A = []
for l in range(L):
    al = []
    for h in range(H):
        q = Q[l, h * G:(h + 1) * G].reshape(-1, D)
        al.append(torch.softmax(q @ K[l, h, :T - QN].T * scale, -1))
    A.append(torch.stack(al))
A = torch.stack(A)  # (L,H,GQ,T-QN)
def out_err(vhat):
    tot = 0.0
    for l in range(L):
        for h in range(H):
            vv = V[l, h, :T - QN]; vh = vv.clone(); vh[SINKS:] = vhat[l, h]
            o = A[l, h] @ vv; oh = A[l, h] @ vh
            tot += float((oh - o).square().sum() / o.square().sum())
    return tot / (L * H)
def ent(codes):
    S = codes.shape[2]; c = codes.reshape(L * H, S, -1); tot = 0.0
    for i in range(c.shape[0]):
        for d in range(c.shape[2]):
            _, n = torch.unique(c[i, :, d], return_counts=True); p = n.double() / S
            tot += float(-(p * p.log2()).sum())
    return tot / (L * H * c.shape[2])
def decoded(code):
    out = torch.empty_like(rows)
    for l in range(L):
        rec = code.encode_layer(rows[l], l)
        heads = torch.arange(H).repeat_interleave(rec.shape[1])
        out[l] = code.decode(rec.reshape(-1, rec.shape[-1]), l, heads, torch.float32).view(H, -1, D)
    return out
cb = Codebook.fit(rows, "*x4")
coef = torch.stack([((rows[l] - cb.mean[l][:, None]) @ cb.basis[l]) / cb.range[l][:, None] for l in range(L)])
g = (coef.abs().amax(-1) / 7).to(torch.float16).float().clamp(min=6e-8)
codes = (coef / g[..., None]).round().clamp(-7, 7)
b = g.to(torch.float16).view(torch.int16).int()
sb = (ent(((b & 255).float())[..., None]) + ent((((b >> 8) & 255).float())[..., None])) / D
print(f"*x4: out err {out_err(decoded(cb)):.2e} bits {ent(codes) + sb:.3f} record {cb.record_bytes}", flush=True)
for d in [float(x) for x in sys.argv[2].split(",")]:
    code = fit_even(rows, d, query_metric(None, rows))
    step, levels = code.grid
    cs = torch.stack([(((rows[l] - code.mean[l][:, None]) @ code.basis[l]) / step[l][:, None]).round().clamp(-levels[l][:, None], levels[l][:, None]) for l in range(L)])
    print(f"even:{d}: out err {out_err(decoded(code)):.2e} bits {ent(cs):.3f} record {code.record_bytes}", flush=True)
