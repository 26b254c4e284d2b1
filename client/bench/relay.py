"""A TCP relay that adds a fixed one-way delay both ways: a home network's round trip, on a kernel
without `tc netem`. Each chunk is forwarded `delay` after it arrived, so a long message streams as
it would over a link (chunks overlap in flight) instead of waiting `delay` per chunk.

    python -m client.bench.relay LISTEN_PORT DEST_HOST:DEST_PORT RTT_MS
"""

from __future__ import annotations

import asyncio
import sys
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay, data))
    finally:
        queue.put_nowait((0.0, b""))
        try:
            await sender
        finally:
            writer.close()


async def serve(listen_port: int, dest: str, rtt_ms: float) -> None:
    host, port = dest.rsplit(":", 1)
    delay = rtt_ms / 2e3

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pipe(reader, up_writer, delay), _pipe(up_reader, writer, delay), return_exceptions=True
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    asyncio.run(serve(int(argv[0]), argv[1], float(argv[2])))


if __name__ == "__main__":
    main(sys.argv[1:])
