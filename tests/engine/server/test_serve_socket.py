"""The serve process's listening socket (server/serve.py ``_bind``): its connections must
have Nagle off, or every keep-alive answer uvicorn writes in two sends waits for the
client's delayed ACK (~40 ms a request: the Tinker SDK's calls each paid it twice)."""

from __future__ import annotations

import asyncio
import socket

from loraplex_engine.server.serve import _bind


def test_accepted_connections_have_nagle_off() -> None:
    """uvicorn serves the socket through asyncio, which sets TCP_NODELAY on an accepted
    socket only when its proto says TCP (asyncio.base_events._set_nodelay)."""
    seen: list[int] = []

    async def main() -> None:
        listener = _bind("127.0.0.1", 0)
        port = listener.getsockname()[1]

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(200):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
