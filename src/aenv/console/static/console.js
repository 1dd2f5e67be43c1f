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
  const text = await response.text(); // some answers have no body (204, and a build's start: 202)
  return text ? JSON.parse(text) : null;
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
let nodeIds = []; // from /nodes

// A gateway's list names each sandbox's node in `clientID`; a node's list has E2B's constant there.
function nodeName(s) {
  return nodeIds.length === 1 && !nodeIds.includes(s.clientID) ? nodeIds[0] : s.clientID;
}

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
    running ? h("button", { onclick: () => act("checkpoint", () => api("POST", `${path}/checkpoints`, {})) }, "Checkpoint") : "",
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
      h("td", { class: "node" }, nodeName(s)),
      h("td", {}, ago(s.startedAt)),
      h("td", {}, s.state === "running" ? `${Math.max(0, Math.round((Date.parse(s.endAt) - Date.now()) / 1000))} s` : "–"),
      h("td", {}, `${s.cpuCount} / ${s.memoryMB}`),
      h("td", { class: "wrap" }, Object.entries(s.metadata || {}).map(([k, v]) => `${k}=${v}`).join(" ")),
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
  const termEl = h("div", { id: "terminal" }), termStatus = h("span", { class: "legend" }), checkpoints = h("tbody");
  let logStart = 0, closeTerminal = null, files = null;
  main.replaceChildren(head, h("div", { class: "grid" },
    h("section", {}, h("h2", {}, "Terminal ", termStatus), termEl),
    h("section", {}, h("h2", {}, "CPU and memory"), metrics),
    h("section", {}, h("h2", {}, "Serial log"), log),
    h("section", { class: "checkpoints" }, h("h2", {}, "Checkpoints"),
      table(["Checkpoint", "Name", "Parent", "Taken", ""], checkpoints))));
  const render = async () => {
    const s = await api("GET", `/sandboxes/${id}`);
    head.replaceChildren(h("a", { onclick: () => show(sandboxesView) }, "← sandboxes"),
      h("strong", {}, id), h("span", { class: `state-${s.state}` }, s.state), h("span", {}, s.alias || s.templateID),
      h("span", {}, `node ${nodeName(s)}`),
      sandboxActions(s, "span"));
    if (!closeTerminal && s.state === "running") closeTerminal = openTerminal(termEl, id, termStatus);
    if (!files && s.state === "running") {
      const [section, open] = filesSection(id, s.envdAccessToken);
      main.querySelector(".grid").append(section);
      files = open;
      open("/home/user");
    }
    metrics.replaceChildren(...chart(await api("GET", `/sandboxes/${id}/metrics`)));
    // Each checkpoint's parent: the checkpoint its state came from, or the snapshot the sandbox started from.
    checkpoints.replaceChildren(...(await api("GET", `/sandboxes/${id}/checkpoints`)).reverse().map((c) =>
      h("tr", { "data-id": c.checkpointID }, h("td", {}, c.checkpointID), h("td", {}, c.name ?? ""),
        h("td", {}, c.parent ?? ""), h("td", {}, `${ago(c.createdAt)} ago`), h("td", { class: "actions" },
          h("button", { onclick: () => act("reset", () => api("POST", `/sandboxes/${id}/reset`, { checkpoint: c.checkpointID })) }, "Reset"),
          h("button", { onclick: () => act("delete", () => api("DELETE", `/sandboxes/${id}/checkpoints/${c.checkpointID}`)) }, "Delete")))));
    const logs = await api("GET", `/sandboxes/${id}/logs?start=${logStart}&limit=1000`);
    if (logs.logs.length) {
      logStart += logs.logs.length;
      log.append(logs.logs.map((l) => l.line).join("\n") + "\n");
      log.scrollTop = log.scrollHeight;
    }
  };
  return Object.assign(render, { stop: () => closeTerminal && closeTerminal() });
}

// -- nodes ----------------------------------------------------------------------------------------

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
  return async () => {
    const nodes = await api("GET", "/nodes");
    nodeIds = nodes.map((n) => n.id);
    body.replaceChildren(...nodes.map(nodeRow));
  };
}

// -- templates and builds -------------------------------------------------------------------------

// Builds started from this page, with their logs as far as read (their ids are kept for the tab).
const builds = JSON.parse(sessionStorage.getItem("aenv-builds") || "[]").map((b) => ({ ...b, status: "", lines: [] }));
const FINISHED = ["ready", "error"];

async function startBuild(form) {
  const steps = form.elements.steps.value.split("\n").map((line) => line.trim()).filter(Boolean)
    .map((command) => ({ type: "RUN", args: [command] }));
  const ticket = await api("POST", "/v3/templates", { name: form.elements.template.value.trim() });
  await api("POST", `/v2/templates/${ticket.templateID}/builds/${ticket.buildID}`,
    { fromTemplate: form.elements.from.value.trim(), steps });
  builds.unshift({ templateID: ticket.templateID, buildID: ticket.buildID, status: "waiting", lines: [] });
  sessionStorage.setItem("aenv-builds", JSON.stringify(builds.map(({ templateID, buildID }) => ({ templateID, buildID }))));
}

// The status API gives at most 100 log entries a call, from an offset: read on until it gives fewer.
async function follow(build) {
  for (;;) {
    const path = `/templates/${build.templateID}/builds/${build.buildID}/status`;
    const status = await api("GET", `${path}?logsOffset=${build.lines.length}&limit=100`);
    build.status = status.status;
    build.reason = status.reason?.message;
    build.lines.push(...status.logEntries.map((e) => `${e.timestamp.slice(11, 19)} ${e.level} [${e.step}] ${e.message}`));
    if (status.logEntries.length < 100) return;
  }
}

