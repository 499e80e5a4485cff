"""`PageRelay`: the page's WebRTC component with its calls carried by the media workers. Its offers,
trickled candidates and inputs go to the worker that owns the call (a new call to the least loaded);
each worker's page updates are mirrored into the component's own tables. Runs on the web server's loop."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from fastrtc import AdditionalOutputs

from ..procs import messages as msg
from ..rtc import candidates
from ..rtc.patches import route_offers

OFFER_TIMEOUT = 30.0
WORKER_LOST = ("Call ended: the server's media process for this call stopped. Please press Record to "
               "call again.")


def _failed(error: str, **meta: Any) -> JSONResponse:
    """fastrtc's own shape for a refused offer (the page shows a toast for some of them)."""
    return JSONResponse(status_code=200, content={"status": "failed", "meta": {"error": error, **meta}})


class PageRelay:
    def __init__(self, workers) -> None:
        """`workers`: the MediaWorkers whose processes carry the calls."""
        self.workers = workers
        self.rtc = None
        self._owner: dict[str, Any] = {}  # webrtc id -> its worker's record
        self._last_update: dict[str, tuple] = {}

    def attach(self, rtc) -> None:
        """Forward `rtc`'s offers and inputs to the workers (rtc/patches.py `route_offers`)."""
        self.rtc = rtc
        route_offers(rtc, self.offer, self.set_input)

    async def offer(self, body: dict[str, Any]):
        self.workers.on_loop()
        webrtc_id = str(body.get("webrtc_id"))
        if body.get("type") == "ice-candidate":
            # The page trickles candidates beside its offer: one may come before the offer's request.
            await candidates.wait_until(lambda: webrtc_id in self._owner)
            worker = self._owner.get(webrtc_id)
            if worker is None:
                return _failed("unknown_connection")
            return await self._forward_offer(worker, body)
        if webrtc_id in self._owner:
            return _failed("connection_already_exists")
        limit = self.rtc.concurrency_limit
        if len(self._owner) >= limit:
            return _failed("concurrency_limit_reached", limit=limit)
        worker = self.workers.least_loaded()
        if worker is None:
            return _failed("no media worker is running; try again in a few seconds")
        self._own(webrtc_id, worker)
        response = await self._forward_offer(worker, body)
        if isinstance(response, JSONResponse):  # refused: nothing to mirror
            self._disown(webrtc_id)
        return response

    async def _forward_offer(self, worker, body: dict[str, Any]):
        try:
            content, status_code = await self.workers.request(worker, lambda rid: msg.Offer(rid, body),
                                                              OFFER_TIMEOUT)
        except Exception as exc:
            return _failed(f"media worker {worker.index}: {exc}")
        return content if status_code is None else JSONResponse(status_code=status_code, content=content)

    def set_input(self, webrtc_id: str, *args) -> None:
        worker = self._owner.get(webrtc_id)
        if worker is not None:
            # The first argument is the component's value (a WebRTCData or the id): plain data only.
            plain = [getattr(a, "webrtc_id", a) for a in args]
            worker.child.send(msg.Input(webrtc_id, plain))

    def _own(self, webrtc_id: str, worker) -> None:
        self._owner[webrtc_id] = worker
        worker.calls.add(webrtc_id)
        # The page's relay may start before the first update arrives: give it a queue to wait on.
        self.rtc.connections[webrtc_id] = [worker]
        _ = self.rtc.additional_outputs[webrtc_id]

    def _disown(self, webrtc_id: str) -> None:
        worker = self._owner.pop(webrtc_id, None)
        if worker is not None:
            worker.calls.discard(webrtc_id)
        self._last_update.pop(webrtc_id, None)
        self.rtc.connections.pop(webrtc_id, None)
        outputs = self.rtc.additional_outputs.pop(webrtc_id, None)
        if outputs is not None:
            outputs.quit.set()

    def mirror(self, message: msg.Outputs | msg.Closed) -> None:
        """A worker's page update, or a connection it closed."""
        match message:
            case msg.Outputs(webrtc_id=webrtc_id, args=args) if webrtc_id in self._owner:
                self._last_update[webrtc_id] = args
                self.rtc.additional_outputs[webrtc_id].queue.put_nowait(AdditionalOutputs(*args))
            case msg.Closed(webrtc_id=webrtc_id, final=final) if webrtc_id in self._owner:
                if final is not None:
                    self.rtc.event_handler.final_updates.put(webrtc_id, final)
                self._disown(webrtc_id)

    def worker_gone(self, worker) -> None:
        """`worker` stopped: its calls' pages are told why."""
        if self.rtc is None:
            return
        for webrtc_id in list(worker.calls):
            last = self._last_update.get(webrtc_id)
            transcript, call_id = (last[0], last[2]) if last else ("", "")
            self.rtc.event_handler.final_updates.put(webrtc_id, (transcript, WORKER_LOST, call_id, None))
            self._disown(webrtc_id)
