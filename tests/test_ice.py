"""ICE configuration from the environment: own TURN/STUN servers, relay-only, and clear errors."""

from __future__ import annotations

import json

import pytest
from aiortc import RTCIceTransportPolicy

from personaplex_demo.rtc.ice import IceConfigError, rtc_configs, server_configuration

TURN = {"urls": "turn:turn.example.com:3478?transport=udp", "username": "u", "credential": "p"}


def test_servers_as_json_list_object_or_whole_configuration():
    for raw in ([TURN, {"urls": ["stun:stun.example.com"]}], {"iceServers": [TURN]}, TURN):
        page, server = rtc_configs({"PERSONAPLEX_ICE_SERVERS": json.dumps(raw)})
        assert page is server  # the page and the server use the same servers
        assert page["iceServers"][0] == {"urls": [TURN["urls"]], "username": "u", "credential": "p"}
        assert "iceTransportPolicy" not in page


def test_turn_url_username_and_credential_vars():
    page, server = rtc_configs({"PERSONAPLEX_TURN_URL": "turn:10.0.0.1:3478, turns:t.example.com:5349?transport=tcp",
                                "PERSONAPLEX_TURN_USERNAME": "user", "PERSONAPLEX_TURN_CREDENTIAL": "secret",
                                "PERSONAPLEX_STUN_URL": "stun:stun.example.com:3478"})
    assert page == {"iceServers": [
        {"urls": ["turn:10.0.0.1:3478", "turns:t.example.com:5349?transport=tcp"], "username": "user",
         "credential": "secret"},
        {"urls": ["stun:stun.example.com:3478"]}]}


def test_relay_only_reaches_the_page_and_the_server():
    page, server = rtc_configs({"PERSONAPLEX_ICE_SERVERS": json.dumps([TURN]), "PERSONAPLEX_ICE_RELAY_ONLY": "1"})
    assert page["iceTransportPolicy"] == "relay"
    aiortc_config = server_configuration(server)
    assert aiortc_config.iceTransportPolicy == RTCIceTransportPolicy.RELAY
    assert aiortc_config.iceServers[0].urls == [TURN["urls"]] and aiortc_config.iceServers[0].credential == "p"
    assert server_configuration({"iceServers": []}).iceTransportPolicy == RTCIceTransportPolicy.ALL
    assert server_configuration(None) is None


@pytest.mark.parametrize("env, message", [
    ({"PERSONAPLEX_ICE_SERVERS": "[{urls: 'turn:x'}]"}, "is not valid JSON"),
    ({"PERSONAPLEX_ICE_SERVERS": "[]"}, "non-empty list"),
    ({"PERSONAPLEX_ICE_SERVERS": '[{"urls": "http://turn.example.com"}]'}, "is not a stun:, stuns:, turn: or turns: URL"),
    ({"PERSONAPLEX_ICE_SERVERS": '[{"urls": "turn:turn.example.com"}]'}, 'needs a "username" and a "credential"'),
    ({"PERSONAPLEX_ICE_SERVERS": '[{"url": "stun:s.example.com"}]'}, "unknown keys ['url']"),
    ({"PERSONAPLEX_ICE_SERVERS": '[{"urls": []}]'}, '"urls" must be a URL or a non-empty list'),
    ({"PERSONAPLEX_ICE_SERVERS": '[{"urls": "turn:t:3478", "username": 5, "credential": "p"}]'}, "must be a string"),
    ({"PERSONAPLEX_TURN_URL": "turn:t.example.com"}, "PERSONAPLEX_TURN_URL: a TURN server needs"),
    ({"PERSONAPLEX_ICE_RELAY_ONLY": "1"}, "needs a TURN server"),
])
def test_unusable_settings_are_refused_with_the_reason(env, message):
    with pytest.raises(IceConfigError) as info:
        rtc_configs(env)
    assert message in str(info.value)
    assert "p\"" not in str(info.value)  # never a credential


def test_without_settings_direct_routes_or_loopback():
    assert rtc_configs({}) == (None, None)
    assert rtc_configs({"PERSONAPLEX_LOOPBACK_ICE": "1"}) == (None, {"iceServers": []})


async def test_hf_token_gives_cloudflare_turn_and_relay_only_wraps_it(monkeypatch):
    import fastrtc

    server = {"iceServers": [TURN]}

    async def fresh():
        return {"iceServers": [{**TURN, "username": "fresh"}]}

    monkeypatch.setattr(fastrtc, "get_cloudflare_turn_credentials", lambda ttl: server)
    monkeypatch.setattr(fastrtc, "get_cloudflare_turn_credentials_async", fresh)
    assert rtc_configs({"HF_TOKEN": "hf_x"}) == (fresh, server)
    page, relay_server = rtc_configs({"HF_TOKEN": "hf_x", "PERSONAPLEX_ICE_RELAY_ONLY": "1"})
    assert relay_server == {**server, "iceTransportPolicy": "relay"}
    assert await page() == {"iceServers": [{**TURN, "username": "fresh"}], "iceTransportPolicy": "relay"}
    # Own servers win over HF_TOKEN: no request to the TURN service at all.
    monkeypatch.setattr(fastrtc, "get_cloudflare_turn_credentials", lambda ttl: pytest.fail("contacted"))
    assert rtc_configs({"HF_TOKEN": "hf_x", "PERSONAPLEX_STUN_URL": "stun:s.example.com"})[0] is not None


def test_the_app_refuses_to_start_with_unusable_ice_settings(monkeypatch, caplog):
    from personaplex_demo.cli import app

    monkeypatch.setenv("PERSONAPLEX_ICE_SERVERS", '[{"urls": "turn:t.example.com"}]')
    monkeypatch.setattr(app, "setup_logging", lambda verbose=False: None)
    assert app.main(["--model", "tiny"]) == 2
    assert 'a TURN server needs a "username" and a "credential"' in caplog.text


def test_the_page_and_server_get_the_relay_policy(tiny_cache_dir, recordings):
    from fastrtc import WebRTC

    from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
    from personaplex_demo.serving.pool import SlotPool
    from personaplex_demo.web.page import PageOptions, build_ui

    config = {"iceServers": [TURN], "iceTransportPolicy": "relay"}
    runtime = build_runtime(RuntimeOptions(model="tiny", slots=1, cache_dir=tiny_cache_dir))
    demo = build_ui(runtime, SlotPool(runtime.engine), PageOptions(rtc_configuration=config,
                                                                   server_rtc_configuration=config), recordings)
    rtc = next(b for b in demo.blocks.values() if isinstance(b, WebRTC))
    assert rtc.rtc_configuration["iceTransportPolicy"] == "relay"
    assert rtc.server_rtc_configuration.iceTransportPolicy == RTCIceTransportPolicy.RELAY

