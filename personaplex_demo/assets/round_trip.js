(() => {
  const Peer = window.RTCPeerConnection;
  if (!Peer) return;
  const pcs = [];
  window.RTCPeerConnection = function (...args) { const pc = new Peer(...args); pcs.push(pc); return pc; };
  window.RTCPeerConnection.prototype = Peer.prototype;
  Object.setPrototypeOf(window.RTCPeerConnection, Peer);
  const PENDING = __PENDING__;
  let buffer = null, last = null, watched = null;
  const show = () => {
    const el = document.querySelector("#call-figures");
    if (!el) return;
    if (el !== watched) {
      watched = el;
      new MutationObserver(show).observe(el, {subtree: true, childList: true, characterData: true});
    }
    if (buffer === null) return;
    const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walk.nextNode(); node; node = walk.nextNode()) {
      const m = node.data.match(/round trip (\d+) ms/);
      if (m && node.data.includes(PENDING))
        node.data = node.data.replace(m[0] + PENDING,
          `round trip ${Math.round(+m[1] + buffer)} ms (browser buffer ${Math.round(buffer)} ms)`);
    }
  };
  setInterval(async () => {
    const pc = pcs.at(-1);
    if (!pc || pc.connectionState !== "connected") { last = null; return; }
    (await pc.getStats()).forEach((r) => {
      if (r.type !== "inbound-rtp" || r.kind !== "audio" || !r.jitterBufferEmittedCount) return;
      if (last && r.jitterBufferEmittedCount > last[1])
        buffer = 1e3 * (r.jitterBufferDelay - last[0]) / (r.jitterBufferEmittedCount - last[1]);
      last = [r.jitterBufferDelay, r.jitterBufferEmittedCount];
    });
    show();
  }, 2000);
})();
