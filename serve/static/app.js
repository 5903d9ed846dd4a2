// Shalik playground: streams POST /v1/completions, or in the chat view POST /v1/chat/completions with the
// conversation so far (server-sent events), into the page. No build step, no dependencies. Every failure (HTTP status with OpenAI's error JSON, an error event mid-stream, a network
// failure, a stream cut short) is shown in the #error area.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    form: $("form"), prompt: $("prompt"), temperature: $("temperature"), maxTokens: $("max-tokens"),
    topP: $("top-p"), seed: $("seed"), apiKey: $("api-key"), auth: $("auth"), generate: $("generate"),
    stop: $("stop"), error: $("error"), output: $("output"), echo: $("echo"), completion: $("completion"),
    status: $("status"), ttft: $("ttft"), tps: $("tps"), tokens: $("tokens"), finish: $("finish"),
    model: $("model"), context: $("context"), modeChat: $("mode-chat"), modeCompletion: $("mode-completion"),
    chatSetup: $("chat-setup"), system: $("system"), chatLog: $("chat-log"), newChat: $("new-chat"),
    promptLabel: $("prompt-label"),
  };
  const history = []; // the chat so far: {role, content} of finished turns (the system message is separate)
  const KEY_STORAGE = "shalik.apiKey";
  let controller = null; // the running generation's AbortController
  let modelRetry = null;

  // ---- small helpers

  class InputError extends Error {}

  function storage() {
    try { return window.localStorage; } catch { return null; } // disabled storage must not break the page
  }

  function authHeaders() {
    const key = el.apiKey.value.trim();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  function showError(message, status) {
    el.error.textContent = "";
    const text = document.createElement("p");
    text.textContent = message;
    el.error.append(text);
    if (status === 401) {
      const hint = document.createElement("p");
      hint.className = "hint";
      hint.textContent = "This server requires an API key: enter it under “API key” (it stays in this browser).";
      el.error.append(hint);
      el.auth.open = true;
    }
    el.error.hidden = false;
  }

  function clearError() {
    el.error.hidden = true;
    el.error.textContent = "";
  }

  function setStatus(text) { el.status.textContent = text; }

  // "HTTP 400 Bad Request: <message>", the message from OpenAI's error JSON when there is one.
  async function describeResponse(response) {
    let text = "";
    try { text = await response.text(); } catch { /* body unreadable: the status says enough */ }
    let message = text.trim().slice(0, 2000);
    try {
      const body = JSON.parse(text);
      if (body && body.error && typeof body.error.message === "string") message = body.error.message;
      else if (body && typeof body.detail === "string") message = body.detail;
    } catch { /* not JSON: keep the text */ }
    const status = `HTTP ${response.status}${response.statusText ? " " + response.statusText : ""}`;
    return `${status}: ${message || "(no message)"}`;
  }

  function networkMessage(err) {
    return `Network error: could not reach the server (${err && err.message ? err.message : err}). ` +
           "Is it still running?";
  }

  // A number from an <input type=number>: undefined when empty and optional; InputError otherwise.
  function numberField(input, name, { integer = false, optional = false } = {}) {
    if (input.validity && input.validity.badInput) throw new InputError(`${name} is not a number`);
    const raw = input.value.trim();
    if (raw === "") {
      if (optional) return undefined;
      throw new InputError(`${name} is required`);
    }
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new InputError(`${name} is not a number: ${raw}`);
    if (integer && !Number.isInteger(value)) throw new InputError(`${name} must be a whole number, got ${raw}`);
    return value; // ranges are the server's to check: its message names the limit (e.g. the context length)
  }

  function chatMode() { return el.modeChat.checked; }

  // The messages of a chat request: the system message (when given), the finished turns, the new user message.
  function chatMessages(userText) {
    const system = el.system.value.trim();
    return [...(system ? [{ role: "system", content: system }] : []), ...history, { role: "user", content: userText }];
  }

  function requestBody() {
    const body = {
      max_tokens: numberField(el.maxTokens, "Max tokens", { integer: true }),
      temperature: numberField(el.temperature, "Temperature"),
      stream: true,
      stream_options: { include_usage: true },
    };
    if (chatMode()) {
      if (!el.prompt.value.trim()) throw new InputError("Write a message first");
      body.messages = chatMessages(el.prompt.value);
      body.logprobs = true; // one logprobs entry per token: exact live token counts (and no alternatives)
    } else {
      body.prompt = el.prompt.value;
      body.logprobs = 0; // the same in the completions form
    }
    const topP = numberField(el.topP, "top_p", { optional: true });
    const seed = numberField(el.seed, "Seed", { integer: true, optional: true });
    if (topP !== undefined) body.top_p = topP;
    if (seed !== undefined) body.seed = seed;
    return body;
  }

  // ---- the model id

  async function loadModel() {
    clearTimeout(modelRetry);
    el.model.textContent = "…";
    el.context.textContent = "";
    let response;
    try {
      response = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (err) {
      el.model.textContent = "unreachable";
      showError(networkMessage(err));
      return;
    }
    if (response.status === 503) { // still loading (retry), or unavailable for good (/health says why)
      let health = {};
      try { health = await (await fetch("/health", { cache: "no-store" })).json(); } catch { /* */ }
      if (health.status === "unavailable") {
        el.model.textContent = "unavailable";
        showError(`HTTP 503: ${health.detail || "no model is available"}`);
        return;
      }
      el.model.textContent = "loading…";
      setStatus(health.detail ? `model loading: ${health.detail}` : "model loading…");
      modelRetry = setTimeout(loadModel, 2000);
      return;
    }
    if (!response.ok) {
      el.model.textContent = "unavailable";
      showError(await describeResponse(response), response.status);
      return;
    }
    const body = await response.json();
    const card = body.data && body.data[0];
    el.model.textContent = card ? card.id : "(none)";
    if (card && card.max_model_len) {
      el.context.textContent = `· context ${card.max_model_len} tokens`;
      el.maxTokens.max = String(card.max_model_len - 1);
    }
    if (el.status.textContent.startsWith("model")) setStatus("idle");
  }

  // ---- generation

  function running(on) {
    el.generate.disabled = on;
    el.stop.disabled = !on;
    el.output.setAttribute("aria-busy", on ? "true" : "false");
  }

  // Split complete events (ended by a blank line) off the buffer; returns [events, rest].
  function takeEvents(buffer) {
    const events = [];
    const boundary = /\r\n\r\n|\n\n|\r\r/g;
    let start = 0;
    let m;
    while ((m = boundary.exec(buffer)) !== null) {
      events.push(buffer.slice(start, m.index));
      start = m.index + m[0].length;
    }
    return [events, buffer.slice(start)];
  }

  // The data of one event: its "data:" lines joined by newlines (null when it has none).
  function eventData(event) {
    const lines = event.split(/\r\n|\n|\r/).filter((l) => l.startsWith("data:"));
    if (!lines.length) return null;
    return lines.map((l) => l.slice(5).replace(/^ /, "")).join("\n");
  }

  async function generate() {
    if (controller) return;
    clearError();
    let body;
    try {
      body = requestBody();
    } catch (err) {
      if (!(err instanceof InputError)) throw err;
      showError(err.message);
      return;
    }
    controller = new AbortController();
    const { signal } = controller;
    running(true);
    setStatus("connecting…");
    const chat = Boolean(body.messages);
    let target = el.completion; // where the text grows: the completion, or the assistant's new chat bubble
    let bubbles = [];
    if (chat) {
      const userText = body.messages[body.messages.length - 1].content;
      bubbles = [addBubble("user", userText), addBubble("assistant", "")];
      target = bubbles[1];
    } else {
      el.echo.textContent = body.prompt;
      el.completion.textContent = "";
    }
    for (const k of ["ttft", "tps", "tokens", "finish"]) el[k].textContent = "–";

    const t0 = performance.now();
    let tFirst = null;
    let firstTokens = 0;
    let tokens = 0;
    let text = "";
    let finish = null;
    let sawDone = false;
    let failed = false;

    const showRate = (now) => {
      el.tokens.textContent = String(tokens);
      const seconds = (now - tFirst) / 1000;
      if (tokens > firstTokens && seconds > 0) el.tps.textContent = ((tokens - firstTokens) / seconds).toFixed(1);
    };

    const handle = (data) => {
      if (data === "[DONE]") { sawDone = true; return; }
      let msg;
      try { msg = JSON.parse(data); } catch {
        failed = true;
        showError(`The server sent an event that is not JSON: ${data.slice(0, 200)}`);
        return;
      }
      if (msg.error) {
        failed = true;
        showError(`Error during generation: ${msg.error.message || JSON.stringify(msg.error)}`);
        return;
      }
      const now = performance.now();
      for (const choice of msg.choices || []) {
        if (choice.index !== 0) continue;
        const piece = chat ? (choice.delta && choice.delta.content) || "" : choice.text;
        const listed = choice.logprobs && (chat ? choice.logprobs.content : choice.logprobs.tokens);
        const n = Array.isArray(listed) ? listed.length : (piece ? 1 : 0);
        if (n > 0 && tFirst === null) {
          tFirst = now;
          firstTokens = n;
          el.ttft.textContent = `${Math.round(now - t0)} ms`;
          setStatus("generating…");
        }
        tokens += n;
        if (piece) {
          text += piece;
          target.textContent = text;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (msg.usage && typeof msg.usage.completion_tokens === "number") tokens = msg.usage.completion_tokens;
      if (tFirst !== null) showRate(now);
    };

    try {
      const response = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
        body: JSON.stringify(body),
        signal,
        cache: "no-store",
      });
      if (!response.ok) {
        failed = true;
        showError(await describeResponse(response), response.status);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder("utf-8"); // stream mode: a character split across reads is kept whole
      let buffer = "";
      while (!sawDone) {
        const { value, done } = await reader.read();
        buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
        const [events, rest] = takeEvents(done ? buffer + "\n\n" : buffer);
        buffer = rest;
        for (const event of events) {
          const data = eventData(event);
          if (data !== null) handle(data);
          if (sawDone) break;
        }
        if (done) break;
      }
      if (sawDone) reader.cancel().catch(() => {});
      if (!sawDone && !failed) {
        failed = true;
        showError("The stream ended before [DONE]: the connection was closed (server stopped or timed out?).");
      }
    } catch (err) {
      if (err && err.name === "AbortError") {
        setStatus("stopped");
      } else {
        failed = true;
        showError(networkMessage(err));
      }
    } finally {
      controller = null;
      running(false);
      if (tFirst !== null) showRate(performance.now());
      if (tokens) el.tokens.textContent = String(tokens);
      el.finish.textContent = finish || "–";
      if (failed && !text) el.echo.textContent = ""; // nothing came: no half-empty output
      if (chat) {
        if (sawDone && !failed) { // a finished turn joins the conversation; the box is ready for the next one
          history.push(body.messages[body.messages.length - 1], { role: "assistant", content: text });
          el.prompt.value = "";
        } else {
          for (const b of bubbles) b.remove(); // not part of the conversation: the message stays in the box
        }
      }
      if (failed) setStatus("error");
      else if (sawDone) setStatus(`done in ${((performance.now() - t0) / 1000).toFixed(2)} s`);
      else if (signal.aborted) setStatus("stopped");
    }
  }

  function addBubble(role, content) {
    const li = document.createElement("li");
    li.className = role;
    li.textContent = content;
    el.chatLog.append(li);
    return li;
  }

  function newChat() {
    history.length = 0;
    el.chatLog.textContent = "";
    clearError();
  }

  // Completion or chat: which output shows, what the box is for, what the button says.
  function showMode() {
    const chat = chatMode();
    el.chatSetup.hidden = !chat;
    el.newChat.hidden = !chat;
    el.chatLog.hidden = !chat;
    el.output.hidden = chat;
    el.generate.textContent = chat ? "Send" : "Generate";
    el.promptLabel.firstChild.textContent = chat ? "Message " : "Prompt ";
    clearError();
  }

  function stop() {
    if (controller) controller.abort(); // closing the connection makes the server cancel the generation
  }

  // ---- wiring

  el.form.addEventListener("submit", (e) => { e.preventDefault(); generate(); });
  el.stop.addEventListener("click", stop);
  el.newChat.addEventListener("click", newChat);
  for (const radio of [el.modeChat, el.modeCompletion]) radio.addEventListener("change", showMode);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); generate(); }
    else if (e.key === "Escape" && controller) { e.preventDefault(); stop(); }
  });
  for (const chip of document.querySelectorAll("[data-prompt]")) {
    chip.addEventListener("click", () => {
      el.prompt.value = chip.dataset.prompt;
      el.prompt.lang = chip.lang || "en";
      el.prompt.focus();
    });
  }
  el.apiKey.addEventListener("change", () => {
    const store = storage();
    const key = el.apiKey.value.trim();
    if (store) { if (key) store.setItem(KEY_STORAGE, key); else store.removeItem(KEY_STORAGE); }
    clearError();
    loadModel();
  });

  const saved = storage() && storage().getItem(KEY_STORAGE);
  if (saved) el.apiKey.value = saved;
  showMode();
  loadModel();
})();
