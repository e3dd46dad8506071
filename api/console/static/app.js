// The console's entry point: sign in with a token, find out whose it is, and show that caller's view.

import { renderAdmin } from "./admin.js";
import { ApiError, token, whoAmI } from "./api.js";
import { renderTenant } from "./tenant.js";

const main = document.getElementById("main");
const signIn = document.getElementById("sign-in");
const who = document.getElementById("who");
const signOut = document.getElementById("sign-out");
let stop = () => {};

async function start() {
  if (!token.get()) return;
  const error = document.getElementById("sign-in-error");
  try {
    const me = await whoAmI();
    who.textContent = me.role === "tenant" ? `tenant ${me.tenant.id} (${me.tenant.display_name})` : "provider admin";
    document.body.dataset.role = me.role;
    signOut.hidden = false;
    stop = me.role === "tenant" ? renderTenant(main, me.tenant) : renderAdmin(main);
  } catch (failure) {
    token.clear();
    error.textContent = failure instanceof ApiError ? failure.message : `cannot reach the API: ${failure.message}`;
  }
}

signIn.addEventListener("submit", (event) => {
  event.preventDefault();
  token.set(document.getElementById("token").value.trim());
  start();
});
signOut.addEventListener("click", () => {
  stop();
  token.clear();
  location.hash = "";
  location.reload();
});
start();
