// The tenant's events from GET /v1/events/stream (Server-Sent Events). EventSource cannot send an Authorization
// header, so the stream is read with fetch() and a ReadableStream reader, and parsed here. The first stream replays
// the tenant's latest events; the server ends a stream now and then (its token is checked again on the next one) and
// we reconnect after the last event's id (its stream sequence), so nothing is shown twice or missed, with a growing
// pause after failures.

export function openFeed(bearer, { onEvent, onState }) {
  const abort = new AbortController();
  let pause = 500;
  let lastId = null;

  async function readOnce() {
    const query = lastId === null ? "" : `?after=${encodeURIComponent(lastId)}`;
    const response = await fetch(`/v1/events/stream${query}`, {
      headers: { Authorization: `Bearer ${bearer}`, Accept: "text/event-stream" },
      signal: abort.signal,
    });
    if (!response.ok) {
      let reason = response.statusText;
      try { reason = (await response.json()).reason || reason; } catch { /* not JSON */ }
      throw Object.assign(new Error(reason), { status: response.status });
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const message = parse(block);
        if (!message) continue;
        if (message.event === "ready") { pause = 500; onState("live"); }
        else if (message.event === "end") onState("reconnecting");
        else {
          if (message.id !== null) lastId = message.id;
          onEvent(message.event, message.data);
        }
      }
    }
  }

  (async () => {
    while (!abort.signal.aborted) {
      try {
        await readOnce();
      } catch (error) {
        if (abort.signal.aborted) return;
        if (error.status === 401 || error.status === 403) { onState("refused", error.message); return; }
        onState("offline", error.message);
        await new Promise((resolve) => setTimeout(resolve, pause));
        pause = Math.min(pause * 2, 10000);
      }
    }
  })();
  return () => abort.abort();
}

function parse(block) {
  let event = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "id") id = value;
    else if (field === "data") data.push(value);
  }
  return data.length ? { event, id, data: data.join("\n") } : null;
}
