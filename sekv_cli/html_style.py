"""The inspect and answer pages' stylesheets and script (inlined: each page is self-contained)."""

# sequential scale for surprisal (low -> high), then the text colour readable on each
SCALE = ("#ffffff", "#fff7db", "#ffebb0", "#fed98a", "#fdbb63", "#fb9447", "#ef5b3a", "#c81e1e")
INK = ("#1f2937",) * 6 + ("#ffffff", "#ffffff")
CSS = """
:root{--ink:#1f2937;--mute:#6b7280;--line:#e5e7eb;--bg:#f8fafc;--card:#ffffff;--anchor:#2455c3}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
 font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1180px;margin:0 auto;padding:28px 28px 60px}
h1{font-size:24px;margin:0 0 2px;letter-spacing:-.01em}
h2{font-size:15px;margin:0 0 12px;text-transform:uppercase;letter-spacing:.06em;color:#374151}
.sub{color:var(--mute);font-size:13px;margin-bottom:18px;word-break:break-all}
.sub code{font-size:12px}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;
 padding:18px 20px;margin:16px 0;box-shadow:0 1px 2px rgba(0,0,0,.03)}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(220px,1fr));gap:10px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:10px 14px}
.card .k{font-size:12px;color:var(--mute);text-transform:uppercase;letter-spacing:.05em}
.card .v{font-size:22px;font-weight:650;font-variant-numeric:tabular-nums}
.card .d{font-size:12px;color:var(--mute)}
.mem{display:grid;grid-template-columns:150px 1fr 190px;gap:6px 12px;align-items:center;
 font-size:13px;font-variant-numeric:tabular-nums}
.mem .track{background:#f1f5f9;border-radius:4px;height:14px;overflow:hidden}
.mem .fill{height:100%;border-radius:4px}
.mem .n{text-align:right;color:#374151}
svg{display:block;width:100%;height:auto}
svg text{font:11px system-ui,sans-serif;fill:#6b7280}
svg text.halo{paint-order:stroke;stroke:#fff;stroke-width:4px}
.legend{display:flex;flex-wrap:wrap;gap:18px;align-items:center;font-size:12px;color:#374151;
 margin-bottom:14px}
.legend .ramp{display:inline-flex;vertical-align:middle;border:1px solid var(--line);
 border-radius:3px;overflow:hidden;margin:0 6px}
.legend .ramp i{width:22px;height:12px;display:block}
.doc{white-space:pre-wrap;overflow-wrap:anywhere;line-height:2.05;font-size:15px}
.head{white-space:pre-wrap;font:12px/1.6 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
 color:#9ca3af;background:#f9fafb;border:1px dashed #d1d5db;border-radius:6px;padding:6px 10px;
 margin-bottom:12px}
.span{border:1px solid #7c8aa0;border-radius:4px;padding:1px 1px;margin:0 1px;
 -webkit-box-decoration-break:clone;box-decoration-break:clone}
.span.alt{border-color:#19a89a}
.span:hover,.span.on{border-color:#2563eb;box-shadow:0 0 0 1px #2563eb}
.span.cont::before{content:none}
.span::before{content:attr(data-id);font-size:9px;color:#64748b;vertical-align:super;
 line-height:0;margin-right:2px;font-variant-numeric:tabular-nums}
.anchor{background:var(--anchor);color:#fff;border-radius:3px;padding:1px 1px;font-weight:600}
.sink{color:#9ca3af;background:#f3f4f6;font-style:italic}
.page{font-size:11px;font-weight:600;color:#fff;background:#334155;border-radius:3px;
 padding:1px 6px;margin-right:6px;vertical-align:1px;white-space:nowrap;letter-spacing:.03em}
"""
CSS += "".join(
    f".h{i}{{background:{c};color:{k}}}" for i, (c, k) in enumerate(zip(SCALE, INK, strict=True))
)
CSS += """
.t:hover{outline:1px solid #111827}
table{border-collapse:collapse;width:100%;font-size:13px;font-variant-numeric:tabular-nums}
th{text-align:left;color:#6b7280;font-weight:600;border-bottom:1px solid var(--line);
 padding:6px 8px;position:sticky;top:0;background:#fff}
td{border-bottom:1px solid #f1f5f9;padding:4px 8px;vertical-align:top}
td.num,th.num{text-align:right}
tr:hover td{background:#f8fafc}
tr.on td{background:#eff6ff}
td a{color:#2563eb;text-decoration:none;font-weight:600}
td.pre{color:#374151;max-width:420px}
footer{color:var(--mute);font-size:12px;margin-top:18px}
#tip{position:fixed;z-index:9;pointer-events:none;background:#111827;color:#f9fafb;
 font:12px/1.45 system-ui,sans-serif;padding:6px 9px;border-radius:6px;white-space:pre;
 box-shadow:0 4px 14px rgba(0,0,0,.25)}
"""
SCRIPT = """
(() => {
  const tip = document.getElementById('tip');
  for (const el of document.querySelectorAll('.doc [title], .head [title]')) {
    el.dataset.tip = el.title; el.removeAttribute('title');
  }
  let row = null;
  document.addEventListener('mouseover', (e) => {
    const tok = e.target.closest('[data-tip]:not(.span)');
    const span = e.target.closest('.doc .span');
    const lines = [];
    if (span) lines.push(span.dataset.tip);
    if (tok) lines.push(tok.dataset.tip);
    if (row) row.classList.remove('on');
    row = span ? document.getElementById('row-' + span.dataset.id) : null;
    if (row) row.classList.add('on');
    tip.hidden = !lines.length;
    tip.textContent = lines.join('\\n');
  });
  document.addEventListener('mousemove', (e) => {
    tip.style.left = Math.min(e.clientX + 14, innerWidth - tip.offsetWidth - 8) + 'px';
    tip.style.top = (e.clientY + 16) + 'px';
  });
})();
"""

