"""Engines as Ray actors on the machines of a Ray cluster (`--engines ray`), behind the same room.

Ray places the engines (one per GPU, or per `personaplex_engine` resource on a CPU node), finds
them by name, restarts one that died (`max_restarts`) and reports a dead one; the frames travel
over each engine's own TCP link (`pool_server.PoolServer`, the same batched channel the engine
processes of one machine use), at half the latency and CPU of a Ray call per tick
(docs/design-notes.md § Ray engines). Only `--engines ray` imports Ray.

    engine_actor.py   the actor: an engine, its SlotPool and a PoolServer on the node's address
    engines.py        the page's side: start or find the actors, link to each, notice deaths and
                      comebacks
"""
