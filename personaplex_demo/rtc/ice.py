"""ICE configuration: which STUN and TURN servers the page and the server use to meet. The first source
set wins: `PERSONAPLEX_ICE_SERVERS`, `PERSONAPLEX_TURN_URL` and/or `PERSONAPLEX_STUN_URL`, then `HF_TOKEN`
(fastrtc's Cloudflare TURN); without any, direct routes only (docs/operations.md § TURN and ICE servers)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from aiortc import RTCConfiguration, RTCIceServer, RTCIceTransportPolicy
from aiortc.rtcicetransport import parse_stun_turn_uri

log = logging.getLogger(__name__)

ICE_SERVERS_VAR = "PERSONAPLEX_ICE_SERVERS"
TURN_URL_VAR = "PERSONAPLEX_TURN_URL"
TURN_USERNAME_VAR = "PERSONAPLEX_TURN_USERNAME"
TURN_CREDENTIAL_VAR = "PERSONAPLEX_TURN_CREDENTIAL"
STUN_URL_VAR = "PERSONAPLEX_STUN_URL"
RELAY_ONLY_VAR = "PERSONAPLEX_ICE_RELAY_ONLY"
LOOPBACK_VAR = "PERSONAPLEX_LOOPBACK_ICE"


class IceConfigError(ValueError):
    """ICE settings in the environment that cannot work; the message says which and why."""


def _check_url(url: Any, where: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise IceConfigError(f"{where}: each URL must be a non-empty string, got {url!r}")
    url = url.strip()
    try:
        parse_stun_turn_uri(url)
    except ValueError as e:
        raise IceConfigError(f"{where}: {url!r} is not a stun:, stuns:, turn: or turns: URL ({e})") from None
    return url


def parse_server(raw: Any, where: str) -> dict[str, Any]:
    """One `RTCIceServer` object, checked; TURN URLs need a username and a credential."""
    if not isinstance(raw, Mapping):
        raise IceConfigError(f'{where}: expected an object with "urls", got {type(raw).__name__}')
    unknown = set(raw) - {"urls", "username", "credential"}
    if unknown:
        raise IceConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: urls, username, credential")
    urls = raw.get("urls")
    urls = [urls] if isinstance(urls, str) else urls
    if not isinstance(urls, list) or not urls:
        raise IceConfigError(f'{where}: "urls" must be a URL or a non-empty list of URLs')
    server: dict[str, Any] = {"urls": [_check_url(u, where) for u in urls]}
    for key in ("username", "credential"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise IceConfigError(f'{where}: "{key}" must be a string')
        if value:
            server[key] = value
    if any(u.startswith("turn") for u in server["urls"]) and not ("username" in server and "credential" in server):
        raise IceConfigError(f'{where}: a TURN server needs a "username" and a "credential"')
    return server


def parse_servers_json(text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise IceConfigError(f"{ICE_SERVERS_VAR} is not valid JSON: {e}") from None
    if isinstance(data, Mapping) and "iceServers" in data:
        data = data["iceServers"]
    if isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list) or not data:
        raise IceConfigError(f'{ICE_SERVERS_VAR} must hold a non-empty list of ICE servers (objects with "urls")')
    return [parse_server(s, f"{ICE_SERVERS_VAR}[{i}]") for i, s in enumerate(data)]


def own_servers(env: Mapping[str, str]) -> list[dict[str, Any]] | None:
    """The operator's own ICE servers, or None when none are set."""
    if env.get(ICE_SERVERS_VAR, "").strip():
        return parse_servers_json(env[ICE_SERVERS_VAR])
    servers = []
    if env.get(TURN_URL_VAR, "").strip():
        urls = [u for u in env[TURN_URL_VAR].split(",") if u.strip()]
        servers.append(parse_server({"urls": urls, "username": env.get(TURN_USERNAME_VAR) or None,
                                     "credential": env.get(TURN_CREDENTIAL_VAR) or None}, TURN_URL_VAR))
    if env.get(STUN_URL_VAR, "").strip():
        servers.append(parse_server({"urls": env[STUN_URL_VAR]}, STUN_URL_VAR))
    return servers or None


def _relay(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "iceTransportPolicy": "relay"}


def cloudflare_configs(relay_only: bool) -> tuple[Any, Any]:
    """fastrtc's Cloudflare TURN through HF_TOKEN: fresh credentials per call for the page, one
    long-lived set for the server."""
    from fastrtc import get_cloudflare_turn_credentials, get_cloudflare_turn_credentials_async

    try:
        server = get_cloudflare_turn_credentials(ttl=360_000)
    except Exception as e:  # no network to the TURN service: the page can still try direct routes
        log.warning("TURN credentials unavailable (%s); calls need a direct route", type(e).__name__)
        return None, None
    if not relay_only:
        return get_cloudflare_turn_credentials_async, server

    async def page() -> dict[str, Any]:
        return _relay(await get_cloudflare_turn_credentials_async())

    return page, _relay(server)


def rtc_configs(environ: Mapping[str, str] | None = None) -> tuple[Any, dict[str, Any] | None]:
    """(page configuration: dict or async callable, or None; server configuration dict, or None).

    Raises IceConfigError for settings that cannot work, so a typo stops the start instead of
    leaving every remote call unable to connect."""
    env = os.environ if environ is None else environ
    relay_only = env.get(RELAY_ONLY_VAR, "").strip().lower() in ("1", "true", "yes", "on")
    servers = own_servers(env)
    if servers is not None:
        config = {"iceServers": servers}
        if relay_only:
            config = _relay(config)
        log.info("ICE servers: %s%s", ", ".join(u for s in servers for u in s["urls"]),
                 " (relay only)" if relay_only else "")
        return config, config
    if env.get("HF_TOKEN"):
        return cloudflare_configs(relay_only)
    if relay_only:
        raise IceConfigError(f"{RELAY_ONLY_VAR}=1 needs a TURN server: set {ICE_SERVERS_VAR}, {TURN_URL_VAR} or "
                             "HF_TOKEN")
    if env.get(LOOPBACK_VAR) == "1":
        # No STUN on loopback: aiortc's default STUN host costs a DNS lookup per call, and on a
        # closed network that lookup can hang in an executor thread.
        return None, {"iceServers": []}
    return None, None


def server_configuration(config: Mapping[str, Any] | None) -> RTCConfiguration | None:
    """aiortc's configuration from the dict form, keeping `iceTransportPolicy` (fastrtc's own
    conversion drops it, so a relay-only server would still offer its host addresses)."""
    if config is None:
        return None
    servers = [RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential"))
               for s in config.get("iceServers", [])]
    relay = config.get("iceTransportPolicy") == "relay"
    return RTCConfiguration(iceServers=servers,
                            iceTransportPolicy=RTCIceTransportPolicy.RELAY if relay else RTCIceTransportPolicy.ALL)
