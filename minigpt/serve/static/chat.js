// The chat page: keeps the conversation (in this tab, and in localStorage across reloads),
// sends it whole with each new message to /v1/chat/completions with stream: true, and shows
// the reply as its server-sent events arrive. Stop aborts the request; the server sees the
// connection close and frees the slot at once. Plain JavaScript, nothing fetched from
// elsewhere: the page works on a machine without a network.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "minigpt-chat";
// epoch counts conversations: a reply that ends after "New chat" must not join the new one.
const state = { history: [], controller: null, model: null, epoch: 0 };

function saved() {
  try { return JSON.parse(localStorage.getItem(STORE)) || {}; } catch { return {}; }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify({
    history: state.history, system: $("system").value, temperature: $("temperature").value,
    maxTokens: $("max-tokens").value, apiKey: $("api-key").value,
  }));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function note(bubble, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  bubble.appendChild(span);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("status").textContent = busy ? "replying…" : "";
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      $("model").textContent = "API key needed (Settings)";
      return;
    }
    const models = await response.json();
    state.model = models.data[0].id;
    $("model").textContent = state.model + " · " + models.data[0].max_model_len + " tokens";
  } catch (error) {
    $("model").textContent = "server unreachable";
  }
}

// Server-sent events: events end with a blank line; each "data:" line holds one JSON chunk,
// and "data: [DONE]" ends the stream. Lines starting ":" are the server's keep-alive pings.
async function* chunks(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        yield chunk;
      }
    }
  }
}

async function send(text) {
  const epoch = state.epoch;
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.dataset.state = "streaming";
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = { model: state.model, messages, stream: true,
                 temperature: Number($("temperature").value) };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  state.controller = new AbortController();
  setBusy(true);
  let reply = "", finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: state.controller.signal });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(error?.error?.message || response.status + " " + response.statusText);
    }
    for await (const chunk of chunks(response)) {
      for (const choice of chunk.choices) {
        if (choice.delta?.content) {
          reply += choice.delta.content;
          bubble.textContent = reply;
          bubble.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    bubble.dataset.state = "done";
    if (finish === "length") note(bubble, "cut off at the token limit");
    if (epoch === state.epoch) state.history.push({ role: "assistant", content: reply });
  } catch (error) {
    if (error.name === "AbortError") {
      bubble.dataset.state = "stopped";
      note(bubble, "stopped");
      if (epoch === state.epoch) state.history.push({ role: "assistant", content: reply });
    } else {
      bubble.dataset.state = "error";
      bubble.classList.add("error");
      bubble.textContent = reply;
      note(bubble, "error: " + error.message);
      // the message that failed is not part of the conversation
      if (epoch === state.epoch) state.history.pop();
    }
  } finally {
    state.controller = null;
    setBusy(false);
    save();
  }
}

function restore() {
  const old = saved();
  for (const [id, key] of [["system", "system"], ["temperature", "temperature"],
                           ["max-tokens", "maxTokens"], ["api-key", "apiKey"]]) {
    if (old[key] !== undefined) $(id).value = old[key];
  }
  state.history = Array.isArray(old.history) ? old.history : [];
  for (const message of state.history) addMessage(message.role, message.content);
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", () => {
  state.controller?.abort();
  state.epoch += 1;
  state.history = [];
  $("messages").replaceChildren();
  save();
});
for (const id of ["system", "temperature", "max-tokens"]) $(id).addEventListener("change", save);
$("api-key").addEventListener("change", () => { save(); loadModel(); });

restore();
loadModel();
