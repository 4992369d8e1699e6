"""The gateway process's garbage collector: how often it runs, and what it never walks again.

A gateway serving the default config holds about 480,000 objects the collector
tracks (its imports, torch's and transformers' modules, the loaded model), nearly
all of them alive for the process's life. Every full collection walks all of them,
about 0.34 s here, during which the event loop answers nothing. Frozen
(``gc.freeze``) once the gateway is up and again once a model has loaded, they are
never walked again: a full collection then costs what was allocated since.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiplexer.gateway.gateway import Gateway

# Pool events after which a model's objects are in place for the process's life.
SETTLED = frozenset({"local.model_loaded", "local.compiled", "local.compile_slower",
                     "local.compile_failed"})


def tune_gc(young: int | None) -> None:
    """The gateway's collector threshold for new objects (``server.gc_young_threshold``).

    With Python's 700, a gateway serving a local model ran a young pass every 11 embed
    calls at about 0.3 ms each (its in-flight requests' objects survive and are walked
    again each pass): 0.04 ms per call, 7% of its event loop. At 10,000 it ran one pass
    per thousand calls; what it costs is up to that many cyclic objects left a little longer."""
    if young is not None:
        gc.set_threshold(young, *gc.get_threshold()[1:])


def freeze(*, collect: bool) -> None:
    """Exempt every object alive now from later collections; ``collect`` first so that no
    garbage is frozen with them (one full pause, before serving)."""
    if collect:
        gc.collect()
    gc.freeze()


def serving(gateway: Gateway) -> None:
    """Called by each face that serves a process (HTTP, stdio) once its gateway is up, before
    the first call: freeze now and once each model settles, unless ``server.freeze_heap`` is off."""
    if gateway.config.server.freeze_heap:
        freeze(collect=True)
        gateway.listeners.append(on_event)


def on_event(event: str, data: dict[str, Any]) -> None:
    """A gateway listener: freeze again once a model's objects are in place (loading the default
    model imports torch and transformers: 240,000 more objects). No collection here, so calls
    waiting for the model wait no longer. What is alive at that moment is frozen with the model,
    calls in flight included: the few of their objects that end in reference cycles, and the
    cyclic garbage not yet collected, are never freed. That is once per model event, bounded by
    what was in flight, against a pause of the loop at every full collection for the process's life."""
    if event in SETTLED:
        freeze(collect=False)
