(() => {
  const Peer = window.RTCPeerConnection;
  if (!Peer) return;
  const HOLD = __HOLD__, SEND = __SEND__;
  window.RTCPeerConnection = function (...args) {
    const pc = new Peer(...args);
    const held = new Map();  // audio sender -> its microphone track, while the call waits
    const hear = async (data) => {
      let msg;
      try { msg = JSON.parse(data); } catch { return; }
      if (!msg || msg.type !== "log") return;
      if (msg.data === HOLD) {
        for (const sender of pc.getSenders()) {
          if (sender.track && sender.track.kind === "audio") {
            held.set(sender, sender.track);
            await sender.replaceTrack(null);
          }
        }
      } else if (msg.data === SEND) {
        for (const [sender, track] of held) {
          held.delete(sender);
          if (pc.signalingState !== "closed") await sender.replaceTrack(track);
        }
      }
    };
    const open = pc.createDataChannel.bind(pc);
    pc.createDataChannel = (...a) => {
      const channel = open(...a);
      channel.addEventListener("message", (e) => hear(e.data));
      return channel;
    };
    const close = pc.close.bind(pc);
    pc.close = () => {  // fastrtc stops the tracks its senders hold; a held one is ours to stop
      for (const track of held.values()) track.stop();
      held.clear();
      return close();
    };
    return pc;
  };
  window.RTCPeerConnection.prototype = Peer.prototype;
  Object.setPrototypeOf(window.RTCPeerConnection, Peer);
})();
