// openai-node: client.models.retrieve() for a served model and for an unknown one.
import OpenAI, { NotFoundError } from "openai";
import { baseURL, describeError, report } from "./lib.mjs";

await report(async () => {
  const client = new OpenAI({ baseURL: baseURL(), apiKey: "unused", maxRetries: 0 });
  const card = await client.models.retrieve("m");
  let missing = null;
  try {
    await client.models.retrieve("no-such-model");
  } catch (err) {
    missing = { ...describeError(err), notFound: err instanceof NotFoundError };
  }
  return { card, missing };
});
