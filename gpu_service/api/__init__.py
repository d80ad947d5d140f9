"""Requests in, answers out: the gRPC Generate service, the OpenAI-compatible HTTP API, admission
(checks and limits), chat templates and tokenization, tool calls, reasoning, structured outputs."""
