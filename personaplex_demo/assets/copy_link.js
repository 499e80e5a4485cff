(voice, preset, persona, text_temperature, text_top_k, audio_temperature, audio_top_k, seed) => {
  const presets = __PRESETS__, limit = __LIMIT__;
  const base = window.location.origin + window.location.pathname;
  const head = new URLSearchParams();
  head.set("voice", voice);
  const usePreset = Object.prototype.hasOwnProperty.call(presets, preset) && presets[preset] === persona;
  const tail = new URLSearchParams({text_temperature, text_top_k, audio_temperature, audio_top_k, seed});
  const link = (text) => {
    const p = new URLSearchParams(head);
    if (usePreset) p.set("preset", preset); else p.set("persona", text);
    return base + "?" + p.toString() + "&" + tail.toString();
  };
  let url = link(persona), notice = "";
  if (!usePreset && url.length > limit) {
    const chars = Array.from(persona);  // code points: never split a surrogate pair
    let lo = 0, hi = chars.length;
    while (lo < hi) {  // the longest prefix that fits
      const mid = Math.ceil((lo + hi) / 2);
      if (link(chars.slice(0, mid).join("")).length <= limit) lo = mid; else hi = mid - 1;
    }
    url = link(chars.slice(0, lo).join(""));
    notice = `The persona is too long for a link: it was cut to its first ${lo} of ${chars.length} characters.`;
  }
  try { navigator.clipboard.writeText(url).catch(() => {}); } catch (e) { /* no clipboard: the box has it */ }
  return [url, notice || "Link copied. It sets the voice, the persona and the sampling settings."];
}
