"""A WebSocket connection handed to a media worker (procs/socket_handoff.py): uvicorn's protocol serves it
there with the request the main process read, and the scope carries the connection's socket, which the door
asks how much the kernel holds for a client that stopped reading (api/wire.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket

from personaplex_demo.api.wire import kernel_send_queue
from personaplex_demo.procs.socket_handoff import WorkerSockets

from .callers import until

CHUNK = b"x" * 65536


async def test_a_handed_connection_is_served_with_its_socket_and_its_kernel_queue_is_read_from_it():
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future = loop.create_future()
    closed: list[dict] = []

    async def app(scope, receive, send):
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        accepted.set_result(scope)
        while True:  # to a client that reads none of it: the kernel holds what it can, then sending waits
            await send({"type": "websocket.send", "bytes": CHUNK})

    channel, main_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(listener.getsockname())
    connection, _ = listener.accept()
    workers = WorkerSockets(channel, app, closed.append)
    try:
        key = base64.b64encode(b"0123456789abcdef").decode()
        request = (f"GET /v1/realtime HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
        socket.send_fds(main_side, [json.dumps({"id": 7}).encode() + b"\n" + request], [connection.fileno()])
        connection.close()  # the main process's copy goes; the worker's descriptor serves the connection
        scope = await asyncio.wait_for(accepted, 30)
        handed = scope["state"]["socket"]
        assert handed.getpeername() == client.getsockname()
        assert scope["state"]["handoff"] == {"id": 7}

        await until(lambda: (kernel_send_queue(scope) or 0) > 4 * len(CHUNK), 3,
                    "the kernel to hold what the client's window refused", step=0.01)
        await asyncio.sleep(1.1)  # the host's tables are read at most once a second: the next look reads them
        before = kernel_send_queue(scope)
        from_tables = kernel_send_queue({k: v for k, v in scope.items() if k != "state"})
        after = kernel_send_queue(scope)  # the queue only grows while the client reads nothing
        assert from_tables is not None and before <= from_tables <= after, (before, from_tables, after)
    finally:
        client.close()
        await workers.close(2.0)
        main_side.close()
        listener.close()
    assert closed == [{"id": 7}]
