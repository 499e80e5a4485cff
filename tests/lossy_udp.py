"""A UDP forwarder that loses and delays datagrams like `tc netem loss L% delay D J`, for kernels
without the netem qdisc (minimal VM kernels often lack it: "Specified qdisc kind is unknown").

It stands in front of one upstream server (here a TURN server) and forwards each client's datagrams
from a socket of its own, as a NAT would, so the upstream tells the clients apart. Datagrams of the
clients chosen by `impair` are dropped with probability `loss` and otherwise held back by a delay
drawn uniformly from `delay +- jitter` (netem's default jitter), both ways; that reorders them as
netem does. The random draws are seeded, so a run is repeatable.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Counters:
    forwarded: int = 0
    dropped: int = 0


@dataclass
class LossyUdpForwarder:
    listen: tuple[str, int]
    upstream: tuple[str, int]
    loss: float = 0.0
    delay: float = 0.0  # seconds
    jitter: float = 0.0
    impair: Callable[[tuple[str, int]], bool] = lambda client: True
    seed: int = 1
    enter: Callable[[], None] = lambda: None  # run first on the forwarder's thread (e.g. enter a namespace)
    counters: Counters = field(default_factory=Counters)

    def start(self) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="lossy-udp", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _main(self) -> None:
        try:
            self.enter()
            self._loop = asyncio.new_event_loop()
            self._random = random.Random(self.seed)
            self._loop.run_until_complete(self._open())
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _open(self) -> None:
        self._clients: dict[tuple[str, int], asyncio.Task] = {}  # client -> its upstream socket
        self._front, _ = await self._loop.create_datagram_endpoint(lambda: _Front(self), local_addr=self.listen)

    def _send_later(self, send: Callable[[], None], client: tuple[str, int]) -> None:
        if not self.impair(client):
            self.counters.forwarded += 1
            send()
            return
        if self._random.random() < self.loss:
            self.counters.dropped += 1
            return
        self.counters.forwarded += 1
        self._loop.call_later(max(0.0, self._random.uniform(self.delay - self.jitter, self.delay + self.jitter)), send)

    def from_client(self, data: bytes, client: tuple[str, int]) -> None:
        opening = self._clients.get(client)
        if opening is None:  # the client's first datagram: its own socket towards the upstream
            opening = self._clients[client] = self._loop.create_task(self._loop.create_datagram_endpoint(
                lambda: _Back(self, client), remote_addr=self.upstream))

        async def forward() -> None:
            upstream, _ = await opening
            self._send_later(lambda: upstream.sendto(data), client)
        self._loop.create_task(forward())

    def from_upstream(self, data: bytes, client: tuple[str, int]) -> None:
        self._send_later(lambda: self._front.sendto(data, client), client)


class _Front(asyncio.DatagramProtocol):
    def __init__(self, owner: LossyUdpForwarder) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr) -> None:
        self.owner.from_client(data, addr[:2])


class _Back(asyncio.DatagramProtocol):
    def __init__(self, owner: LossyUdpForwarder, client: tuple[str, int]) -> None:
        self.owner, self.client = owner, client

    def datagram_received(self, data: bytes, addr) -> None:
        self.owner.from_upstream(data, self.client)