# the answer view (sekv_cli.html_answer): zoomed spans shaded by their share of the answer's
# attention (light -> strong), source highlights drawn over the shading
ZOOM_SCALE = ("#eef2ff", "#dbe4ff", "#c3d2fe", "#a5b8fc", "#8197f8")
ANSWER_CSS = """
.question{font-size:13px;color:var(--mute);text-transform:uppercase;letter-spacing:.05em}
.q{font-size:17px;margin:2px 0 14px}
.a{font-size:19px;line-height:1.45;font-weight:500;white-space:pre-wrap}
.a strong,.quote strong{background:#fef3c7;border-radius:3px;padding:0 2px;font-weight:650}
.facts{color:var(--mute);font-size:12px;margin-top:12px}
ol.sources{margin:0;padding:0;list-style:none}
ol.sources li{display:grid;grid-template-columns:120px 1fr;gap:2px 14px;padding:10px 0;
 border-top:1px solid #f1f5f9}
ol.sources li:first-child{border-top:0}
ol.sources li:target{background:#fffbeb}
.cite a{color:#b45309;font-weight:700;text-decoration:none;font-variant-numeric:tabular-nums}
.cite .share{display:block;font-size:12px;color:var(--mute);font-variant-numeric:tabular-nums}
.quote{color:#1f2937}
.quote::before{content:"\\201c"}.quote::after{content:"\\201d"}
.zoomfacts{font-size:12px;color:#4338ca;margin-top:2px}
.none{color:var(--mute);font-style:italic}
.file{font-size:12px;color:var(--mute);word-break:break-all}
td.path{word-break:break-all}
mark.src{background:#fde68a;color:inherit;border-radius:3px;padding:1px 0;
 box-shadow:0 0 0 1px #f59e0b;-webkit-box-decoration-break:clone;box-decoration-break:clone}
mark.src:target{box-shadow:0 0 0 2px #d97706;background:#fcd34d}
mark.src .z{background:none;box-shadow:inset 0 -4px var(--z)}
a.badge{font-size:10px;font-weight:700;color:#fff;background:#d97706;border-radius:8px;
 padding:0 5px;margin-right:2px;vertical-align:2px;line-height:1;text-decoration:none;
 white-space:nowrap;font-variant-numeric:tabular-nums}
.z{background:var(--z);border-radius:2px}
.pagebreak{display:flex;align-items:center;gap:10px;color:var(--mute);font-size:11px;
 font-weight:600;letter-spacing:.06em;text-transform:uppercase;line-height:1.6;margin:4px 0}
.pagebreak::before,.pagebreak::after{content:"";flex:1;border-top:1px dashed #cbd5e1}
"""
ANSWER_CSS += "".join(f".z{i}{{--z:{c}}}" for i, c in enumerate(ZOOM_SCALE))
