// The page at `/`: a streaming chat against this server's /v1/chat/completions and a
// dashboard polled from /metrics. No dependencies; the CSP allows only same-origin fetches.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "kimi-infer-api-key"; // sessionStorage only: the key leaves with the tab
const POLL_MS = 1000;
const IMBALANCE_FACTOR = 3; // deployment guides flag an expert past 3x its layer's mean

const conversation = [];
let controller = null;

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.dataset.role = role;
  if (role === "assistant") {
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning";
    const content = document.createElement("div");
    content.className = "content";
    div.append(reasoning, content);
  } else {
    div.textContent = text;
  }
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function numberField(id, parse) {
  const value = parse($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  return {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top-p", parseFloat),
    max_tokens: numberField("max-tokens", (v) => parseInt(v, 10)),
  };
}

// Reads `data:` frames of an SSE body, calling onData with each parsed JSON payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data:")) continue; // comments are keep-alives
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch {
    return response.statusText;
  }
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant");
  const reasoning = div.querySelector(".reasoning");
  const content = div.querySelector(".content");
  setBusy(true);
  controller = new AbortController();
  let failed = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      const hint = response.status === 401 ? " (enter the server's API key above)" : "";
      throw new Error(response.status + ": " + (await errorMessage(response)) + hint);
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) reasoning.textContent += delta.reasoning_content;
        if (delta.content) content.textContent += delta.content;
        if (choice.finish_reason) div.dataset.finish = choice.finish_reason;
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    });
  } catch (err) {
    if (err.name === "AbortError") {
      div.dataset.finish = "abort";
    } else {
      failed = true;
      addMessage("error", String(err.message || err));
    }
  } finally {
    // A failed turn leaves the conversation; a cleared one is already gone.
    if (failed) conversation.pop();
    else if (div.isConnected) conversation.push({ role: "assistant", content: content.textContent });
    div.dataset.done = "true";
    controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Prometheus text: `name{label="v",...} value` lines into [{name, labels, value}].
function parseMetrics(text) {
  const samples = [];
  const line_re = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label_re = /(\w+)="((?:[^"\\]|\\.)*)"/g;
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line_re.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(label_re)) labels[l[1]] = l[2];
    samples.push({ name: m[1], labels, value: parseFloat(m[3]) });
  }
  return samples;
}

function sum(samples, name) {
  return samples.filter((s) => s.name === name).reduce((a, s) => a + s.value, 0);
}

const seconds = (s) => (s >= 1 ? s.toFixed(2) + " s" : (s * 1000).toFixed(1) + " ms");
let previous = null;

function updateStats(samples) {
  const now = performance.now();
  const tokens = sum(samples, "vllm:generation_tokens_total");
  if (previous) {
    const rate = (tokens - previous.tokens) / ((now - previous.time) / 1000);
    $("stat-throughput").textContent = rate.toFixed(1);
  }
  previous = { time: now, tokens };
  const mean = (name) => {
    const count = sum(samples, name + "_count");
    return count > 0 ? seconds(sum(samples, name + "_sum") / count) : "–";
  };
  $("stat-ttft").textContent = mean("vllm:time_to_first_token_seconds");
  $("stat-tpot").textContent = mean("vllm:time_per_output_token_seconds");
  $("stat-running").textContent = sum(samples, "vllm:num_requests_running");
  $("stat-waiting").textContent = sum(samples, "vllm:num_requests_waiting");
  $("stat-cache").textContent = (100 * sum(samples, "vllm:kv_cache_usage_perc")).toFixed(1) + " %";
  $("stat-requests").textContent = sum(samples, "vllm:request_success_total");
  $("stat-tokens").textContent = tokens;
}

function updateHeatmap(samples) {
  const layers = new Map(); // layer -> counts by expert
  for (const s of samples) {
    if (s.name !== "kimi:moe_expert_tokens_total") continue;
    const layer = Number(s.labels.layer);
    if (!layers.has(layer)) layers.set(layer, []);
    layers.get(layer)[Number(s.labels.expert)] = s.value;
  }
  const map = $("heatmap");
  if (layers.size === 0) {
    map.textContent = "No MoE layers in this model.";
    return;
  }
  const shape = [...layers].map(([l, c]) => l + ":" + c.length).join(",");
  if (map.dataset.shape !== shape) {
    map.replaceChildren();
    map.dataset.shape = shape;
    for (const [layer, counts] of [...layers].sort((a, b) => a[0] - b[0])) {
      const row = document.createElement("div");
      row.className = "hm-row";
      row.dataset.layer = layer;
      const label = document.createElement("span");
      label.className = "hm-label";
      label.textContent = "layer " + layer;
      row.append(label);
      for (let e = 0; e < counts.length; e++) {
        const cell = document.createElement("span");
        cell.className = "hm-cell";
        row.append(cell);
      }
      map.append(row);
    }
  }
  const flagged = [];
  for (const row of map.querySelectorAll(".hm-row")) {
    const layer = Number(row.dataset.layer);
    const counts = layers.get(layer).map((c) => c || 0);
    const total = counts.reduce((a, c) => a + c, 0);
    const mean = total / counts.length;
    const max = Math.max(...counts);
    row.querySelectorAll(".hm-cell").forEach((cell, e) => {
      const share = max > 0 ? counts[e] / max : 0;
      cell.style.backgroundColor = `hsl(${220 - 220 * share}, 80%, ${92 - 45 * share}%)`;
      const hot = mean > 0 && counts[e] > IMBALANCE_FACTOR * mean;
      cell.classList.toggle("hot", hot);
      cell.title = `layer ${layer}, expert ${e}: ${counts[e]} tokens` + (hot ? " (over 3x mean)" : "");
      if (hot) flagged.push(`layer ${layer} expert ${e} (${(counts[e] / mean).toFixed(1)}x)`);
    });
  }
  const note = $("imbalance");
  note.classList.toggle("flagged", flagged.length > 0);
  note.textContent = flagged.length
    ? "Imbalanced: " + flagged.slice(0, 12).join(", ") + (flagged.length > 12 ? ", …" : "")
    : "No expert past 3× its layer's mean.";
}

async function poll() {
  try {
    const response = await fetch("/metrics", { headers: authHeaders() });
    if (!response.ok) throw new Error(response.status + ": " + (await errorMessage(response)));
    const samples = parseMetrics(await response.text());
    updateStats(samples);
    updateHeatmap(samples);
    $("dash-status").textContent = "updated " + new Date().toLocaleTimeString();
    $("dashboard").dataset.updates = Number($("dashboard").dataset.updates || 0) + 1;
  } catch (err) {
    $("dash-status").textContent = "metrics unavailable: " + (err.message || err);
  }
  setTimeout(poll, POLL_MS);
}

async function showModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) return;
    const body = await response.json();
    $("model-name").textContent = (body.data && body.data[0] && body.data[0].id) || "";
  } catch {
    // The name is decoration; chat still works without it.
  }
}

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, key.value.trim());
    showModel();
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
  });
  showModel();
  poll();
}

init();
