(() => {
  let every = __REFRESH__ * 1000, timer = null;
  const show = (parts) => {
    const el = document.querySelector("#stats .room-figures");
    if (!el) return;
    const nodes = [];
    parts.forEach(([label, text], i) => {
      if (i) nodes.push(document.createTextNode(" · "));
      if (label) {
        const b = document.createElement("strong");
        b.textContent = label;
        nodes.push(b, document.createTextNode(" "));
      }
      nodes.push(document.createTextNode(text));
    });
    el.replaceChildren(...nodes);
  };
  const ask = async () => {
    clearTimeout(timer);
    if (!document.hidden) {
      try {
        const r = await fetch(new URL("api/room", document.baseURI), {cache: "no-store"});
        if (!r.ok) throw new Error(r.status);
        const room = await r.json();
        every = room.refresh_seconds * 1000;
        show(room.parts);
      } catch (e) {
        every = Math.min(every * 2, 60000);  // refused or unreachable: ask less often
      }
    }
    timer = setTimeout(ask, every);
  };
  document.addEventListener("visibilitychange", () => { if (!document.hidden) ask(); });
  timer = setTimeout(ask, every);
})();
