"""Server-Sent Events, as the HTTP APIs stream: one JSON object an event."""
from __future__ import annotations

import json

from aiohttp import web


async def open_stream(request, named: bool = False):
    """-> (the prepared response, send(event)). named: each event also carries its type in an `event:` line
    (Anthropic's and the Responses API's streams); else `data:` only (chat/completions')."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)

    async def send(event: dict) -> None:
        head = f"event: {event['type']}\n" if named else ""
        await resp.write(f"{head}data: {json.dumps(event, separators=(',', ':'))}\n\n".encode())
    return resp, send
