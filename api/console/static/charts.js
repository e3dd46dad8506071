// Small SVG charts drawn here (no charting library): a line over time, or a step line for values that hold until
// they change (a job's world size), with optional labels at points (the parallel plan of each shape).

const NS = "http://www.w3.org/2000/svg";
const W = 360, H = 170, L = 34, R = 10, T = 10, B = 22;

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceTicks(min, max, count) {
  if (min === max) return [min];
  const raw = (max - min) / count;
  const step = 10 ** Math.floor(Math.log10(raw));
  const unit = [1, 2, 5, 10].map((m) => m * step).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = Math.ceil(min / unit) * unit; v <= max + unit * 1e-9; v += unit) ticks.push(+v.toPrecision(12));
  return ticks;
}

// points: [{x: Date, y: number, label?: string}], oldest first.
export function timeChart(points, { step = false, integer = false, name = "" } = {}) {
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": name });
  root.dataset.points = String(points.length);
  if (points.length === 0) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
    return root;
  }
  const xs = points.map((p) => +p.x), ys = points.map((p) => p.y);
  let x0 = Math.min(...xs), x1 = Math.max(...xs, Date.now());
  if (x1 - x0 < 1000) x0 = x1 - 1000;
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (integer) { y0 = Math.min(0, y0); y1 = Math.max(y1 + 1, 1); }
  else if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);

  for (const tick of niceTicks(y0, y1, 4).filter((t) => !integer || Number.isInteger(t))) {
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(tick), y2: sy(tick) }));
    root.append(svg("text", { x: L - 4, y: sy(tick) + 3, "text-anchor": "end" }, String(+tick.toPrecision(4))));
  }
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  for (const at of [x0, x1]) {
    root.append(svg("text", { x: sx(at), y: H - 6, "text-anchor": at === x0 ? "start" : "end" },
      new Date(at).toLocaleTimeString()));
  }

  let d = "";
  points.forEach((p, i) => {
    const x = sx(+p.x), y = sy(p.y);
    if (i === 0) d = `M${x},${y}`;
    else d += step ? `H${x}V${y}` : `L${x},${y}`;
  });
  if (step) d += `H${sx(x1)}`;
  root.append(svg("path", { class: "series", d }));
  for (const p of points) {
    root.append(svg("circle", { class: "dot", cx: sx(+p.x), cy: sy(p.y), r: 2.5 }));
    if (p.label) root.append(svg("text", { class: "plan", x: sx(+p.x) + 3, y: sy(p.y) - 5 }, p.label));
  }
  return root;
}
