"""Values on a fixed rotation instead of the document's principal directions (ninth study):
the attention output's relative squared error (the last 48 tokens' queries, exact attention
weights) and the codes' order-0 entropy with the row scale's two bytes, for the document's own
directions (8-bit, fewer bits), another document's, none (identity), a random orthogonal
matrix and a normalised Hadamard matrix, at 4..7 levels each side, each direction normalised
by its document range ("dir") or not ("head"). Keys' bases in fewer bits too (even code,
step 0.175: attention KL).

values_o: the same, and the error through o_proj (the layer's output) too.

Run (one thread): python docs/history/rotated-values-probe.py sample_docs/lighthouse.md [other docs]
"""
import sys, torch
import sekv_core.prefill as PF
from sekv_core.models import load_model
from sekv_core.documents import load_document
from sekv_core.allocated import query_metric
from sekv_core.evencode import fit_even
from sekv_core.rope import Rope
torch.set_grad_enabled(False)
QN = 48
caught = {}
orig = PF._attention_with_moments
def grab(module, query, key, value, attention_mask, **kw):
    caught[module.layer_idx] = query[0][:, -QN:].float().clone()
    return orig(module, query, key, value, attention_mask, **kw)
PF._attention_with_moments = grab
lm = load_model(); rope = Rope(lm.model)
def doc_rows(path):
    caught.clear()
    ids = lm.tokenizer(load_document(path).text, add_special_tokens=False)["input_ids"]
    pre = PF.prefill(lm.model, ids)
    K = pre.keys.float(); V = pre.values.float(); L, H, T, D = K.shape
    body = torch.arange(4, T - QN)
    X = torch.stack([rope.unrotate(K[i][:, body], body) for i in range(L)])
    Q = torch.stack([caught[i] for i in range(L)])
    return K, V, X, Q, body, pre.query_moment.float()
K, V, X, Q, body, mom = doc_rows(sys.argv[1])
L, H, T, D = K.shape; G = Q.shape[1] // H
VR = V[:, :, body]
A = torch.stack([torch.stack([torch.softmax(Q[l, h*G:(h+1)*G].reshape(-1, D) @ K[l, h, :T-QN].T / D**0.5, -1) for h in range(H)]) for l in range(L)])
def attn_kl(khat):
    tot = 0.0
    for l in range(L):
        for h in range(H):
            q = Q[l, h * G:(h + 1) * G].reshape(-1, D); keys = K[l, h, :T - QN]; kh = keys.clone(); kh[4:] = khat[l, h]
            lp = torch.log_softmax(q @ keys.T / D ** 0.5, -1); lq = torch.log_softmax(q @ kh.T / D ** 0.5, -1)
            tot += float((lp.exp() * (lp - lq)).sum(-1).mean())
    return tot / (L * H)
def out_err(vhat):
    tot = 0.0
    for l in range(L):
        for h in range(H):
            vv = V[l, h, :T - QN]; vh = vv.clone(); vh[4:] = vhat[l, h]
            o = A[l, h] @ vv; oh = A[l, h] @ vh
            tot += float((oh - o).square().sum() / o.square().sum())
    return tot / (L * H)
def ent(c):
    S = c.shape[2]; c = c.reshape(L * H, S, -1); tot = 0.0
    for i in range(c.shape[0]):
        for d in range(c.shape[2]):
            _, n = torch.unique(c[i, :, d], return_counts=True); p = n.double() / S; tot += float(-(p * p.log2()).sum())
    return tot / (L * H * c.shape[2])
def nb(t, bits):  # each column on a power-of-two grid of 2^(bits-1)-1 levels (narrow.py at 8)
    lv = 2 ** (bits - 1) - 1
    e = torch.ceil(torch.log2(t.abs().amax(dim=-2, keepdim=True) / lv))
    return (t / torch.exp2(e)).round().clamp(-lv, lv) * torch.exp2(e)
def keys(basis, metric, name, delta=0.175):
    sc = metric.sqrt(); mean = X.mean(2)
    y = torch.stack([((X[l] - mean[l][:, None]) * sc[l][:, None]) @ basis[l] for l in range(L)])
    step = delta * y.square().mean(dim=(2, 3)).sqrt()[..., None, None]
    c = (y / step).round()
    out = torch.stack([rope.rotate(((c[l] * step[l]) @ torch.linalg.inv(basis[l])) / sc[l][:, None] + mean[l][:, None], body) for l in range(L)])
    print(f"keys {name}: KL {attn_kl(out):.2e} bits {ent(c):.3f}", flush=True)
def vbasis(rows):
    mean = rows.mean(2); c = rows - mean[:, :, None]
    _, vecs = torch.linalg.eigh(c.transpose(-1, -2) @ c)
    return vecs.flip(-1)
