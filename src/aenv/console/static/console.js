// The aenv console: views over the JSON API (X-API-Key from sessionStorage), refreshed every 2 s.
const POLL_MS = 2000;
const ENVD_PORT = "49983";
const main = document.getElementById("main");
let key = sessionStorage.getItem("aenv-key");
let current = null; // {render, stop?}
let timer = null;

// Elements built with textContent only: API data never becomes markup.
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value);
  }
  for (const child of children.flat()) el.append(child instanceof Node ? child : String(child ?? ""));
  return el;
}

function notice(text) { document.getElementById("notice").textContent = text || ""; }

async function api(method, path, body) {
  const headers = { "X-API-Key": key };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (response.status === 401) { logout(); throw new Error("invalid API key"); }
  if (!response.ok) throw new Error((await response.json().catch(() => ({}))).message || `HTTP ${response.status}`);
  return response.status === 204 ? null : response.json();
}

async function act(what, fn) {
  try { await fn(); notice(""); refresh(); } catch (error) { notice(`${what}: ${error.message}`); }
}

function ago(iso) {
  const s = Math.round((Date.now() - Date.parse(iso)) / 1000);
  return s < 120 ? `${s} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
}

function table(columns, rows) {
  return h("table", {}, h("tr", {}, columns.map((c) => h("th", {}, c))), rows);
}

// -- sandboxes ------------------------------------------------------------------------------------

const filters = { state: "", template: "", metadata: "" };

function sandboxActions(s, tag = "td") {
  const id = s.sandboxID;
  const path = `/sandboxes/${id}`;
  const running = s.state === "running";
  return h(tag, { class: "actions" },
    running ? h("button", { onclick: () => act("pause", () => api("POST", `${path}/pause`)) }, "Pause")
            : h("button", { onclick: () => act("resume", () => api("POST", `${path}/resume`, {})) }, "Resume"),
    h("button", { onclick: () => { const count = Number(prompt("Fork how many?", "1"));
      if (count) act("fork", () => api("POST", `${path}/fork`, { count })); } }, "Fork"),
    h("button", { onclick: () => act("snapshot", () => api("POST", `${path}/snapshots`, {})) }, "Snapshot"),
    h("button", { onclick: () => { const timeout = Number(prompt("Seconds from now until the timeout", "300"));
      if (timeout) act("set timeout", () => api("POST", `${path}/timeout`, { timeout })); } }, "Timeout"),
    h("button", { onclick: () => confirm(`Kill ${id}?`) && act("kill", () => api("DELETE", path)) }, "Kill"));
}

function sandboxesView() {
  const body = h("tbody");
  const input = (name, placeholder) => h("input", { placeholder, value: filters[name],
    onchange: (e) => { filters[name] = e.target.value; refresh(); } });
  const state = h("select", { onchange: (e) => { filters.state = e.target.value; refresh(); } },
    ["", "running", "paused"].map((v) => h("option", { value: v }, v || "any state")));
  state.value = filters.state;
  main.replaceChildren(
    h("div", { class: "filters" }, state, input("template", "template"), input("metadata", "metadata key=value")),
    table(["Sandbox", "Template", "State", "Node", "Age", "TTL left", "vCPU / MiB", "Metadata", ""], body));
  return async () => {
    const query = new URLSearchParams({ limit: "100" });
    if (filters.state) query.set("state", filters.state);
    if (filters.template) query.set("template", filters.template);
    if (filters.metadata) query.set("metadata", filters.metadata);
    const list = await api("GET", `/v2/sandboxes?${query}`);
    body.replaceChildren(...list.map((s) => h("tr", { "data-id": s.sandboxID },
      h("td", {}, h("a", { onclick: () => show(sandboxView, s.sandboxID) }, s.sandboxID)),
      h("td", {}, s.alias || s.templateID),
      h("td", { class: `state-${s.state}` }, s.state),
      h("td", {}, s.clientID),
      h("td", {}, ago(s.startedAt)),
      h("td", {}, s.state === "running" ? `${Math.max(0, Math.round((Date.parse(s.endAt) - Date.now()) / 1000))} s` : "–"),
      h("td", {}, `${s.cpuCount} / ${s.memoryMB}`),
      h("td", {}, Object.entries(s.metadata || {}).map(([k, v]) => `${k}=${v}`).join(" ")),
      sandboxActions(s))));
  };
}

// -- one sandbox ----------------------------------------------------------------------------------

function chart(samples) {
  // The last ten minutes, by sample time: now is the right edge.
  const w = 600, hgt = 160, span = 600, now = Date.now() / 1000;
  const last = samples.filter((s) => now - s.timestampUnix <= span);
  const x = (s) => Math.min(w - 4, Math.max(4, w - ((now - s.timestampUnix) / span) * w));
  const svgEl = (tag, attrs) => {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, value);
    return el;
  };
  // A line over the samples, and a dot on each so the first sample shows before there is a line.
  const line = (value, color) => {
    const points = last.map((s) => [x(s), hgt - value(s) * (hgt - 8) - 4]);
    const g = svgEl("g", {});
    g.append(svgEl("polyline", { points: points.map((p) => p.join(",")).join(" "), fill: "none", stroke: color, "stroke-width": "2" }),
      ...points.map(([x, y]) => svgEl("circle", { cx: x, cy: y, r: "3", fill: color })));
    return g;
  };
  const svg = svgEl("svg", { class: "chart", viewBox: `0 0 ${w} ${hgt}`, preserveAspectRatio: "none" });
  svg.append(line((s) => s.cpuUsedPct / 100, "#0969da"), line((s) => s.memTotal ? s.memUsed / s.memTotal : 0, "#bf3989"));
  const newest = samples[samples.length - 1];
  const legend = h("div", { class: "legend" },
    h("span", { style: "color:#0969da" }, `CPU ${newest ? newest.cpuUsedPct.toFixed(1) : "–"} %`),
    h("span", { style: "color:#bf3989" }, `memory ${newest ? Math.round(newest.memUsed / 1048576) : "–"} / ${newest ? Math.round(newest.memTotal / 1048576) : "–"} MiB`),
    h("span", {}, "last 10 min"));
  return [svg, legend];
}

function openTerminal(el, id, status) {
  const term = new Terminal({ fontSize: 13, cursorBlink: true, convertEol: false });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(el);
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${scheme}://${location.host}/console/terminal/${id}`);
  ws.binaryType = "arraybuffer";
  const send = (message) => ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify(message));
  ws.onopen = () => ws.send(JSON.stringify({ apiKey: key, cols: term.cols, rows: term.rows }));
  ws.onmessage = (event) => {
    if (typeof event.data !== "string") { term.write(new Uint8Array(event.data)); return; }
    const m = JSON.parse(event.data);
    status.textContent = m.type === "exit" ? `shell exited with ${m.code}` : m.text || m.message || "";
  };
  ws.onclose = () => { if (!status.textContent) status.textContent = "disconnected"; };
  term.onData((data) => send({ type: "input", data }));
  term.onResize(({ cols, rows }) => send({ type: "resize", cols, rows }));
  const observer = new ResizeObserver(() => fit.fit());
  observer.observe(el);
  term.focus();
  return () => { observer.disconnect(); ws.close(); term.dispose(); };
}

