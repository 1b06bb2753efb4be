"""The Anthropic Messages API front door (``POST /v1/messages``)."""
