// The REST API, called with the token the user pasted. The token lives in this tab's sessionStorage only, and goes
// in the Authorization header, never in a URL.

const KEY = "hz.console.token";

export const token = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value),
  clear: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, reason) {
    super(reason);
    this.status = status;
  }
}

export async function api(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${token.get()}` } });
  if (!response.ok) {
    let reason = response.statusText;
    try { reason = (await response.json()).reason || reason; } catch { /* not JSON */ }
    throw new ApiError(response.status, reason);
  }
  return response.json();
}

// Who the token is: a tenant (GET /v1/tenant answers), the admin (tenant routes say 403, admin routes answer), or
// nobody (401).
export async function whoAmI() {
  try {
    return { role: "tenant", tenant: await api("/v1/tenant") };
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 403) throw error;
  }
  await api("/v1/fleet");
  return { role: "admin" };
}
