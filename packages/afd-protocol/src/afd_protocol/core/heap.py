"""Keep Python's cyclic garbage collector off the serving path.

A prefill process allocates most of its Python objects once: imports (torch alone brings
hundreds of thousands), the model, the transport. Left in the collector's generations,
they are walked again by the first full (generation 2) collection, which the allocation
count triggers at an unpredictable point of the run -- a pause of about 90 ms on the
2-core CPU VM, measured inside ``afd run`` 1A1F as one combine that waited 88-105 ms for
a reply the FFN rank had sent 1.8 ms after the dispatch. Whatever work item is in flight
then stalls every rank that waits on it.

:func:`freeze_heap`, called once after start-up and warm-up, collects what is already
garbage and moves every surviving object to the permanent generation (``gc.freeze``),
so later collections only walk objects made while serving. vLLM's engine does the same
after its start-up. The collector stays enabled: cycles made while serving are still
freed.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze every surviving object; returns how many objects are frozen
    (the total, including earlier calls). Call it after start-up and warm-up, before the
    first timed or served work item; calling it again later freezes what was added since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
