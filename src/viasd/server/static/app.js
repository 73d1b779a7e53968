// viasd's chat page: a conversation over POST /v1/chat/completions (streamed), the settings of each
// message from GET /v1/models' `viasd` object, and every token coloured by who settled it (the
// `provenance` option: docs/serving.md, "The chat page"). No build step; marked and DOMPurify are
// vendored (static/vendor). Model output is shown as text nodes, or as Markdown sanitized by DOMPurify.
"use strict";

const SOURCES = {  // `by` of a token -> its legend entry
  grammar: "grammar-forced",
  draft: "accepted draft",
  slim: "slim verifier",
  full: "full model",
};
const FALLBACK_STRATEGIES = ["ar", "sd", "pld", "self-sd", "cascade", "viasd"];
const CHOOSES_DRAFTER = ["viasd", "cascade"];  // strategies whose drafter a request picks (`draft`)
const KEY = "viasd-api-key", PREFS = "viasd-chat-settings", COLOUR = "viasd-chat-colour";

const $ = (id) => document.getElementById(id);
const state = {
  key: sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "",
  model: null,       // the served model's id
  info: null,        // data[0].viasd of /v1/models, or null (a server without it: no provenance)
  history: [],       // [{role, content}] of the finished turns
  busy: null,        // the AbortController of the answer being streamed
  colour: localStorage.getItem(COLOUR) !== "off",
  answers: [],       // every answer shown: {el, body, text, tokens, done}
};

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// ---- the API -------------------------------------------------------------------------------------

