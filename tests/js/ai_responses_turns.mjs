// Vercel AI SDK, its default OpenAI provider (@ai-sdk/openai: the Responses API, `store` left on):
// a second turn and a tool loop send the earlier output back as item references.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, tool } from "ai";
import { baseURL, report } from "./lib.mjs";

await report(async () => {
  const openai = createOpenAI({ baseURL: baseURL(), apiKey: "unused" });
  const model = openai("up");
  const messages = [{ role: "user", content: "Say hello." }];
  const first = await generateText({ model, messages, maxRetries: 0 });
  messages.push(...first.response.messages, { role: "user", content: "Once more." });
  const second = await generateText({ model, messages, maxRetries: 0 });
  const executed = [];
  const loop = await generateText({
    model,
    prompt: "What is the weather in Paris?",
    tools: {
      get_weather: tool({
        description: "Current weather for a city",
        inputSchema: jsonSchema({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
        execute: async ({ city }) => {
          executed.push(city);
          return `sunny in ${city}`;
        },
      }),
    },
    stopWhen: stepCountIs(3),
    maxRetries: 0,
  });
  return {
    first: first.text,
    second: second.text,
    references: first.response.messages.flatMap((m) => m.content).length,
    loop: { text: loop.text, steps: loop.steps.length, executed, finishReason: loop.finishReason },
  };
});
