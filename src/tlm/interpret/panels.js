// The panels that `tlm serve`'s page and `tlm inspect`'s page share, inlined into each where
// it says PANELS: the next-token distribution under temperature, top-k and top-p, filtered
// in tlm's order (tlm.generate.sampling.process_logits), and one attention head step by
// step (eq. 9.11-9.13). docs/serve.md lists the ids and data attributes they draw.
const panels = (() => {
  "use strict";
  const SHADES = 12;  // light (low) to dark (high) in one hue: readable in grey-scale

  const style = document.createElement("style");
  style.textContent = `
    #sliders { display: contents; }
    .dist td, .dist th { padding: 1px 4px; text-align: right; font-family: monospace; white-space: pre; }
    .dist td.text { text-align: left; }
    .dist tr.cut td { color: #999; text-decoration: line-through; }
    .dist tr.sampled td { font-weight: bold; }
    .bar { display: inline-block; height: .8em; background: #444; vertical-align: middle; }
    .panels { display: flex; flex-wrap: wrap; gap: 1em 1.6em; align-items: flex-start; }
    .panels figure { margin: 0; max-width: 100%; overflow: auto; }
    .panels figcaption { font-weight: 600; margin-bottom: .3em; }
    table.steps { border-collapse: collapse; table-layout: fixed; }
    .steps td { width: var(--cell); height: var(--cell); min-width: var(--cell); padding: 0;
                border: 1px solid #eee; text-align: center; font: 9px monospace; overflow: hidden; }
    .steps td.masked { background: repeating-linear-gradient(45deg, #ddd 0 2px, #fff 2px 5px); }
    .steps tr.query td { border-top: 2px solid #b35806; border-bottom: 2px solid #b35806; }
    .steps th { font: 10px monospace; font-weight: normal; padding: 0 3px; white-space: pre;
                overflow: hidden; max-width: 9em; text-align: right; }
    .steps th.key { writing-mode: vertical-rl; transform: rotate(180deg); max-height: 7em;
                    padding: 3px 0; text-align: left; }
    .contrib td { padding: 1px 6px; font-family: monospace; text-align: right; white-space: pre; }
    .contrib td.text { text-align: left; }
  ` + [...Array(SHADES).keys()].map((s) => `.steps td.s${s} { background: ` +
    `hsl(210, 55%, ${(96 - 62 * s / (SHADES - 1)).toFixed(1)}%)${s > 6 ? "; color: #fff" : ""} }`)
    .join("\n");
  document.head.appendChild(style);

  function show(text) {  // whitespace made visible, as a token reads
    return JSON.stringify(text).slice(1, -1);
  }

  function escape(text) {
    return text.replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]);
  }

  function sum(values) {
    let total = 0;
    for (const v of values) total += v;
    return total;
  }

  function normalize(weights) {
    const total = sum(weights);
    return weights.map((w) => w / total);
  }

  function percent(q) { return (100 * q).toFixed(2) + "%"; }

  // Each stage's probabilities over the whole vocabulary, from log-probabilities sorted
  // largest first: temperature (eq. 10.49), then top-k, then top-p (eq. 10.47).
  function filtered(logprobs, temperature, k, p) {
    const n = logprobs.length;
    const tempered = temperature === 0  // the limit τ -> 0: all mass on the argmax
      ? logprobs.map((_, i) => (i === 0 ? 1 : 0))
      : normalize(logprobs.map((lp) => Math.exp((lp - logprobs[0]) / temperature)));
    let topk = tempered;
    if (k > 0 && temperature > 0) {  // keep logits >= the k-th largest (ties stay)
      const kth = logprobs[Math.min(k, n) - 1];
      topk = normalize(tempered.map((q, i) => (logprobs[i] >= kth ? q : 0)));
    }
    let topp = topk;
    if (p < 1) {  // keep the smallest set whose mass reaches p; the likeliest always stays
      let before = 0;
      topp = normalize(topk.map((q) => { const keep = before < p; before += q; return keep ? q : 0; }));
    }
    return [tempered, topk, topp];
  }

  // The sliders #temperature, #top-k (0 = off) and #top-p (1 = off), read as numbers.
  function knobs() {
    const value = (id) => Number(document.getElementById(id).value);
    return {temperature: value("temperature"), k: value("top-k"), p: value("top-p")};
  }

  // The three sliders, drawn into #sliders (temperature from its data-temperature), each
  // value printed beside it (#...-value), now and on every input event, after which
  // `changed` runs.
  function sliders(changed) {
    const host = document.getElementById("sliders");
    const slider = (id, label, min, max, step, value) => `<label>${label} <input id="${id}" ` +
      `type="range" min="${min}" max="${max}" step="${step}" value="${value}"> ` +
      `<output id="${id}-value" for="${id}"></output></label>`;
    host.innerHTML = slider("temperature", "temperature τ", 0, 2, 0.05, host.dataset.temperature) +
      slider("top-k", "top-k", 0, 100, 1, 0) + slider("top-p", "top-p", 0.01, 1, 0.01, 1);
    const print = () => {
      const {temperature, k, p} = knobs(), out = (id) => document.getElementById(`${id}-value`);
      out("temperature").textContent = temperature.toFixed(2) + (temperature === 0 ? " greedy" : "");
      out("top-k").textContent = k === 0 ? "off" : String(k);
      out("top-p").textContent = p === 1 ? "off" : p.toFixed(2);
    };
    for (const id of ["temperature", "top-k", "top-p"]) {
      document.getElementById(id).addEventListener("input", () => { print(); changed(); });
    }
    print();
  }

  const DIST_HEAD = "<thead><tr><th>rank</th><th>token</th><th>p</th><th>after τ</th>" +
    "<th>top-k</th><th>top-p</th><th></th></tr></thead><tbody></tbody>";

  // The distribution `dist` ({top: [{id, token}], logprobs, token?: {rank, token, logprob}})
  // under the knobs, in `table`; returns a sentence on what can be drawn.
  function distribution(table, dist, {temperature, k, p}) {
    if (!table.tBodies.length) table.innerHTML = DIST_HEAD;
    const stages = filtered(dist.logprobs, temperature, k, p);
    const sampled = dist.token ? dist.token.rank : -1;
    const rows = dist.top.map((t, r) => {
      const values = [Math.exp(dist.logprobs[r]), ...stages.map((s) => s[r])];
      const tr = document.createElement("tr");
      tr.dataset.token = t.token;
      tr.dataset.id = t.id;
      tr.dataset.p = String(values[3]);
      if (values[3] === 0) tr.className = "cut";
      if (r === sampled) tr.classList.add("sampled");
      [String(r + 1), JSON.stringify(t.token), ...values.map(percent)].forEach((text, c) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (c === 1) td.className = "text";
        tr.appendChild(td);
      });
      const bar = document.createElement("td");
      bar.className = "text";
      bar.innerHTML = `<span class="bar" style="width:${(80 * values[3]).toFixed(1)}px"></span>`;
      if (r === sampled) bar.append(" ◀ sampled");
      tr.appendChild(bar);
      return tr;
    });
    const model = dist.logprobs.map(Math.exp);  // the mass of every token past the top rows
    const rest = [model, ...stages].map((values) => sum(values.slice(dist.top.length)));
    const others = document.createElement("tr");
    others.className = "others";
    others.dataset.rest = String(rest[3]);
    const count = dist.logprobs.length - dist.top.length;
    others.innerHTML = `<td></td><td class="text">${count} others</td>` +
      rest.map((q) => `<td>${percent(q)}</td>`).join("") + "<td></td>";
    table.tBodies[0].replaceChildren(...rows, others);
    const kept = stages[2].filter((q) => q > 0).length;
    let note = `${kept} of ${dist.logprobs.length} tokens can be drawn.`;
    if (dist.token) {
      const r = dist.token.rank, q = stages[2][r];
      note += ` The token sampled here, ${JSON.stringify(dist.token.token)}, ranks ${r + 1}: ` +
        `p = ${percent(Math.exp(dist.token.logprob))} as the model gave it, ` +
        (q > 0 ? `${percent(q)} with these settings.` : "cut with these settings.");
    }
    return note;
  }

  const FIGURES = `
    <figure><figcaption>Scores q<sub>i</sub>·k<sub>j</sub>/√d<sub>k</sub> (eq. 9.11)</figcaption>
      <table id="scores" class="steps"></table></figure>
    <figure><figcaption>After the causal mask: −∞ where j &gt; i (eq. 9.11, Fig. 9.9)</figcaption>
      <table id="masked" class="steps"></table></figure>
    <figure><figcaption>Pattern α<sub>ij</sub> = softmax of each row (eq. 9.12)</figcaption>
      <table id="pattern" class="steps"></table></figure>
    <figure><figcaption>Output of query <span id="contrib-query"></span> = Σ<sub>j</sub> α<sub>ij</sub> v<sub>j</sub>:
      ‖α<sub>ij</sub> v<sub>j</sub>‖ per source (eq. 9.13)</figcaption>
      <table id="contrib" class="contrib"></table></figure>`;

  // One grid of values [T][T] (null: -inf) with the tokens as labels, query row marked.
  function grid(table, values, tokens, query, where) {
    const T = values.length;
    const size = Math.max(4, Math.min(30, Math.floor(520 / T)));
    let low = Infinity, high = -Infinity;
    for (const row of values) {
      for (const v of row) if (v !== null) { low = Math.min(low, v); high = Math.max(high, v); }
    }
    const scale = high > low ? (SHADES - 1) / (high - low) : 0;
    const printed = size >= 28;  // room for the number in the cell
    const head = tokens.map((t) =>
      `<th class="key" title="${escape(t)}">${size >= 12 ? escape(show(t)) : ""}</th>`);
    const html = [`<tr><th></th>${head.join("")}</tr>`];
    values.forEach((row, i) => {
      html.push(`<tr${i === query ? ' class="query"' : ""}><th>${escape(show(tokens[i]))}</th>`);
      row.forEach((v, j) => {
        const masked = v === null;
        const text = !printed ? "" : masked ? "−∞" : v.toFixed(2);
        html.push(`<td data-row="${i}" data-col="${j}" data-value="${masked ? "-Infinity" : v}" ` +
          `class="${masked ? "masked" : "s" + Math.round((v - low) * scale)}">${text}</td>`);
      });
      html.push("</tr>");
    });
    table.style.setProperty("--cell", `${size}px`);
    table.innerHTML = html.join("");
    Object.assign(table.dataset, where);
  }

  // Query i's output, source by source: α_ij, ‖v_j‖ and ‖α_ij v_j‖ for j <= i; positions
  // are printed from `first` (the window's first position in the text).
  function contributions(table, tokens, alpha, norms, contrib, i, where, first) {
    document.getElementById("contrib-query").textContent = `${first + i} (${show(tokens[i])})`;
    const high = Math.max(...contrib.slice(0, i + 1)) || 1;
    let html = "<tr><th>j</th><th>key</th><th>α_ij</th><th>‖v_j‖</th><th>‖α_ij v_j‖</th><th></th></tr>";
    for (let j = 0; j <= i; j++) {
      const v = contrib[j];
      html += `<tr><td>${first + j}</td><td class="text">${escape(show(tokens[j]))}</td>` +
        `<td>${alpha[j].toFixed(4)}</td><td>${norms[j].toFixed(3)}</td>` +
        `<td data-row="${i}" data-col="${j}" data-value="${v}">${v.toFixed(4)}</td>` +
        `<td class="text"><span class="bar" style="width:${(160 * v / high).toFixed(1)}px"></span></td></tr>`;
    }
    table.innerHTML = html;
    Object.assign(table.dataset, where);
  }

  // Draw one head: steps = {scores, masked, pattern, contrib, value_norms}, each [T][T], of
  // the tokens from position `first` on.
  function attention(tokens, steps, query, where, first = 0) {
    for (const name of ["scores", "masked", "pattern"]) {
      grid(document.getElementById(name), steps[name], tokens, query, where);
    }
    contributions(document.getElementById("contrib"), tokens, steps.pattern[query],
      steps.value_norms, steps.contrib[query], query, where, first);
  }

  // Hovering a cell writes its value into `readout`; clicking a grid row picks its query.
  function listen(readout, tokens, pick) {
    for (const name of ["scores", "masked", "pattern", "contrib"]) {
      document.getElementById(name).addEventListener("mouseover", (event) => {
        const cell = event.target.closest("td[data-row]");
        if (!cell) return;
        const i = Number(cell.dataset.row), j = Number(cell.dataset.col), t = tokens();
        readout.textContent = `${name}[${i}, ${j}] = ${cell.dataset.value}` +
          `  (query ${i} ${JSON.stringify(t[i])}, key ${j} ${JSON.stringify(t[j])})`;
      });
    }
    for (const name of ["scores", "masked", "pattern"]) {
      document.getElementById(name).addEventListener("click", (event) => {
        const cell = event.target.closest("td[data-row]");
        if (cell) pick(Number(cell.dataset.row));
      });
    }
  }

  return {show, escape, knobs, sliders, filtered, distribution, FIGURES, attention, listen};
})();
