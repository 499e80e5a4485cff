"""Who a request comes from, for the limits every door keeps per client address."""

from __future__ import annotations

from collections.abc import Mapping


def client_address(headers: Mapping[str, str], peer: str | None, trust_forwarded_for: bool = False) -> str:
    """The client's address: behind a proxy that sets X-Forwarded-For (a Space), the last hop it
    added (a client can forge the earlier ones); otherwise the peer's, since without such a proxy
    the header is whatever the client wrote."""
    if trust_forwarded_for:
        forwarded = [part.strip() for part in headers.get("x-forwarded-for", "").split(",") if part.strip()]
        if forwarded:
            return forwarded[-1]
    return peer or "unknown"
