// ringlab dashboard: draws the server-built Plotly figures, makes the results table sortable and
// filterable, and keeps the sweep page live from the sweep's server-sent events.
"use strict";

const ringlab = (() => {
  const PLOT_CONFIG = { responsive: true, displaylogo: false };

  function readJson(scriptId) {
    return JSON.parse(document.getElementById(scriptId).textContent);
  }

  function draw(divId, figure) {
    let div = document.getElementById(divId);
    const charts = document.querySelector("section.charts");
    if (!div && charts && divId.startsWith("chart-")) { // a panel its runs filled since, live
      div = document.createElement("div");
      div.className = "chart";
      div.id = divId;
      charts.appendChild(div);
    }
    if (!div) return;
    if (figure.layout && figure.layout.height) div.style.height = `${figure.layout.height}px`;
    Plotly.react(div, figure.data, figure.layout, PLOT_CONFIG);
  }

  function drawFromScript(divId, scriptId) {
    draw(divId, readJson(scriptId));
  }

  // ---- formatting (mirrors the server's Jinja filters) ----
  function si(v, unit) {
    if (v === null || v === undefined) return "—";
    const steps = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [f, p] of steps) {
      if (Math.abs(v) >= f) return `${(v / f).toPrecision(3)} ${p}${unit || ""}`;
    }
    return `${Number(v).toPrecision(3)} ${unit || ""}`.trim();
  }

  function nbytes(v) {
    if (v === null || v === undefined) return "—";
    const steps = [[2 ** 40, "TiB"], [2 ** 30, "GiB"], [2 ** 20, "MiB"], [2 ** 10, "KiB"]];
    for (const [f, u] of steps) {
      if (Math.abs(v) >= f) return `${(v / f).toFixed(2)} ${u}`;
    }
    return `${v} B`;
  }

  function secs(v) {
    if (v === null || v === undefined) return "—";
    return v < 1 ? `${(v * 1e3).toPrecision(3)} ms` : `${v.toPrecision(3)} s`;
  }

  function int(v) {
    return v === null || v === undefined ? "—" : Number(v).toLocaleString("en-US");
  }

  function pct(v) {
    return v === null || v === undefined ? "—" : `${(v * 100).toFixed(1)}%`;
  }

  // Text made safe for HTML content AND for quoted attribute values (title="..."): the five
  // characters that can end an element or an attribute. innerHTML serialization escapes only
  // &, < and >, so a quote in a run's error would have closed the attribute.
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  function esc(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // Columns of the results table: key, header, how to show a value, sort key.
  function ratio(v) {
    return v === null || v === undefined ? "—" : `${v.toFixed(2)}x`;
  }

  // A number above its physical limit is never shown plainly: a mark whose title says why.
  function marks(r, field) {
    return (r.flags || []).filter((f) => f.field === field).map((f) =>
      ` <span class="flag" data-code="${esc(f.code)}" title="${esc(f.text)}">⚠</span>`).join("");
  }

  // A ratio with its interval from both runs' noise, "within noise" when it holds 1.0, marks.
  function noisy(r, field, show) {
    const v = r[field];
    if (v === null || v === undefined) return "—";
    let text = show(v);
    const lo = r[`${field}_lo`], hi = r[`${field}_hi`];
    if (lo !== null && lo !== undefined && hi !== null && hi !== undefined) {
      text += ` <span class="muted">(${show(lo)}-${show(hi)})</span>`;
    }
    if ((r.within_noise || []).includes(field)) text += ' <span class="within-noise">within noise</span>';
    return text + marks(r, field);
  }

  function perRank(list) {
    return list && list.length ? list.map(nbytes).join(" / ") : "—";
  }

  const COLUMNS = [
    ["run_id", "run", (r) => `<a href="/runs/${r.run_id}">${r.run_id}</a>`],
    ["label", "configuration", (r) => esc(r.label)],
    ["length", "length", (r) => int(r.length) + (r.searched ? " (max)" : "")],
    ["world_size", "W", (r) => r.world_size],
    ["status", "status", (r) => `<span class="state state-${esc(r.status)}">${esc(r.status)}</span>`],
    ["median_s", "time (median interval)", (r) => (r.median_s === null ? "—"
      : `${secs(r.median_s)} <span class="muted" title="p10-p90 ${secs(r.p10_s)}-${secs(r.p90_s)}; ${r.iterations} iterations">`
        + (r.median_lo_s === null ? `(no interval: ${r.iterations} iteration)`
          : `(${secs(r.median_lo_s)}-${secs(r.median_hi_s)})`) + "</span>")],
    ["tokens_per_s", "tokens/s", (r) => si(r.tokens_per_s)],
    ["tflops_per_s", "TFLOP/s", (r) => (r.tflops_per_s === null ? "—" : r.tflops_per_s.toFixed(4))],
    ["peak_fraction", "of dense peak",
      (r) => (r.peak_fraction === null ? (r.status === "succeeded" ? "no reference peak" : "—")
        : pct(r.peak_fraction))],
    ["exposed_comm_share", "exposed comm", (r) => pct(r.exposed_comm_share)],
    ["link_probe_bytes_per_s", "ring link", (r) => (r.link_probe_bytes_per_s === null ? "—"
      : `${nbytes(r.link_probe_bytes_per_s)}/s <span class="muted">(${esc(r.link_kind || "kind unknown")})</span>`)],
    ["peak_memory_bytes", "peak mem per rank", (r) => perRank(r.rank_peak_bytes) + marks(r, "peak_memory_bytes")],
    ["floor_bytes", "floor / rank", (r) => nbytes(r.floor_bytes)],
    ["max_seq_len", "max len", (r) => int(r.max_seq_len)],
    ["baseline", "baseline", (r) => (r.baseline ? `<a href="/runs/${r.baseline_run_id}">${esc(r.baseline)}</a>` : "—")],
    ["speedup", "speedup", (r) => noisy(r, "speedup", ratio)],
    ["memory_ratio", "memory ratio", (r) => ratio(r.memory_ratio)],
    ["efficiency", "efficiency", (r) => noisy(r, "efficiency", pct)],
    ["outcome", "outcome", (r) => esc(r.outcome)],
    ["error", "error", (r) => (r.error ? `<span class="err" title="${esc(r.error)}">${esc(r.error.split("\n")[0].slice(0, 80))}</span>` : "")],
  ];

  // What a researcher came for is shown; the rest is one click away in the column chooser.
  const DEFAULT_COLUMNS = new Set(["run_id", "label", "length", "world_size", "status", "median_s",
    "tokens_per_s", "peak_memory_bytes", "speedup"]);

  function shownColumns(state) {
    return COLUMNS.filter(([key]) => state.columns.has(key));
  }

  function columnChooser(table, state) {
    const box = document.getElementById("column-options");
    if (!box) return;
    box.innerHTML = COLUMNS.map(([key, title]) => `<label><input type="checkbox" value="${key}"`
      + `${state.columns.has(key) ? " checked" : ""}> ${esc(title)}</label>`).join("");
    box.addEventListener("change", (ev) => {
      const key = ev.target.value;
      if (ev.target.checked) state.columns.add(key); else state.columns.delete(key);
      resultsTable(table, state);
    });
  }

  function searchText(r) {
    return [r.run_id, r.label, `seq=${r.length}`, r.length, `W=${r.world_size}`, r.parallel,
      r.dtype, r.mode, r.causal ? "causal" : "", r.status, r.device || "", r.error || ""]
      .join(" ").toLowerCase();
  }

  function compare(a, b) {
    if (a === b) return 0;
    if (a === null || a === undefined) return 1; // missing values last
    if (b === null || b === undefined) return -1;
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b), "en", { numeric: true });
  }

  function resultsTable(table, state) {
    const head = table.tHead;
    const columns = shownColumns(state);
    head.innerHTML = "<tr>" + columns.map(([key, title]) => {
      const mark = state.sortKey === key ? (state.sortDir > 0 ? " ▲" : " ▼") : "";
      return `<th data-key="${key}" aria-sort="${state.sortKey === key ? (state.sortDir > 0 ? "ascending" : "descending") : "none"}">${title}${mark}</th>`;
    }).join("") + "</tr>";
    const needle = state.filter.trim().toLowerCase();
    const terms = needle ? needle.split(/\s+/) : [];
    let rows = state.rows.filter((r) => (!state.status || r.status === state.status)
      && terms.every((t) => searchText(r).includes(t)));
    rows = rows.slice().sort((a, b) => state.sortDir * compare(a[state.sortKey], b[state.sortKey]));
    table.tBodies[0].innerHTML = rows.map((r) =>
      `<tr class="row-${esc(r.status)}">` + columns.map(([key, , show]) => `<td class="col-${key}">${show(r)}</td>`).join("") + "</tr>"
    ).join("");
    document.getElementById("row-count").textContent = `${rows.length} of ${state.rows.length} runs`;
    document.getElementById("results-empty").hidden = state.rows.length > 0;
  }

  function renderSummary(sweep) {
    const bar = document.querySelector("#progress .bar");
    const label = document.querySelector("#progress span");
    if (bar) bar.style.width = `${(100 * sweep.progress).toFixed(1)}%`;
    if (label) label.textContent = `${sweep.done}/${sweep.total}`;
    const counts = document.getElementById("counts");
    const parts = Object.entries(sweep.counts).map(([s, n]) =>
      `<span class="state state-${esc(s)}">${esc(s)} ${n}</span>`);
    counts.innerHTML = `<span class="counts">${parts.join(" ") || '<span class="muted">no runs</span>'}</span>`;
    document.getElementById("live").textContent = sweep.finished ? "ended" : "live";
  }

  // The page's summary from an event's sweep (the API's SweepOut names two fields the other way).
  function summaryOf(s) {
    const counts = {};
    for (const [state, n] of Object.entries(s.counts)) if (n) counts[state] = n;
    return { ...s, counts, done: s.finished, finished: s.done };
  }

  function drawFigures(figures) {
    for (const [id, fig] of Object.entries(figures || {})) draw(id, fig);
  }

  // Rows from dashboard.json into the table: a changed run replaces its row; a new one is added
  // when the page holds the whole sweep (a large sweep's later pages come by "more").
  function patch(payload, state) {
    const at = new Map(state.rows.map((r, i) => [r.run_id, i]));
    for (const row of payload.rows) {
      if (at.has(row.run_id)) state.rows[at.get(row.run_id)] = row;
      else if (state.whole) state.rows.push(row);
    }
    renderSummary(payload.sweep);
    drawFigures(payload.figures);
    resultsTable(document.getElementById("results"), state);
  }

  function showMore(state) {
    const more = document.getElementById("more");
    more.hidden = state.next === null;
    if (!state.whole) {
      document.getElementById("partial").textContent =
        `${state.rows.length.toLocaleString("en")} of ${state.total.toLocaleString("en")} runs loaded`;
    }
  }

  function sweepPage(sweepId) {
    const payload = readJson("payload");
    const state = {
      rows: payload.rows, next: payload.next, whole: payload.whole, total: payload.sweep.total,
      sortKey: "run_id", sortDir: 1, filter: "", status: "", columns: new Set(DEFAULT_COLUMNS),
    };
    const table = document.getElementById("results");
    columnChooser(table, state);
    renderSummary(payload.sweep);
    drawFigures(payload.figures);
    resultsTable(table, state);
    showMore(state);

    table.tHead.addEventListener("click", (ev) => {
      const th = ev.target.closest("th");
      if (!th) return;
      const key = th.dataset.key;
      state.sortDir = state.sortKey === key ? -state.sortDir : 1;
      state.sortKey = key;
      resultsTable(table, state);
    });
    document.getElementById("filter").addEventListener("input", (ev) => {
      state.filter = ev.target.value;
      resultsTable(table, state);
    });
    document.getElementById("status-filter").addEventListener("change", (ev) => {
      state.status = ev.target.value;
      resultsTable(table, state);
    });
    const more = document.getElementById("more");
    more.addEventListener("click", async () => {
      more.disabled = true; // one page at a time: a second click must not load it twice
      try {
        const resp = await fetch(`/sweeps/${sweepId}/dashboard.json?after=${state.next}`, { cache: "no-store" });
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        const page = await resp.json();
        state.rows = state.rows.concat(page.rows);
        state.next = page.next;
        resultsTable(table, state);
        showMore(state);
      } catch (err) {
        document.getElementById("partial").textContent = `loading more failed (${err.message}): try again`;
      } finally {
        more.disabled = false;
      }
    });

    if (payload.sweep.finished) return;
    // Live: a progress event carries the counts; a run event names a run whose row is then
    // fetched, with the others that changed, at most once a second: never the whole sweep.
    // One fetch at a time; ids whose fetch failed go back to be asked for again.
    const changed = new Set();
    let pending = null;
    const flush = () => {
      if (pending) return;
      pending = setTimeout(async () => {
        const ids = [...changed].slice(0, 200);
        ids.forEach((id) => changed.delete(id));
        try {
          if (ids.length) {
            const resp = await fetch(`/sweeps/${sweepId}/dashboard.json?runs=${ids.join(",")}`, { cache: "no-store" });
            if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
            patch(await resp.json(), state);
          }
        } catch (err) {
          ids.forEach((id) => changed.add(id));
          document.getElementById("live").textContent = `live update failed (${err.message}); retrying`;
        } finally {
          pending = null;
          if (changed.size) flush();
        }
      }, 1000);
    };
    const events = new EventSource(`/api/v1/sweeps/${sweepId}/events`);
    events.addEventListener("run", (ev) => {
      const id = JSON.parse(ev.data).id;
      if (state.whole || state.rows.some((r) => r.run_id === id)) {
        changed.add(id);
        flush();
      }
    });
    events.addEventListener("progress", (ev) => renderSummary(summaryOf(JSON.parse(ev.data))));
    events.addEventListener("end", (ev) => {
      events.close();
      const data = JSON.parse(ev.data);
      if (!data.deleted) renderSummary(summaryOf(data));
      flush();
    });
    events.onerror = () => {
      document.getElementById("live").textContent = "live updates lost: reload the page";
      events.close();
    };
  }

  return { draw, drawFromScript, sweepPage };
})();
