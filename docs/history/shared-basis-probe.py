"""Would a codebook per model do? Keys of one document coded on the even grid (step 0.175) with
its own basis and metric, with another document's, and with none: attention KL (the last 48
tokens' queries) and the codes' order-0 entropy (eighth study).

Run (one thread): python docs/history/shared-basis-probe.py sample_docs/lighthouse.md sample_docs/handbook.pdf
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
    K = pre.keys.float(); L, H, T, D = K.shape
    body = torch.arange(4, T - QN)
    X = torch.stack([rope.unrotate(K[i][:, body], body) for i in range(L)])
    Q = torch.stack([caught[i] for i in range(L)])
    return K, X, Q, body, pre.query_moment.float()
K, X, Q, body, mom = doc_rows(sys.argv[1])          # the document coded
_, Xo, _, _, momo = doc_rows(sys.argv[2])           # the other document the codebook comes from
L, H, T, D = K.shape; G = Q.shape[1] // H
def attn_kl(khat):
    tot = 0.0
    for l in range(L):
        for h in range(H):
            q = Q[l, h * G:(h + 1) * G].reshape(-1, D); keys = K[l, h, :T - QN]; kh = keys.clone(); kh[4:] = khat[l, h]
            lp = torch.log_softmax(q @ keys.T / D ** 0.5, -1); lq = torch.log_softmax(q @ kh.T / D ** 0.5, -1)
            tot += float((lp.exp() * (lp - lq)).sum(-1).mean())
    return tot / (L * H)
def ent(c):
    S = c.shape[2]; c = c.reshape(L * H, S, -1); tot = 0.0
    for i in range(c.shape[0]):
        for d in range(c.shape[2]):
            _, n = torch.unique(c[i, :, d], return_counts=True); p = n.double() / S; tot += float(-(p * p.log2()).sum())
    return tot / (L * H * c.shape[2])
def run(basis, metric, name, delta=0.175):
    sc = metric.sqrt(); mean = X.mean(2)
    y = torch.stack([((X[l] - mean[l][:, None]) * sc[l][:, None]) @ basis[l] for l in range(L)])
    step = delta * y.square().mean(dim=(2, 3)).sqrt()[..., None, None]
    c = (y / step).round()
    out = torch.stack([rope.rotate(((c[l] * step[l]) @ torch.linalg.inv(basis[l])) / sc[l][:, None] + mean[l][:, None], body) for l in range(L)])
    print(f"{name}: KL {attn_kl(out):.2e} bits {ent(c):.3f}", flush=True)
own = fit_even(X, 0.175, query_metric(mom, X))
run(own.basis, own.metric, "own basis")
other = fit_even(Xo, 0.175, query_metric(momo, Xo))
run(other.basis, other.metric, "other document's basis and metric")
run(torch.eye(D).expand(L, H, D, D), own.metric, "no basis (identity), own metric")
