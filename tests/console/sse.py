"""Reading a Server-Sent Events stream in tests: one parsed message at a time, each with a deadline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Message:
    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


class SseReader:
    def __init__(self, response: httpx.Response) -> None:
        self._lines: AsyncIterator[str] = response.aiter_lines()

    async def _next(self) -> Message:
        event, data, event_id = "message", list[str](), None
        async for line in self._lines:
            if line == "":
                if data:
                    return Message(event, "\n".join(data), event_id)
                event, event_id = "message", None
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "id":
                event_id = value
            elif field == "data":
                data.append(value)
        raise EOFError("the stream ended")

    async def next(self, timeout: float = 20.0) -> Message:
        """The next message (comments skipped), or fail after `timeout` seconds."""
        return await asyncio.wait_for(self._next(), timeout)