def values(basis, name, lv=7, norm="dir"):
    mean = VR.mean(2)
    coef = torch.stack([(VR[l] - mean[l][:, None]) @ basis[l] for l in range(L)])
    rng = coef.abs().amax(2, keepdim=True).clamp(min=1e-6)
    if norm == "head": rng = rng.amax(-1, keepdim=True).expand_as(rng)
    coef = coef / rng
    g = (coef.abs().amax(-1) / lv).to(torch.float16).float().clamp(min=6e-8)
    codes = (coef / g[..., None]).round().clamp(-lv, lv)
    b = g.to(torch.float16).view(torch.int16).int()
    sb = (ent(((b & 255).float())[..., None]) + ent((((b >> 8) & 255).float())[..., None])) / D
    vh = torch.stack([((codes[l] * g[l][..., None]) * rng[l]) @ torch.linalg.inv(basis[l]) + mean[l][:, None] for l in range(L)])
    print(f"values {name} levels {lv} {norm}: err {out_err(vh):.3e} bits {ent(codes) + sb:.3f}", flush=True)
Hq = lm.model.config.num_attention_heads
Wo = torch.stack([lm.model.model.layers[l].self_attn.o_proj.weight.float() for l in range(L)])  # (L, hidden, Hq*D)
def out_err_o(vhat):
    tot = 0.0
    for l in range(L):
        num = den = 0.0
        for h in range(H):
            vv = V[l, h, :T - QN]; vh = vv.clone(); vh[4:] = vhat[l, h]
            for g in range(G):
                qh = h * G + g
                a = A[l, h].view(G, QN, -1)[g]
                o = a @ vv; oh = a @ vh
                W = Wo[l][:, qh * D:(qh + 1) * D]
                num += float(((oh - o) @ W.T).square().sum()); den += float((o @ W.T).square().sum())
        tot += num / den
    return tot / L
def values_o(basis, name, lv=7, norm="dir"):
    mean = VR.mean(2)
    coef = torch.stack([(VR[l] - mean[l][:, None]) @ basis[l] for l in range(L)])
    rng = coef.abs().amax(2, keepdim=True).clamp(min=1e-6)
    if norm == "head": rng = rng.amax(-1, keepdim=True).expand_as(rng)
    coef = coef / rng
    g = (coef.abs().amax(-1) / lv).to(torch.float16).float().clamp(min=6e-8)
    codes = (coef / g[..., None]).round().clamp(-lv, lv)
    b = g.to(torch.float16).view(torch.int16).int()
    sb = (ent(((b & 255).float())[..., None]) + ent((((b >> 8) & 255).float())[..., None])) / D
    vh = torch.stack([((codes[l] * g[l][..., None]) * rng[l]) @ torch.linalg.inv(basis[l]) + mean[l][:, None] for l in range(L)])
    print(f"values {name} levels {lv} {norm}: err {out_err(vh):.3e} o_proj err {out_err_o(vh):.3e} bits {ent(codes) + sb:.3f}", flush=True)
def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5
own = fit_even(X, 0.175, query_metric(mom, X))
vb = vbasis(VR)
for bits in (8, 6, 5, 4):
    keys(nb(own.basis, bits), own.metric, f"own basis, {bits}-bit")
    values(nb(vb, bits), f"own basis, {bits}-bit")
values(torch.eye(D).expand(L, H, D, D), "identity")
g = torch.Generator().manual_seed(0)
values(torch.linalg.qr(torch.randn(D, D, generator=g))[0].expand(L, H, D, D), "random orthogonal")
Hd = hadamard(D).expand(L, H, D, D)
for lv in (7, 6, 5, 4):
    values(Hd, "hadamard", lv, "dir")
    values(Hd, "hadamard", lv, "head")
    values(vb, "own basis", lv, "head")
M = torch.stack([torch.stack([sum(Wo[l][:, (h*G+g)*D:(h*G+g+1)*D].T @ Wo[l][:, (h*G+g)*D:(h*G+g+1)*D] for g in range(G)) for h in range(H)]) for l in range(L)])
lam, E = torch.linalg.eigh(M)
values_o(vb, "own basis", 7, "dir")
values_o(Hd, "hadamard", 6, "head")
values_o(Hd, "hadamard", 5, "head")
values_o(E.flip(-1), "o_proj metric's eigenvectors", 7, "dir")
for other in sys.argv[2:]:
    _, Vo, Xo, _, bo, momo = doc_rows(other)
    ob = fit_even(Xo, 0.175, query_metric(momo, Xo))
    keys(ob.basis, ob.metric, f"{other}'s basis and metric")
    values(nb(vbasis(Vo[:, :, bo]), 8), f"{other}'s basis")
