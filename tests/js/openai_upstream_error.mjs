// openai-node: a stream whose upstream fails before its first token. The test scripts the
// upstream to fail its first two requests and then answer: with maxRetries 0 the client sees the
// error; with maxRetries 1 its retry gets the answer.
import OpenAI, { APIError } from "openai";
import { baseURL, describeError, report } from "./lib.mjs";

async function streamText(client) {
  const stream = await client.chat.completions.create({
    model: "up",
    messages: [{ role: "user", content: "hi" }],
    stream: true,
  });
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
  return text;
}

await report(async () => {
  const url = baseURL();
  const once = new OpenAI({ baseURL: url, apiKey: "unused", maxRetries: 0 });
  let error = null;
  let text = null;
  try {
    text = await streamText(once); // must not get here: the failure is an HTTP error
  } catch (err) {
    error = { ...describeError(err), apiError: err instanceof APIError };
  }
  const retrying = new OpenAI({ baseURL: url, apiKey: "unused", maxRetries: 1 });
  let retried = null;
  let retriedError = null;
  try {
    retried = await streamText(retrying);
  } catch (err) {
    retriedError = describeError(err);
  }
  return { error, text, retried, retriedError };
});
