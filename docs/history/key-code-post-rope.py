"""Per-layer proxy: attention KL of coded keys vs exact, for
A: today's key code (pre-RoPE, diagonal query metric, alloc:B) + a separate 4-bit sketch, and
B: one post-RoPE code in the sketch's own metric (W = Q^1/2, directions of W C W) whose first 32
   directions' codes embed the 4-bit sketch (>= 4 bits each), so the sketch costs nothing extra;
C: B's basis without the embedding constraint.

Run (one thread): python docs/history/key-code-post-rope.py DOCUMENT TOKENS A_BITS B_BITS, e.g.
  python docs/history/key-code-post-rope.py sample_docs/handbook.pdf 0 5,6,7 5,6
(TOKENS 0: the whole document.)"""
import sys, math, torch
import sekv_core.prefill as PF
from sekv_core.models import load_model
from sekv_core.documents import load_document
from sekv_core.allocated import AllocatedCode, query_metric
from sekv_core.rope import Rope
from sekv_core.sketch import RIDGE
torch.set_grad_enabled(False)
QN = 48
caught = {}
orig = PF._attention_with_moments
def grab(module, query, key, value, attention_mask, **kw):
    caught[module.layer_idx] = query[0][:, -QN:].float().clone()
    return orig(module, query, key, value, attention_mask, **kw)
PF._attention_with_moments = grab
lm = load_model()
path = sys.argv[1]
doc = load_document(path)
ids = lm.tokenizer(doc.text, add_special_tokens=False)["input_ids"][: (int(sys.argv[2]) or None) if len(sys.argv) > 2 else None]
pre = PF.prefill(lm.model, ids)
K = pre.keys.float()  # (L, H, T, D) post-RoPE
L, H, T, D = K.shape
Q = torch.stack([caught[i] for i in range(L)])  # (L, Hq, QN, D)
G = Q.shape[1] // H
SINKS = 4
body = torch.arange(SINKS, T - QN)
rows_post = K[:, :, body]  # (L, H, S, D)
rope = Rope(lm.model)
rows_pre = torch.stack([rope.unrotate(rows_post[i], body) for i in range(L)])
moment = pre.query_moment.float()  # (L, H, D, D)
scale = D ** -0.5

def attn_kl(khat):  # khat (L, H, S, D) post-RoPE coded body keys
    tot = 0.0
    for l in range(L):
        for h in range(H):
            q = Q[l, h * G:(h + 1) * G].reshape(-1, D)  # (G*QN, D)
            keys = K[l, h, : T - QN]
            kh = keys.clone(); kh[SINKS:] = khat[l, h]
            lp = torch.log_softmax(q @ keys.T * scale, -1); lq = torch.log_softmax(q @ kh.T * scale, -1)
            tot += float((lp.exp() * (lp - lq)).sum(-1).mean())
    return tot / (L * H)

def code_A(bits):
    code = AllocatedCode.fit(rows_pre, bits * D, query_metric(moment, rows_pre))
    out = torch.empty_like(rows_post)
    for l in range(L):
        rec = code.encode_layer(rows_pre[l], l)  # (H, S, B)
        heads = torch.arange(H).repeat_interleave(rec.shape[1])
        dec = code.decode(rec.reshape(-1, rec.shape[-1]), l, heads, torch.float32).view(H, -1, D)
        out[l] = rope.rotate(dec, body)
    return out

def greedy(errors, budget, init):
    P, Dd, _ = errors.shape
    bits = init.clone(); left = budget - bits.sum(1)
    rows = torch.arange(P)
    while True:
        nxt = torch.where(bits == 0, 2, bits + 1); cost = nxt - bits
        ok = (nxt <= 8) & (cost <= left[:, None])
        now = errors.gather(2, bits[..., None])[..., 0]; then = errors.gather(2, nxt.clamp(max=8)[..., None])[..., 0]
        gain = torch.where(ok, (now - then) / cost, -1.0)
        best = gain.argmax(1); act = gain[rows, best] >= 0
        if not bool(act.any()): return bits
        pick = rows[act], best[act]; left[act] -= cost[pick]; bits[pick] = nxt[pick]

def halflevels(b, embedded):
    if b == 0: return 0
    return 7 * 2 ** (b - 4) if embedded else 2 ** (b - 1) - 1

def quant(y, rng, b, embedded):
    lv = halflevels(b, embedded)
    if lv == 0: return torch.zeros_like(y)
    step = rng / lv
    return (y / step).round().clamp(-lv, lv) * step

def code_W(bits_per, sketch_dims, embed):
    out = torch.empty_like(rows_post)
    for l in range(L):
        errs, ys, dirs = [], [], []
        for h in range(H):
            x = rows_post[l, h]; mu = x.mean(0); c = x - mu
            vals, vecs = torch.linalg.eigh(moment[l, h])
            vals = vals.clamp(min=1e-12).maximum(vals[-1:] * RIDGE)
            w = vecs @ torch.diag(vals.sqrt()) @ vecs.T; w_inv = vecs @ torch.diag(vals.rsqrt()) @ vecs.T
            _, u = torch.linalg.eigh(w @ (c.T @ c) @ w); u = u.flip(-1)
            y = c @ w @ u  # (S, D) coefficients, metric error = logit error energy
            rng = y.abs().amax(0).clamp(min=1e-6)
            e = torch.zeros(D, 9)
            for b in range(9):
                for d in range(D):
                    emb = embed and d < sketch_dims and b >= 4
                    e[d, b] = (y[:, d] - quant(y[:, d], rng[d], b, emb)).square().sum() if b != 1 else 2 * y[:, d].square().sum()
            errs.append(e); ys.append((y, rng, mu, w_inv, u))
        E = torch.stack(errs).sum(0)[None]  # heads share a layout
        init = torch.zeros(1, D, dtype=torch.long)
        if embed: init[0, :sketch_dims] = 4
        bits = greedy(E, bits_per * D, init)[0]
        for h, (y, rng, mu, w_inv, u) in enumerate(ys):
            yq = torch.stack([quant(y[:, d], rng[d], int(bits[d]), embed and d < sketch_dims and bits[d] >= 4) for d in range(D)], 1)
            out[l, h] = mu + yq @ u.T @ w_inv
        if False: print("  layer", l, "bits", bits.tolist(), flush=True)
    return out

print(path, "tokens", T, "body", len(body), flush=True)
for b in [int(x) for x in sys.argv[3].split(",")]:
    print(f"A alloc:{b} pre-RoPE diag metric (+ separate sketch 2 bits/number): KL {attn_kl(code_A(b)):.3e}", flush=True)
for b in [int(x) for x in sys.argv[4].split(",")]:
    print(f"B post-RoPE W metric, {b} bits, sketch embedded: KL {attn_kl(code_W(b, 32, True)):.3e}", flush=True)
