// paged-infer demo page: chat over the WebSocket gateway (/v1/ws), streamed tokens,
// live TTFT and tokens/s, cancel. No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { ws: null, ready: false, history: [], current: null, seq: 0, queue: [] };

function wsUrl() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}/v1/ws`;
}

function setStatus(text) { $("status").textContent = text; }

function connect() {
  const ws = new WebSocket(wsUrl());
  state.ws = ws;
  state.ready = false;
  ws.onopen = () => {
    const key = $("api-key").value.trim();
    if (key) ws.send(JSON.stringify({ type: "auth", api_key: key }));
    setStatus("connected");
  };
  ws.onmessage = (ev) => onMessage(JSON.parse(ev.data));
  ws.onclose = () => {
    state.ready = false;
    setStatus("disconnected – retrying");
    finishCurrent("connection closed");
    setTimeout(connect, 1500);
  };
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat").appendChild(div);
  $("chat").scrollTop = $("chat").scrollHeight;
  return div;
}

function onMessage(msg) {
  if (msg.type === "hello") {
    state.ready = true;
    $("model").textContent = msg.model;
    setStatus("ready");
    while (state.queue.length) state.ws.send(state.queue.shift());
    return;
  }
  const cur = state.current;
  if (msg.type === "error" && (!cur || msg.id !== cur.id)) {
    addMessage("error", msg.error.message);
    return;
  }
  if (!cur || msg.id !== cur.id) return;
  if (msg.type === "delta") {
    const now = performance.now();
    for (const d of msg.deltas) {
      if (d.index !== 0) continue;
      if (cur.firstAt === null && d.token_ids.length) {
        cur.firstAt = now;
        $("ttft").textContent = `${((now - cur.sentAt) / 1000).toFixed(3)} s`;
      }
      cur.tokens += d.token_ids.length;
      cur.text += d.text;
      cur.node.textContent = cur.text;
    }
    $("ntok").textContent = cur.tokens;
    if (cur.firstAt !== null && now > cur.firstAt && cur.tokens > 1) {
      $("tps").textContent = ((cur.tokens - 1) / ((now - cur.firstAt) / 1000)).toFixed(1);
    }
    $("chat").scrollTop = $("chat").scrollHeight;
  } else if (msg.type === "done") {
    const t = msg.timing;
    if (t) {
      $("ttft").textContent = `${t.time_to_first_token_seconds.toFixed(3)} s`;
      $("tps").textContent = t.tokens_per_second.toFixed(1);
    }
    finishCurrent(`${msg.finish_reasons.join(",")} · ${msg.usage ? msg.usage.completion_tokens : cur.tokens} tokens`);
  } else if (msg.type === "cancelled") {
    finishCurrent("cancelled");
  } else if (msg.type === "error") {
    cur.node.className = "msg error";
    cur.node.textContent = msg.error.message;
    finishCurrent(null);
  }
}

function finishCurrent(note) {
  const cur = state.current;
  if (!cur) return;
  if (note) {
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = note;
    cur.node.appendChild(meta);
  }
  if (cur.text) state.history.push({ role: "assistant", content: cur.text });
  state.current = null;
  $("send").disabled = false;
  $("cancel").disabled = true;
}

function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.current) return;
  $("prompt").value = "";
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const id = `page-${++state.seq}`;
  state.current = { id, text: "", tokens: 0, sentAt: performance.now(), firstAt: null, node: addMessage("assistant", "") };
  $("ttft").textContent = "…";
  $("tps").textContent = "…";
  $("send").disabled = true;
  $("cancel").disabled = false;
  const payload = JSON.stringify({
    type: "generate",
    id,
    messages: state.history,
    max_tokens: Number($("max-tokens").value) || 128,
    temperature: Number($("temperature").value),
  });
  if (state.ready) state.ws.send(payload);
  else state.queue.push(payload);
}

$("form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) send(ev);
});
$("cancel").addEventListener("click", () => {
  if (state.current && state.ready) state.ws.send(JSON.stringify({ type: "cancel", id: state.current.id }));
});
$("clear").addEventListener("click", () => {
  state.history = [];
  $("chat").textContent = "";
});
$("api-key").addEventListener("change", () => state.ws && state.ws.close());
connect();
