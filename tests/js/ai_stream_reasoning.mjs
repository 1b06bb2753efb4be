// Vercel AI SDK: streamText with a tool attached (JSON Schema) against a model that reasons
// before it answers; reports the reasoning as the SDK sees it (result and full stream).
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { jsonSchema, streamText, tool } from "ai";
import { baseURL, describeError, report } from "./lib.mjs";

await report(async () => {
  const provider = createOpenAICompatible({ name: "iop", baseURL: baseURL(), apiKey: "unused" });
  const getWeather = tool({
    description: "Current weather for a city",
    inputSchema: jsonSchema({
      type: "object",
      properties: { city: { type: "string" } },
      required: ["city"],
      additionalProperties: false,
    }),
    execute: async ({ city }) => `sunny in ${city}`,
  });
  const errors = [];
  const result = streamText({
    model: provider("up"),
    prompt: "What is the weather in Paris?",
    tools: { get_weather: getWeather },
    maxRetries: 0,
  });
  const types = [];
  let streamedReasoning = "";
  for await (const part of result.fullStream) {
    if (!types.includes(part.type)) types.push(part.type);
    if (part.type === "reasoning-delta") streamedReasoning += part.text;
    if (part.type === "error") errors.push(describeError(part.error));
  }
  return {
    text: await result.text,
    reasoningText: (await result.reasoningText) ?? null,
    streamedReasoning,
    finishReason: await result.finishReason,
    types,
    errors,
  };
});
