"""Clients for a running `minisarathi serve` (see docs/protocol.md)."""
from .server.client import AsyncClient, AsyncStream, Client, GenerateResult, Stream, StreamChunk
from .server.protocol import RPCError

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "StreamChunk", "GenerateResult", "RPCError"]
