"""Probe (not shipped): the keys of a within-window store reconstructed from a post-RoPE code in the
routing sketch's own metric whose first 32 directions embed the 4-bit sketch codes (FUSED_BITS
bits per number in all, the sketch included). Routing is untouched (the store's own sketch).

Run: the CLI with the probe in place, e.g.
  FUSED_BITS=6 OMP_NUM_THREADS=1 python docs/history/key-code-post-rope-probe.py bench fidelity \
    --methods sekv --tasks needle,multikey,qa --lengths 2000,4000 --depths 0.25,0.75 --seeds 1 \
    --every-span --out /tmp/fused-6"""
import os, sys, torch
import sekv_core.methods.sekv as MS
import sekv_core.reconstruct as R
from sekv_core.prefill import prefill
from sekv_core.rope import Rope
from sekv_core.sketch import RIDGE

BITS = int(os.environ.get("FUSED_BITS", "6"))
SKETCH = 32

def halflevels(bits, embedded):
    lv = torch.where(bits >= 2, 2 ** (bits - 1).clamp(min=1) - 1, 0)
    emb = 7 * 2 ** (bits - 4).clamp(min=0)
    return torch.where(embedded & (bits >= 4), emb, lv).float()

def quant(y, rng, lv):  # y (S, D), rng (D,), lv (D,) half-levels (0: dropped)
    step = rng / lv.clamp(min=1)
    q = (y / step).round().clamp(-lv, lv) * step
    return torch.where(lv > 0, q, torch.zeros_like(q))

def greedy(E, budget, init):
    D = E.shape[0]; bits = init.clone(); left = budget - int(bits.sum())
    while True:
        nxt = torch.where(bits == 0, 2, bits + 1); cost = nxt - bits
        ok = (nxt <= 8) & (cost <= left)
        now = E.gather(1, bits[:, None])[:, 0]; then = E.gather(1, nxt.clamp(max=8)[:, None])[:, 0]
        gain = torch.where(ok, (now - then) / cost, -1.0)
        b = int(gain.argmax())
        if gain[b] < 0: return bits
        left -= int(cost[b]); bits[b] = nxt[b]

def fused_keys(keys, moment, bits_per):
    L, H, S, D = keys.shape
    out = torch.empty_like(keys)
    embedded = torch.arange(D) < SKETCH
    for l in range(L):
        E = torch.zeros(D, 9); parts = []
        for h in range(H):
            x = keys[l, h]; mu = x.mean(0); c = x - mu
            vals, vecs = torch.linalg.eigh(moment[l, h])
            vals = vals.clamp(min=1e-12).maximum(vals[-1:] * RIDGE)
            w = vecs @ torch.diag(vals.sqrt()) @ vecs.T; w_inv = vecs @ torch.diag(vals.rsqrt()) @ vecs.T
            _, u = torch.linalg.eigh(w @ (c.T @ c) @ w); u = u.flip(-1)
            y = c @ w @ u; rng = y.abs().amax(0).clamp(min=1e-6)
            for b in range(9):
                bb = torch.full((D,), b)
                err = (y - quant(y, rng, halflevels(bb, embedded))).square().sum(0)
                E[:, b] += err if b != 1 else 2 * y.square().sum(0)
            parts.append((y, rng, mu, w_inv, u))
        init = torch.where(embedded, 4, 0)
        bits = greedy(E, bits_per * D, init)
        lv = halflevels(bits, embedded)
        for h, (y, rng, mu, w_inv, u) in enumerate(parts):
            out[l, h] = mu + quant(y, rng, lv) @ u.T @ w_inv
    return out

CACHE = {}
orig_prepare = MS.SeKV.prepare
def prepare(self, *a, **k):
    orig_prepare(self, *a, **k)
    mem = self.spans
    if mem.bounded:
        return
    key = hash(tuple(self.context.ids))
    if key not in CACHE:
        pre = prefill(self.loaded.model, self.context.ids, 512)
        tok = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(mem.starts, mem.ends)])
        keys = pre.keys.float()[:, :, tok]
        dec = fused_keys(keys, pre.query_moment.float(), BITS)
        rope = Rope(self.loaded.model)
        CACHE[key] = torch.stack([rope.unrotate(dec[i], tok) for i in range(dec.shape[0])])
        err = ((dec - keys).square().sum() / keys.square().sum()).sqrt()
        print(f"[fused {BITS}] {len(tok)} span tokens, relative key error {float(err):.4f}", file=sys.stderr, flush=True)
    mem._fused = CACHE[key]
MS.SeKV.prepare = prepare

orig_rows = R.rows
def rows(mem, kind, layer, ranges, row_heads):
    t = getattr(mem, "_fused", None)
    if kind != "k" or t is None:
        return orig_rows(mem, kind, layer, ranges, row_heads)
    S = t.shape[2]
    r = ranges.index - (layer * mem.num_kv_heads + row_heads) * S
    return t[layer, row_heads, r].to(mem.dtype).to(mem.device)
R.rows = rows

if __name__ == "__main__":
    from sekv_cli.main import app
    app(sys.argv[1:])
