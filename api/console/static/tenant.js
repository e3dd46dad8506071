// A tenant's view: its jobs (world size, plan and loss over time), its live event feed, and every negotiation with
// its rounds. Every read goes through the API with the tenant's own token, so nothing here can show another
// tenant's data: the API would answer 404 or 403.

import { api, token } from "./api.js";
import { timeChart } from "./charts.js";
import { card, el, table, time } from "./dom.js";
import { openFeed } from "./feed.js";

const REFRESH_MS = 2000;
const FEED_LIMIT = 200;
const LOSS_LIMIT = 500;

export function renderTenant(main, tenant) {
  const jobsCard = card("Jobs", { id: "jobs" });
  const jobCard = card("Job", { id: "job" });
  const feedList = el("ul", { class: "feed", "data-testid": "feed" });
  const feedState = el("span", { class: "badge", "data-testid": "feed-state" }, "connecting");
  const feedCard = card("Live events", { id: "events" }, el("p", { class: "muted" }, feedState,
    " events published for ", tenant.id, " since this page opened"), feedList);
  const negotiationsCard = card("Negotiations", { id: "negotiations", class: "card wide" });
  const left = el("div", { style: "display:grid;gap:16px;min-width:0" }, jobsCard, jobCard);
  main.replaceChildren(left, feedCard, negotiationsCard);

  const state = { selected: new URLSearchParams(location.hash.slice(1)).get("job"), open: new Set() };
  let timer = null, stopped = false;

  async function refresh() {
    try {
      const jobs = await api("/v1/jobs");
      if (!state.selected || !jobs.some((job) => job.id === state.selected)) state.selected = jobs[0]?.id ?? null;
      renderJobs(jobsCard, jobs, state, () => { refreshSoon(0); });
      await renderJob(jobCard, tenant.id, state.selected);
      await renderNegotiations(negotiationsCard, state);
    } catch (error) {
      jobsCard.querySelector(".error")?.remove();
      jobsCard.append(el("p", { class: "error" }, error.message));
    }
    refreshSoon(REFRESH_MS);
  }
  function refreshSoon(ms) {
    clearTimeout(timer);
    if (!stopped) timer = setTimeout(refresh, ms);
  }

  const closeFeed = openFeed(token.get(), {
    onState(status, reason) {
      feedState.textContent = status;
      feedState.className = `badge ${status === "live" ? "live" : "off"}`;
      if (reason) feedState.title = reason;
    },
    onEvent(kind, data) {
      feedList.prepend(feedItem(kind, data));
      while (feedList.children.length > FEED_LIMIT) feedList.lastChild.remove();
      if (kind === "job" || kind === "negotiation") refreshSoon(0);
    },
  });
  refresh();
  return () => { stopped = true; clearTimeout(timer); closeFeed(); };
}

function feedItem(kind, data) {
  let event = {};
  try { event = JSON.parse(data); } catch { /* shown raw below */ }
  const body = event.data === undefined ? data : compact(event.data);
  return el("li", { "data-kind": kind, "data-job": event.subject ?? "", "data-id": event.id ?? "" },
    el("span", { class: "muted" }, time(event.time), " "), el("span", { class: "kind" }, kind), " ",
    el("b", {}, event.subject ?? ""), " ", el("code", {}, body.length > 160 ? `${body.slice(0, 160)}…` : body));
}

function renderJobs(container, jobs, state, onSelect) {
  const rows = table([
    ["job", (job) => job.id],
    ["workers", (job) => `${job.desired_workers} (${job.min_workers}-${job.max_workers})`],
    ["GPUs/worker", (job) => job.gpus_per_worker],
    ["plan", (job) => job.parallel_plan],
    ["epoch", (job) => job.placement_epoch],
    ["created", (job) => time(job.created_at)],
  ], jobs, (job) => ({
    class: `selectable${job.id === state.selected ? " selected" : ""}`,
    "data-job": job.id,
    onclick: () => { state.selected = job.id; location.hash = `job=${encodeURIComponent(job.id)}`; onSelect(); },
  }));
  container.replaceChildren(container.firstChild, jobs.length ? rows : el("p", { class: "muted" }, "no jobs yet"));
}