function headers() {
  const h = {"Content-Type": "application/json"};
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function failure(r) {
  let message = r.statusText || "request failed";
  try {
    const body = await r.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON */ }
  if (r.status === 401) askKey();
  return new ApiError(r.status, `${r.status}: ${message}`);
}

async function loadModels() {
  const r = await fetch("/v1/models", {headers: headers()});
  if (!r.ok) throw await failure(r);
  const body = await r.json();
  const served = (body.data || [])[0] || {};
  state.model = served.id || null;
  state.info = served.viasd || null;
  $("model").textContent = state.model || "";
  fillSettings();
  hideNotice();
}

// ---- the API key ---------------------------------------------------------------------------------

function askKey() {
  const refused = !!state.key;
  state.key = "";
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
  $("key-form").hidden = false;
  $("key-form").querySelector("label").textContent =
    refused ? "The server refused the key: enter it again" : "This server needs an API key";
  $("api-key").focus();
}

async function saveKey(ev) {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  state.key = key;
  (($("key-remember").checked) ? localStorage : sessionStorage).setItem(KEY, key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  try {
    await loadModels();
    $("prompt").focus();
  } catch (e) {
    showNotice(e.message);
  }
}

// ---- settings ------------------------------------------------------------------------------------

function prefs() {
  try { return JSON.parse(localStorage.getItem(PREFS)) || {}; } catch (e) { return {}; }
}

function savePrefs() {
  localStorage.setItem(PREFS, JSON.stringify({
    strategy: $("strategy").value, draft: $("draft").value, mode: $("mode").value,
    temperature: $("temperature").value, max_tokens: $("max-tokens").value, system: $("system").value,
  }));
}

function options(select, values, labels, chosen) {
  select.replaceChildren(...values.map((v) => {
    const o = document.createElement("option");
    o.value = v;
    o.textContent = labels[v] || v;
    return o;
  }));
  select.value = values.includes(chosen) ? chosen : values[0];
}

function fillSettings() {
  const info = state.info || {}, p = prefs();
  const strategies = info.strategies || ["", ...FALLBACK_STRATEGIES];  // "": the server's default
  options($("strategy"), strategies, {"": "the server's default"}, p.strategy || info.default_strategy || strategies[0]);
  const drafts = (info.draft_kinds || ["auto", "model", "pld", "self"]).filter((k) => k !== "model" || info.drafter);
  options($("draft"), drafts, {
    auto: "auto (the server's choice)", model: `model: ${info.drafter}`, pld: "pld: prompt lookup", self: "self: a route of the model",
  }, p.draft);
  options($("mode"), info.modes || ["lossless", "tiered"], {}, p.mode || info.default_mode);
  if (p.temperature !== undefined) $("temperature").value = p.temperature;
  if (p.max_tokens !== undefined) $("max-tokens").value = p.max_tokens;
  if (p.system !== undefined) $("system").value = p.system;
  const routes = (info.routes || []).filter((r) => r.fraction != null).map((r) => `${r.name} ${Math.round(r.fraction * 100)}%`);
  $("routes").textContent = routes.length ? `Routes (share of the ${info.layers || "model's"} layers' work): ${routes.join(", ")}` : "";
  showRows();
}

function showRows() {
  const s = $("strategy").value;
  $("draft-row").hidden = !CHOOSES_DRAFTER.includes(s);
  $("mode-row").hidden = s !== "viasd";
}

function requestBody() {
  const strategy = $("strategy").value;
  const viasd = strategy ? {strategy} : {};
  if (CHOOSES_DRAFTER.includes(strategy) && $("draft").value !== "auto") viasd.draft = $("draft").value;
  if (strategy === "viasd") viasd.mode = $("mode").value;
  if (state.info) viasd.provenance = true;
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...state.history);
  const body = {messages, stream: true, viasd};
  if (state.model) body.model = state.model;
  const t = $("temperature").value, m = $("max-tokens").value;
  if (t !== "") body.temperature = Number(t);
  if (m !== "") body.max_tokens = Number(m);
  return body;
}

// ---- the conversation ----------------------------------------------------------------------------

function addMessage(role) {
  const el = document.createElement("li");
  el.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "body";
  el.append(body);
  $("messages").append(el);
  return {el, body};
}

function scrollDown() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function tokenSpan(t) {
  const s = document.createElement("span");
  const by = SOURCES[t.by] ? t.by : "unknown";
  s.className = "tok tok-" + by + (t.text === "" ? " tok-empty" : "");
  s.title = (SOURCES[by] || "source not given") + (t.text === "" ? " (a token with no text)" : "");
  s.textContent = t.text;
  return s;
}

function markdown(text) {  // a model's Markdown as sanitized HTML
  return DOMPurify.sanitize(marked.parse(text, {gfm: true}));
}

function linksApart(node) {  // a link in an answer opens beside the conversation, telling it nothing
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
}

function render(a) {  // the whole answer again, in the current view
  a.shown = 0;
  a.body.replaceChildren();
  a.body.classList.toggle("tokens", state.colour);
  if (state.colour) appendTokens(a);
  else a.body.innerHTML = markdown(a.text);
  a.body.classList.toggle("cursor", !a.done);
}

function appendTokens(a) {  // the tokens not yet shown (colour view)
  // (a server without provenance: the text as one span of no known source)
  const list = a.tokens || (a.text ? [{text: a.text, by: "unknown"}] : []);
  if (!a.tokens) { a.body.replaceChildren(); a.shown = 0; }
  const frag = document.createDocumentFragment();
  for (; a.shown < list.length; a.shown++) frag.append(tokenSpan(list[a.shown]));
  a.body.append(frag);
}

function update(a) {  // after a chunk: tokens appended at once, Markdown once per frame
  if (state.colour) { appendTokens(a); scrollDown(); return; }
  if (a.frame) return;
  a.frame = requestAnimationFrame(() => { a.frame = 0; render(a); scrollDown(); });
}

function fmt(x, digits) {
  return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
}

function liveLine(a) {  // while streaming: the browser's own timing
  const now = performance.now();
  const n = a.tokens ? a.tokens.length : a.chunks;
  let s = a.first == null ? "waiting for the first token…" : `first token ${fmt((a.first - a.sent) / 1000, 2)} s`;
  if (a.first != null && n > 1 && now > a.first) s += ` · ${fmt((n - 1) / ((now - a.first) / 1000), 1)} tokens/s`;
  a.speed.textContent = s + ` · ${n} tokens`;
}

function finalLine(a, record) {  // at the end: the server's stats
  const st = (record && record.stats) || {}, cfg = (record && record.config) || {};
  const parts = [
    `first token ${fmt(st.first_token_s, 2)} s`,
    `${fmt(st.decode_tokens_per_s != null ? st.decode_tokens_per_s : st.tokens_per_s, 1)} tokens/s`,
    `${fmt(st.tokens_per_full_call, 2)} tokens per full-model pass`,
    `${st.new_tokens != null ? st.new_tokens : "–"} tokens`,
  ];
  a.speed.textContent = parts.join(" · ");
  const n = a.tokens ? a.tokens.length : a.chunks;
  a.speed.title = `in this browser: first token after ${fmt((a.first - a.sent) / 1000, 2)} s, ` +
    `${fmt((n - 1) / ((a.end - a.first) / 1000), 1)} tokens/s while streaming`;
  const what = [cfg.strategy, cfg.draft && cfg.draft !== "auto" ? cfg.draft : null, cfg.strategy === "viasd" ? cfg.mode : null];
  a.how.textContent = what.filter(Boolean).join(" · ");
  if (st.sources) {
    a.el.dataset.sources = JSON.stringify(st.sources);
    a.sources.replaceChildren(...Object.keys(SOURCES).filter((k) => st.sources[k]).map((k) => {
      const s = document.createElement("span");
      const i = document.createElement("i");
      i.className = "tok-" + k;
      s.title = SOURCES[k];
      s.append(i, `${SOURCES[k]} ${st.sources[k]} `);
      return s;
    }));
  }
  a.el.dataset.stats = JSON.stringify(st);
  a.record.textContent = JSON.stringify(record, null, 2);
  a.details.hidden = false;
}

function metaOf(a) {
  const meta = document.createElement("div");
  meta.className = "meta";
  a.how = document.createElement("span");
  a.speed = document.createElement("span");
  a.speed.className = "speed";
  a.sources = document.createElement("span");
  a.sources.className = "sources";
  a.details = document.createElement("details");
  a.details.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "settings and stats";
  a.record = document.createElement("pre");
  a.details.append(summary, a.record);
  meta.append(a.how, a.speed, a.sources, a.details);
  a.el.append(meta);
}

function errorOf(a, message) {
  const e = document.createElement("div");
  e.className = "error";
  e.textContent = message;
  a.el.append(e);
}

// ---- one exchange --------------------------------------------------------------------------------

function parseEvents(buffer, onData) {  // complete SSE events of `buffer`; returns the rest
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const event = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
    if (data) onData(data);
  }
  return buffer;
}