function envdHeaders(id, token) {
  const headers = { "E2b-Sandbox-Id": id, "E2b-Sandbox-Port": ENVD_PORT, Authorization: `Basic ${btoa("user:")}` };
  if (token) headers["X-Access-Token"] = token;
  return headers;
}

async function listDir(id, token, path) {
  const response = await fetch("/filesystem.Filesystem/ListDir", { method: "POST",
    headers: { ...envdHeaders(id, token), "Content-Type": "application/json", "Connect-Protocol-Version": "1" },
    body: JSON.stringify({ path, depth: 1 }) });
  const body = await response.json();
  if (!response.ok) throw new Error(body.message || `HTTP ${response.status}`);
  return (body.entries || []).sort((a, b) => a.name.localeCompare(b.name));
}

async function download(id, token, entry) {
  const response = await fetch(`/files?${new URLSearchParams({ path: entry.path, username: "user" })}`,
    { headers: envdHeaders(id, token) });
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  const link = h("a", { href: URL.createObjectURL(await response.blob()), download: entry.name });
  link.click();
  URL.revokeObjectURL(link.href);
}

function filesSection(id, token) {
  const list = h("tbody"), where = h("input", { value: "/home/user", size: "40" });
  const open = async (path) => {
    where.value = path;
    try {
      const parent = path.replace(/\/[^/]+\/?$/, "") || "/";
      const entries = await listDir(id, token, path);
      list.replaceChildren(h("tr", {}, h("td", {}, h("a", { onclick: () => open(parent) }, "..")), h("td")),
        ...entries.map((e) => h("tr", {},
          h("td", {}, e.type === "FILE_TYPE_DIRECTORY" ? h("a", { onclick: () => open(e.path) }, `${e.name}/`)
            : h("a", { onclick: () => download(id, token, e).catch((err) => notice(err.message)) }, e.name)),
          h("td", {}, e.type === "FILE_TYPE_DIRECTORY" ? "" : `${e.size} B`))));
    } catch (error) { list.replaceChildren(h("tr", {}, h("td", { class: "error" }, error.message))); }
  };
  return [h("section", {}, h("h2", {}, "Files"),
    h("div", { class: "filters" }, where, h("button", { onclick: () => open(where.value) }, "List")),
    table(["Name", "Size"], list)), open];
}

