// openai-node: a streamed chat completion, then the same with stream_options.include_usage.
import OpenAI from "openai";
import { baseURL, report } from "./lib.mjs";

async function streamed(client, extra) {
  const stream = await client.chat.completions.create({
    model: "m",
    messages: [{ role: "user", content: "hello there" }],
    max_tokens: 8,
    stream: true,
    ...extra,
  });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  const text = chunks.map((c) => c.choices[0]?.delta?.content ?? "").join("");
  const finish = chunks.map((c) => c.choices[0]?.finish_reason).filter(Boolean);
  const last = chunks.at(-1);
  return {
    text,
    finish,
    chunks: chunks.length,
    withUsage: chunks.filter((c) => c.usage).length,
    last: { choices: last?.choices?.length ?? null, usage: last?.usage ?? null },
  };
}

await report(async () => {
  const client = new OpenAI({ baseURL: baseURL(), apiKey: "unused", maxRetries: 0 });
  return {
    plain: await streamed(client, {}),
    usage: await streamed(client, { stream_options: { include_usage: true } }),
  };
});
