// Vercel AI SDK: generateText with a tool that the model calls; reports the call as the SDK
// parsed it and what the tool's execute() received.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, jsonSchema, tool } from "ai";
import { baseURL, report } from "./lib.mjs";

await report(async () => {
  const provider = createOpenAICompatible({ name: "iop", baseURL: baseURL(), apiKey: "unused" });
  const executed = [];
  const getWeather = tool({
    description: "Current weather for a city",
    inputSchema: jsonSchema({
      type: "object",
      properties: { city: { type: "string" }, unit: { enum: ["c", "f"] } },
      required: ["city"],
      additionalProperties: false,
    }),
    execute: async (input) => {
      executed.push(input);
      return { forecast: "sunny" };
    },
  });
  const result = await generateText({
    model: provider("up"),
    prompt: "What is the weather in Paris?",
    tools: { get_weather: getWeather },
    maxRetries: 0,
  });
  return {
    finishReason: result.finishReason,
    toolCalls: result.toolCalls.map((c) => ({ toolCallId: c.toolCallId, toolName: c.toolName, input: c.input })),
    toolResults: result.toolResults.map((r) => ({ toolName: r.toolName, output: r.output })),
    executed,
  };
});
