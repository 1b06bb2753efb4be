// openai-node: the Responses stream helper (responses.stream) on a model that reasons, with its
// reasoning shown (reasoning.summary), then its final response as the helper accumulated it.
import OpenAI from "openai";
import { baseURL, report } from "./lib.mjs";

await report(async () => {
  const client = new OpenAI({ baseURL: baseURL(), apiKey: "unused", maxRetries: 0 });
  const stream = client.responses.stream({ model: "up", input: "Think first.", reasoning: { summary: "auto" } });
  let reasoning = "";
  stream.on("response.reasoning_text.delta", (event) => {
    reasoning += event.delta;
  });
  const final = await stream.finalResponse();
  return {
    reasoning,
    status: final.status,
    output: final.output.map((item) => ({
      type: item.type,
      content: (item.content ?? []).map((part) => [part.type, part.text]),
    })),
  };
});
