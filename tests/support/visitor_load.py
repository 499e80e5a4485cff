"""Visitors for tests/test_visitors.py, run in a process of its own as if from other machines: open
tabs asking for the room's figures, a burst of page loads from as many addresses (a third of them
through a deep link), and one address
loading the page as fast as it can. Prints the answers' statuses by kind, as JSON.

    python tests/support/visitor_load.py BASE_URL [--seconds 8] [--tabs 40] [--pages 60] [--rate 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time

import httpx

FLOOD_ADDRESS = "127.9.9.9"
DEEP_LINK = "/?voice=NATM1&text_temperature=0.9&seed=7"


def client(base: str, address: str) -> httpx.AsyncClient:
    """A visitor's browser: its own loopback source address (the whole of 127/8 is this machine)."""
    return httpx.AsyncClient(base_url=base, timeout=30, transport=httpx.AsyncHTTPTransport(local_address=address))


async def page_load(base: str, address: str, link: str, apply_fn: int, counts: dict) -> None:
    """The page as a browser with the assets in its cache loads it; through a deep link, the
    page's script then has the link applied (one Gradio event, the query in its URL)."""
    async with client(base, address) as http:
        page = await http.get(link)
        counts["pages"][str(page.status_code)] += 1
        if page.status_code != 200 or "?" not in link:
            return
        session = f"v{random.getrandbits(40):x}"
        # As the page's script does: the hidden button's event, with the page's query.
        joined = await http.post("/gradio_api/queue/join" + link[1:], json={
            "data": [], "event_data": None, "fn_index": apply_fn, "trigger_id": None, "session_hash": session})
        counts["events"][str(joined.status_code)] += 1
        if joined.status_code != 200:
            return
        async with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            async for line in stream.aiter_lines():
                if '"process_completed"' in line or '"close_stream"' in line:
                    break


async def tab(base: str, address: str, until: float, counts: dict) -> None:
    """An open tab: the room's figures every five seconds, from a random phase."""
    async with client(base, address) as http:
        await asyncio.sleep(random.uniform(0, 5))
        while time.monotonic() < until:
            counts["tabs"][str((await http.get("/api/room")).status_code)] += 1
            await asyncio.sleep(5)


async def flood(base: str, until: float, counts: dict) -> None:
    async with client(base, FLOOD_ADDRESS) as http:
        async def one() -> None:
            while time.monotonic() < until:
                counts["flood"][str((await http.get("/")).status_code)] += 1

        await asyncio.gather(*(one() for _ in range(8)))


async def main(a: argparse.Namespace) -> dict:
    counts: dict = collections.defaultdict(collections.Counter)
    async with client(a.base, "127.3.0.1") as http:
        config = (await http.get("/config")).json()
    button = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "apply-link")
    apply_fn = next(d["id"] for d in config["dependencies"] if [button, "click"] in d["targets"])
    until = time.monotonic() + a.seconds
    jobs = [tab(a.base, f"127.4.0.{1 + i}", until, counts) for i in range(a.tabs)]
    jobs.append(flood(a.base, until, counts))

    async def burst() -> None:
        loads = []
        for i in range(a.pages):
            link = DEEP_LINK if i % 3 == 0 else "/"  # a third come through a deep link
            loads.append(asyncio.ensure_future(page_load(a.base, f"127.5.0.{1 + i}", link, apply_fn, counts)))
            await asyncio.sleep(1 / a.rate)
        await asyncio.gather(*loads)

    await asyncio.gather(burst(), *jobs)
    return {kind: dict(c) for kind, c in counts.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--tabs", type=int, default=40)
    ap.add_argument("--pages", type=int, default=60)
    ap.add_argument("--rate", type=float, default=30.0)
    print(json.dumps(asyncio.run(main(ap.parse_args()))))
