// Building DOM nodes from data. Everything from the API goes in as text (never as HTML), so a job name or an event
// field cannot inject markup into the page.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function table(columns, rows, rowAttrs = () => ({})) {
  return el("table", {},
    el("thead", {}, el("tr", {}, columns.map(([title]) => el("th", {}, title)))),
    el("tbody", {}, rows.map((row) => el("tr", rowAttrs(row), columns.map(([, cell]) => el("td", {}, cell(row)))))));
}

export function time(iso) {
  return iso ? new Date(iso).toLocaleTimeString() : "";
}

export function card(title, attrs = {}, ...children) {
  return el("section", { class: "card", ...attrs }, el("h2", {}, title), ...children);
}
