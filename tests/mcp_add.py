"""A minimal MCP server on stdio (JSON-RPC lines) with one tool, `add`: for the Codex test of
tests/test_responses_api.py (Codex sends an MCP server's tools as a `namespace` tool)."""

import json
import sys


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


ADD = {
    "name": "add",
    "description": "Add two numbers.",
    "inputSchema": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}

for line in sys.stdin:
    message = json.loads(line)
    mid, method = message.get("id"), message.get("method")
    if method == "initialize":
        version = message["params"].get("protocolVersion", "2025-06-18")
        info = {
            "protocolVersion": version,
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "demo", "version": "1"},
        }
        send({"jsonrpc": "2.0", "id": mid, "result": info})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [ADD]}})
    elif method == "tools/call":
        args = message["params"]["arguments"]
        send(
            {"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": str(args["a"] + args["b"])}]}}
        )
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
