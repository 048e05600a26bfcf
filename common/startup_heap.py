"""A long-lived process's startup heap, taken out of the garbage collector's walk (vLLM's engine
core and API server do the same)."""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Take what the process holds once it is up (an engine's model, torch and tokenizer; an API
    server's Ray and FastAPI: hundreds of thousands of objects) out of the collector's view. Each
    collection of the oldest generation walks every object it sees, and one that lands mid-run
    otherwise stalls the step loop or the event loop for a fifth of a second on this CPU (a TBT
    spike; a GPU left idle). Garbage made later is still collected; what is frozen is still freed
    when nothing refers to it, and thawed at exit for the interpreter's last collection
    (extensions report what it leaves)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many times a process calls this
    atexit.register(gc.unfreeze)
