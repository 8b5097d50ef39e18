"""The cyclic garbage collector while a process imports its libraries.

Importing torch, DeepSpeed, transformers and vLLM leaves about a million objects that live as long
as the process. Every full pass of the collector walks all of them: the automatic passes while the
modules load, and each gc.collect() that DeepSpeed and vLLM run while they build, save and shut
down engines (vLLM: five at an engine's start, two at its close). On a 2-core EPYC a pass took
0.2-0.25 s; a tiny model's 3-step job spent 0.9 s of its trainer's 6.8 s CPU in them, and its
engine process 1.1-1.2 s of an 8 s start and 0.8 s of a 1 s close.

`imports_uncollected()` runs the imports with the collector off, then takes every object alive out
of its scans (`gc.freeze`) and turns it back on. Refcounting still frees a frozen object that
nothing refers to; only a reference cycle alive at the freeze is never collected, so the block
holds imports and checks, not engines. Nothing numeric depends on the collector."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def imports_uncollected():
    """The block's imports with the cyclic collector off; at the end, everything alive frozen out
    of its scans and the collector on again (also when the block raises)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
