"""Per-layer proxy for the even key code (eighth study): attention KL of the last 48 tokens'
queries over the document's keys (sinks exact) with the span keys coded and decoded, and the
codes' order-0 entropy (what the rANS coder pays, within ~0.04 bits), for alloc:4.5, alloc:5
and even codes at the given steps.

Run (one thread): python docs/history/even-code-keys.py sample_docs/handbook.pdf 0.15,0.175,0.2
"""
import sys, torch
import sekv_core.prefill as PF
from sekv_core.models import load_model
from sekv_core.documents import load_document
from sekv_core.allocated import AllocatedCode, query_metric
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
lm = load_model()
doc = load_document(sys.argv[1])
ids = lm.tokenizer(doc.text, add_special_tokens=False)["input_ids"]
pre = PF.prefill(lm.model, ids)
K = pre.keys.float(); L, H, T, D = K.shape
Q = torch.stack([caught[i] for i in range(L)]); G = Q.shape[1] // H
SINKS = 4
body = torch.arange(SINKS, T - QN)
rope = Rope(lm.model)
post = K[:, :, body]
pre_rows = torch.stack([rope.unrotate(post[i], body) for i in range(L)])
moment = pre.query_moment.float()
scale = D ** -0.5
def attn_kl(khat):
    tot = 0.0; worst = 0.0
    for l in range(L):
        for h in range(H):
            q = Q[l, h * G:(h + 1) * G].reshape(-1, D)
            keys = K[l, h, :T - QN]; kh = keys.clone(); kh[SINKS:] = khat[l, h]
            lp = torch.log_softmax(q @ keys.T * scale, -1); lq = torch.log_softmax(q @ kh.T * scale, -1)
            kl = float((lp.exp() * (lp - lq)).sum(-1).mean()); tot += kl
    return tot / (L * H)
def ent(codes):
    S = codes.shape[2]; c = codes.reshape(L * H, S, -1); tot = 0.0
    for i in range(c.shape[0]):
        for d in range(c.shape[2]):
            _, n = torch.unique(c[i, :, d], return_counts=True); p = n.double() / S
            tot += float(-(p * p.log2()).sum())
    return tot / (L * H * c.shape[2])
def run(code, name):
    out = torch.empty_like(post); cs = []
    step, levels = code.grid
    for l in range(L):
        rec = code.encode_layer(pre_rows[l], l)
        heads = torch.arange(H).repeat_interleave(rec.shape[1])
        dec = code.decode(rec.reshape(-1, rec.shape[-1]), l, heads, torch.float32).view(H, -1, D)
        out[l] = rope.rotate(dec, body)
        y = ((pre_rows[l] - code.mean[l][:, None]) * code.metric[l].sqrt()[:, None]) @ code.basis[l]
        cs.append((y / step[l][:, None]).round().clamp(-levels[l][:, None], levels[l][:, None]))
    print(f"{name}: attn KL {attn_kl(out):.2e} bits {ent(torch.stack(cs)):.3f} record {code.record_bytes}", flush=True)
metric = query_metric(moment, pre_rows)
for b in (4.5, 5.0):
    run(AllocatedCode.fit(pre_rows, int(b * D), metric), f"alloc:{b}")
for d in [float(x) for x in sys.argv[2].split(",")]:
    run(fit_even(pre_rows, d, metric), f"even:{d}")
