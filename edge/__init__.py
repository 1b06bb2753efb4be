"""The iop edge: an OpenAI-compatible front for nodes that dial in."""
