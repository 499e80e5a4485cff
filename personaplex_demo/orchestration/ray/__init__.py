"""Engines as Ray actors on the machines of a Ray cluster (`--engines ray`), behind the same room;
the frames travel over each engine's own TCP link, not Ray calls (docs/design-notes.md § Ray engines).
Only `--engines ray` imports Ray."""
