// Shared by the scenario scripts: where the edge is, and how a result is reported.
// Each script prints one JSON object on stdout and exits 0, or prints the error on
// stderr (and {"failed": ...} on stdout) and exits 1.

/** The edge's OpenAI base URL (ending in /v1): argv[2] or IOP_BASE_URL. */
export function baseURL() {
  const url = process.argv[2] ?? process.env.IOP_BASE_URL;
  if (!url) {
    throw new Error("usage: node SCRIPT.mjs BASE_URL (or IOP_BASE_URL), e.g. http://127.0.0.1:8080/v1");
  }
  const trimmed = url.replace(/\/+$/, "");
  return trimmed.endsWith("/v1") ? trimmed : `${trimmed}/v1`;
}

/** What a caught error looked like to the library's user. */
export function describeError(err) {
  return {
    name: err?.constructor?.name ?? typeof err,
    message: String(err?.message ?? err),
    status: err?.status ?? err?.statusCode ?? null,
  };
}

/** Run ``main`` and report: its JSON result on stdout, exit 0; or the error, exit 1. */
export async function report(main) {
  let code = 0;
  let out;
  try {
    out = await main();
  } catch (err) {
    code = 1;
    console.error(err?.stack ?? err);
    out = { failed: describeError(err) };
  }
  // Exit once stdout is flushed: a kept-alive socket must not hold the process open.
  process.stdout.write(JSON.stringify(out) + "\n", () => process.exit(code));
}