function sandboxView(id) {
  const head = h("div", { class: "head" }), metrics = h("div"), log = h("pre", { class: "log" });
  const termEl = h("div", { id: "terminal" }), termStatus = h("span", { class: "legend" });
  let logStart = 0, closeTerminal = null, files = null;
  main.replaceChildren(head, h("div", { class: "grid" },
    h("section", {}, h("h2", {}, "Terminal ", termStatus), termEl),
    h("section", {}, h("h2", {}, "CPU and memory"), metrics),
    h("section", {}, h("h2", {}, "Serial log"), log)));
  const render = async () => {
    const s = await api("GET", `/sandboxes/${id}`);
    head.replaceChildren(h("a", { onclick: () => show(sandboxesView) }, "← sandboxes"),
      h("strong", {}, id), h("span", { class: `state-${s.state}` }, s.state), h("span", {}, s.alias || s.templateID),
      h("span", {}, `node ${s.clientID}`),
      sandboxActions(s, "span"));
    if (!closeTerminal && s.state === "running") closeTerminal = openTerminal(termEl, id, termStatus);
    if (!files && s.state === "running") {
      const [section, open] = filesSection(id, s.envdAccessToken);
      main.querySelector(".grid").append(section);
      files = open;
      open("/home/user");
    }
    metrics.replaceChildren(...chart(await api("GET", `/sandboxes/${id}/metrics`)));
    const logs = await api("GET", `/sandboxes/${id}/logs?start=${logStart}&limit=1000`);
    if (logs.logs.length) {
      logStart += logs.logs.length;
      log.append(logs.logs.map((l) => l.line).join("\n") + "\n");
      log.scrollTop = log.scrollHeight;
    }
  };
  return Object.assign(render, { stop: () => closeTerminal && closeTerminal() });
}

// -- nodes and templates --------------------------------------------------------------------------

// A gateway's /nodes has capacity, use and cached templates; a node's own, its allocations.
function nodeRow(n) {
  const used = n.usage ?? { cpuCount: n.metrics?.allocatedCPU, memoryMB: Math.round((n.metrics?.allocatedMemoryBytes ?? 0) / 1048576) };
  const of = (value, total) => (total === undefined ? `${value ?? ""}` : `${value} / ${total}`);
  return h("tr", {},
    h("td", {}, n.id), h("td", {}, n.status), h("td", {}, n.version), h("td", {}, n.address ?? ""),
    h("td", {}, n.sandboxCount), h("td", {}, n.sandboxPausedCount ?? ""),
    h("td", {}, of(used.cpuCount, n.capacity?.cpuCount)), h("td", {}, of(used.memoryMB, n.capacity?.memoryMB)),
    h("td", {}, (n.cachedBuilds ?? []).length));
}

function nodesView() {
  const body = h("tbody");
  main.replaceChildren(table(["Node", "Status", "Version", "Address", "Running", "Paused", "vCPU used", "MiB used", "Cached templates"], body));
  return async () => body.replaceChildren(...(await api("GET", "/nodes")).map(nodeRow));
}

function templatesView() {
  const body = h("tbody");
  main.replaceChildren(table(["Template", "Names", "Status", "vCPU / MiB", "Created", ""], body));
  return async () => {
    const templates = await api("GET", "/templates");
    body.replaceChildren(...templates.map((t) => h("tr", {},
      h("td", {}, t.templateID), h("td", {}, (t.names || []).join(", ")), h("td", {}, t.buildStatus),
      h("td", {}, `${t.cpuCount} / ${t.memoryMB}`), h("td", {}, `${ago(t.createdAt)} ago`),
      h("td", { class: "actions" }, h("button", { onclick: () => confirm(`Delete template ${t.templateID}?`)
        && act("delete", () => api("DELETE", `/templates/${t.templateID}`)) }, "Delete")))));
  };
}

// -- navigation -----------------------------------------------------------------------------------

async function refresh() {
  if (!current) return;
  try { await current(); } catch (error) { notice(error.message); }
}

function show(view, ...args) {
  if (current?.stop) current.stop();
  clearInterval(timer);
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("active", b.dataset.view === view.name.replace("View", "")));
  current = view(...args);
  refresh();
  timer = setInterval(refresh, POLL_MS);
}

function logout() {
  sessionStorage.removeItem("aenv-key");
  key = null;
  if (current?.stop) current.stop();
  clearInterval(timer);
  current = null;
  document.getElementById("app").hidden = true;
  document.getElementById("login").hidden = false;
}

function start() {
  document.getElementById("login").hidden = true;
  document.getElementById("app").hidden = false;
  show(sandboxesView);
}

const views = { sandboxes: sandboxesView, nodes: nodesView, templates: templatesView };
document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => show(views[b.dataset.view])));
document.getElementById("logout").addEventListener("click", logout);
document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  key = document.getElementById("key").value;
  const check = await fetch("/v2/sandboxes?limit=1", { headers: { "X-API-Key": key } });
  if (check.status === 401) { document.getElementById("login-error").textContent = "invalid API key"; return; }
  sessionStorage.setItem("aenv-key", key);
  start();
});
if (key) start(); else logout();