function buildSection(build) {
  const log = h("pre", { class: "log" }, build.lines.join("\n"));
  const section = h("section", { class: "build", "data-build": build.buildID },
    h("h2", {}, `Build of ${build.templateID} `, h("span", { class: `status status-${build.status}` }, build.status),
      h("span", { class: "legend" }, ` ${build.buildID}`)),
    build.reason ? h("p", { class: "error" }, build.reason) : "", log);
  requestAnimationFrame(() => { log.scrollTop = log.scrollHeight; });
  return section;
}

// A template's name: a built one's ID is its current build's snapshot, its tags are the name's.
const templateName = (t) => t.aliases?.[0] ?? t.templateID;

function tagCell(t, tags) {
  if (!tags) return h("td", { class: "tags" }, "–");
  const name = templateName(t);
  return h("td", { class: "tags" }, tags.map((tag) => h("span", { class: "tag", title: tag.buildID }, `${tag.tag} `,
    h("a", { title: "remove the tag", onclick: () => act("untag",
      () => api("DELETE", "/templates/tags", { name, tags: [tag.tag] })) }, "×"))),
  tags.length ? h("button", { onclick: () => { const tag = prompt(`New tag for ${name}:${tags[0].tag}`);
    if (tag) act("tag", () => api("POST", "/templates/tags", { target: `${name}:${tags[0].tag}`, tags: [tag] })); } }, "+") : "");
}

function templatesView() {
  const body = h("tbody"), running = h("div", { class: "builds" });
  const form = h("form", { class: "filters", onsubmit: (event) => { event.preventDefault();
      act("build", () => startBuild(event.target)); } },
    h("input", { name: "template", placeholder: "new template name[:tag]", required: "" }),
    h("input", { name: "from", value: "base", title: "the template it starts from" }),
    h("textarea", { name: "steps", rows: "1", cols: "60", placeholder: "commands to run, one a line" }),
    h("button", {}, "Build"));
  main.replaceChildren(form, running,
    table(["Template", "Names", "Status", "Tags", "vCPU / MiB", "Created", ""], body));
  return async () => {
    await Promise.all(builds.filter((b) => !FINISHED.includes(b.status)).map(follow));
    running.replaceChildren(...builds.map(buildSection));
    const templates = await api("GET", "/templates");
    // Tags exist for the templates built here (others answer 404).
    const tags = await Promise.all(templates.map((t) => api("GET", `/templates/${templateName(t)}/tags`).catch(() => null)));
    body.replaceChildren(...templates.map((t, i) => h("tr", { "data-id": t.templateID },
      h("td", {}, t.templateID), h("td", {}, (t.names || []).join(", ")), h("td", {}, t.buildStatus),
      tagCell(t, tags[i]), h("td", {}, `${t.cpuCount} / ${t.memoryMB}`), h("td", {}, `${ago(t.createdAt)} ago`),
      h("td", { class: "actions" }, h("button", { onclick: () => confirm(`Delete template ${templateName(t)}?`)
        && act("delete", () => api("DELETE", `/templates/${t.templateID}`)) }, "Delete")))));
  };
}

// -- snapshots and their lineage ------------------------------------------------------------------

// A tree: each snapshot under the snapshot its sandbox started from, or under the template (or a
// snapshot no longer listed) at the root.
function lineage(snapshots, templates) {
  const named = new Map(templates.map((t) => [t.templateID, (t.aliases || []).join(", ")]));
  const listed = new Set(snapshots.map((s) => s.snapshotID));
  const children = new Map();
  for (const s of [...snapshots].reverse()) { // oldest first
    const parent = s.source?.snapshotID ?? "";
    children.set(parent, [...(children.get(parent) ?? []), s]);
  }
  const branch = (s) => h("li", { "data-id": s.snapshotID },
    h("strong", {}, s.snapshotID), (s.names || []).filter((n) => n !== s.snapshotID).map((n) => ` ${n}`),
    h("span", { class: "legend" }, ` of sandbox ${s.source?.sandboxID ?? "?"}`,
      s.source?.checkpointID ? `, checkpoint ${s.source.checkpointID}` : "",
      `, ${ago(s.createdAt)} ago, ${s.cpuCount} vCPU / ${s.memoryMB} MiB`, s.durable ? "" : ", being committed"), " ",
    h("button", { onclick: () => confirm(`Delete snapshot ${s.snapshotID}?`)
      && act("delete", () => api("DELETE", `/templates/${s.snapshotID}`)) }, "Delete"),
    h("ul", {}, (children.get(s.snapshotID) ?? []).map(branch)));
  const roots = [...children.keys()].filter((parent) => !listed.has(parent));
  return h("ul", { class: "lineage" }, roots.map((root) => h("li", { class: "root" },
    h("strong", {}, root || "unknown origin"),
    h("span", { class: "legend" }, named.has(root) ? ` template ${named.get(root)}` : " (a snapshot not listed)"),
    h("ul", {}, children.get(root).map(branch)))));
}

function snapshotsView() {
  const tree = h("div");
  main.replaceChildren(h("section", {}, h("h2", {}, "Snapshots, each under what its sandbox started from"), tree));
  return async () => {
    const [snapshots, templates] = await Promise.all([api("GET", "/snapshots?limit=100"), api("GET", "/templates")]);
    tree.replaceChildren(lineage(snapshots, templates));
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

async function start() {
  document.getElementById("login").hidden = true;
  nodeIds = (await api("GET", "/nodes").catch(() => [])).map((n) => n.id);
  document.getElementById("app").hidden = false;
  show(sandboxesView);
}

const views = { sandboxes: sandboxesView, nodes: nodesView, templates: templatesView, snapshots: snapshotsView };
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