// The loss over time, as the API keeps it: the job's progress samples (downsampled by the job's age), oldest first.
function lossPoints(samples) {
  return samples.filter((p) => p.loss !== null && p.loss !== undefined).map((p) => ({ x: new Date(p.at), y: p.loss }));
}

async function renderJob(container, tenantId, jobId) {
  if (!jobId) { container.replaceChildren(container.firstChild); return; }
  const path = `/v1/jobs/${encodeURIComponent(jobId)}`;
  const [status, timeline, samples] = await Promise.all(
    [api(`${path}/status`), api(`${path}/timeline`), api(`${path}/progress?limit=${LOSS_LIMIT}`)]);
  const progress = status.progress;
  const stat = (label, value, id) => el("div", { "data-testid": id }, el("span", { class: "muted" }, label),
    el("b", {}, value ?? "-"));
  const sizes = timeline.map((entry) => ({ x: new Date(entry.at), y: entry.world_size, label: entry.parallel_plan }));
  container.replaceChildren(
    el("h2", {}, `Job ${jobId}`),
    el("div", { class: "stats" },
      stat("phase", status.phase, "phase"),
      stat("step", progress?.step, "step"),
      stat("world size", progress?.world_size, "world-size"),
      stat("plan", progress?.parallel_plan ?? status.parallel_plan, "plan"),
      stat("loss", progress?.loss?.toPrecision(4), "loss"),
      stat("samples/s", progress?.samples_per_s?.toFixed(0), "samples"),
      stat("epoch", status.placement_epoch, "epoch")),
    el("div", { class: "charts" },
      el("div", { "data-testid": "world-size-chart" }, el("h3", {}, "World size and plan over time"),
        timeChart(sizes, { step: true, integer: true, name: "world size" })),
      el("div", { "data-testid": "loss-chart" }, el("h3", {}, "Loss over time"),
        timeChart(lossPoints(samples), { name: "loss" }))),
  );
}

async function renderNegotiations(container, state) {
  const page = await api("/v1/negotiations?limit=100");
  const details = await Promise.all(page.items.map(async (item) =>
    state.open.has(item.id) ? api(`/v1/negotiations/${encodeURIComponent(item.id)}`) : item));
  const list = details.map((negotiation) => {
    const node = el("details", { class: "negotiation", "data-id": negotiation.id, "data-job": negotiation.job,
      open: state.open.has(negotiation.id) },
      el("summary", {}, el("b", {}, negotiation.kind), ` ${negotiation.job} · `,
        el("span", { class: "badge" }, negotiation.state), ` · round ${negotiation.round} · ${time(negotiation.created_at)}`),
      negotiation.rounds ? roundsTable(negotiation.rounds) : el("p", { class: "muted" }, "loading rounds…"));
    node.addEventListener("toggle", async () => {
      if (!node.open) { state.open.delete(negotiation.id); return; }
      state.open.add(negotiation.id);
      const full = await api(`/v1/negotiations/${encodeURIComponent(negotiation.id)}`);
      node.lastChild.replaceWith(roundsTable(full.rounds));
    });
    return node;
  });
  container.replaceChildren(container.firstChild, ...(list.length ? list : [el("p", { class: "muted" }, "none yet")]));
}

// JSON without its empty fields: what a round or an event actually says.
function compact(value) {
  const prune = (field) => {
    if (Array.isArray(field)) return field.map(prune);
    if (field === null || typeof field !== "object") return field;
    const kept = Object.entries(field).map(([key, inner]) => [key, prune(inner)])
      .filter(([, inner]) => inner !== null && inner !== undefined && !(Array.isArray(inner) && inner.length === 0));
    return kept.length ? Object.fromEntries(kept) : undefined;
  };
  return JSON.stringify(prune(value)) ?? "";
}

function roundsTable(rounds) {
  const terms = (round) => compact(round.offer ?? round.terms ?? (round.option !== null ? { option: round.option } : {}));
  return table([
    ["#", (round) => round.round],
    ["actor", (round) => round.actor],
    ["action", (round) => round.action],
    ["at", (round) => time(round.at)],
    ["terms / offer", (round) => el("code", {}, terms(round))],
    ["note", (round) => round.note ?? ""],
  ], rounds, () => ({ class: "round" }));
}
