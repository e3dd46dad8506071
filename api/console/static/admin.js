// The provider's view (admin token): hosts, the capacity ledger's utilisation and allocations, and the outbox.

import { api } from "./api.js";
import { card, el, table, time } from "./dom.js";

const REFRESH_MS = 3000;

export function renderAdmin(main) {
  const fleetCard = card("Ledger utilisation", { id: "fleet" });
  const hostsCard = card("Hosts", { id: "hosts" });
  const allocationsCard = card("Allocations", { id: "allocations", class: "card wide" });
  const outboxCard = card("Outbox", { id: "outbox", class: "card wide" });
  main.replaceChildren(hostsCard, fleetCard, allocationsCard, outboxCard);
  let timer = null, stopped = false;

  async function refresh() {
    try {
      const [fleet, hosts, allocations, outbox] = await Promise.all([
        api("/v1/fleet"), api("/v1/hosts"), api("/v1/allocations"), api("/v1/outbox?limit=50"),
      ]);
      renderFleet(fleetCard, fleet);
      hostsCard.replaceChildren(hostsCard.firstChild, table([
        ["host", (host) => host.id],
        ["group", (host) => host.locality_group],
        ["GPUs", (host) => host.gpus],
        ["allocated", (host) => host.allocated_gpus],
        ["free", (host) => host.free_gpus],
        ["state", (host) => (host.down_at ? `down since ${time(host.down_at)}` : "up")],
      ], hosts, (host) => ({ "data-host": host.id })));
      allocationsCard.replaceChildren(allocationsCard.firstChild, table([
        ["tenant", (a) => a.tenant_id], ["job", (a) => a.job_id], ["host", (a) => a.host_id],
        ["group", (a) => a.locality_group], ["GPUs", (a) => a.gpus], ["since", (a) => time(a.created_at)],
      ], allocations));
      outboxCard.replaceChildren(outboxCard.firstChild,
        el("p", { class: "muted" }, `pending: ${fmt(fleet.outbox_pending)} · delivered: ${fmt(fleet.outbox_delivered)}`
          + ` · oldest pending: ${fleet.outbox_oldest_pending_s.toFixed(1)} s`),
        table([
          ["#", (m) => m.id], ["topic", (m) => m.topic], ["subject", (m) => m.subject],
          ["created", (m) => time(m.created_at)],
          ["delivered", (m) => (m.delivered_at ? time(m.delivered_at) : "pending")],
          ["attempts", (m) => m.attempts], ["last error", (m) => m.last_error ?? ""],
        ], outbox, (m) => ({ "data-outbox": m.id })));
    } catch (error) {
      hostsCard.append(el("p", { class: "error" }, error.message));
    }
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  }
  refresh();
  return () => { stopped = true; clearTimeout(timer); };
}

function fmt(counts) {
  const parts = Object.entries(counts).map(([topic, n]) => `${n} ${topic}`);
  return parts.length ? parts.join(", ") : "0";
}

function renderFleet(container, fleet) {
  const percent = (fleet.ledger_utilisation * 100).toFixed(0);
  const stat = (label, value, id) => el("div", { "data-testid": id }, el("span", { class: "muted" }, label),
    el("b", {}, value));
  container.replaceChildren(container.firstChild,
    el("div", { class: "stats" },
      stat("utilisation", `${percent} %`, "utilisation"),
      stat("GPUs allocated", `${fleet.gpus_allocated} / ${fleet.gpus_total - fleet.gpus_down}`, "gpus"),
      stat("hosts up", fleet.hosts_up, "hosts-up"),
      stat("hosts down", fleet.hosts_down, "hosts-down"),
      stat("tenants", fleet.tenants_active, "tenants")),
    el("div", { class: "bar", title: `${percent} %` }, el("span", { style: `width:${percent}%` })),
    el("h3", {}, "Negotiations by state"),
    el("p", {}, fmt(fleet.negotiations_by_state)));
}