function onChunk(a, chunk) {
  if (chunk.error) throw new ApiError(0, chunk.error.message || "the server ended the answer");
  const choice = (chunk.choices || [])[0] || {};
  const text = (choice.delta && choice.delta.content) || "";
  const tokens = chunk.viasd && chunk.viasd.tokens;
  if (text || (tokens && tokens.length)) {
    if (a.first == null) a.first = performance.now();
    a.text += text;
    a.chunks += 1;
    a.el.dataset.chunks = a.chunks;
    if (tokens) (a.tokens = a.tokens || []).push(...tokens);
    update(a);
    liveLine(a);
  }
  if (choice.finish_reason) {
    a.finish = choice.finish_reason;
    a.final = chunk.viasd || null;
  }
}

async function stream(a, r) {
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "", done = false;
  while (!done) {
    const {value, done: end} = await reader.read();
    if (end) break;
    buffer = parseEvents(buffer + value.replace(/\r\n/g, "\n"), (data) => {
      if (data === "[DONE]") { done = true; return; }
      onChunk(a, JSON.parse(data));
    });
  }
}

async function send(ev) {
  if (ev) ev.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.busy) return;
  savePrefs();
  const user = addMessage("user");
  user.body.textContent = prompt;
  state.history.push({role: "user", content: prompt});
  $("prompt").value = "";
  const body = requestBody();
  const {el, body: out} = addMessage("assistant");
  const a = {el, body: out, text: "", tokens: null, chunks: 0, done: false, sent: performance.now(), first: null};
  metaOf(a);
  state.answers.push(a);
  render(a);
  a.speed.textContent = "waiting for the first token…";
  scrollDown();
  const abort = new AbortController();
  busy(abort);
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body), signal: abort.signal});
    if (!r.ok) throw await failure(r);
    await stream(a, r);
  } catch (e) {
    a.error = abort.signal.aborted ? "stopped" : e.message;
  }
  a.end = performance.now();
  a.done = true;
  busy(null);
  if (!a.text && !a.tokens && a.error && a.error !== "stopped") {  // no answer: take the message back
    el.remove();
    user.el.remove();
    state.history.pop();
    state.answers.pop();
    if (!$("prompt").value) $("prompt").value = prompt;
    showNotice(a.error);
    return;
  }
  state.history.push({role: "assistant", content: a.text});
  render(a);
  if (a.final) finalLine(a, a.final);
  else if (a.first != null) { liveLine(a); a.speed.textContent = (a.error === "stopped" ? "stopped · " : "") + a.speed.textContent; }
  else a.speed.textContent = a.error === "stopped" ? "stopped" : "";
  if (a.error && a.error !== "stopped") errorOf(a, a.error);
  a.el.dataset.finish = a.finish || (a.error === "stopped" ? "stopped" : "error");  // set last: the answer is complete
  hideNotice();
  scrollDown();
}

function busy(abort) {
  state.busy = abort;
  $("send").disabled = !!abort;
  $("stop").hidden = !abort;
}

// ---- the page ------------------------------------------------------------------------------------

function showNotice(message) {
  $("notice").textContent = message;
  $("notice").hidden = false;
}

function hideNotice() {
  $("notice").hidden = true;
}

function newChat() {
  if (state.busy) state.busy.abort();
  state.history = [];
  state.answers = [];
  $("messages").replaceChildren();
  $("prompt").focus();
}

function setColour() {
  state.colour = $("colour-toggle").checked;
  localStorage.setItem(COLOUR, state.colour ? "on" : "off");
  for (const a of state.answers) render(a);
}

function main() {
  DOMPurify.addHook("afterSanitizeAttributes", linksApart);
  $("colour-toggle").checked = state.colour;
  $("colour-toggle").addEventListener("change", setColour);
  $("new-chat").addEventListener("click", newChat);
  $("settings").addEventListener("change", () => { showRows(); savePrefs(); });
  $("settings").addEventListener("submit", (ev) => ev.preventDefault());
  $("key-form").addEventListener("submit", saveKey);
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.busy && state.busy.abort());
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) send(ev);
  });
  fillSettings();
  loadModels().catch((e) => showNotice(e.message));
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", main);
