"""What a compiled model holds lives as long as the model.

Dynamo keeps what a backend returns for good: it installs each compiled graph as a
global of the frame it compiled (``torch._dynamo.external_utils`` for
``torch.compile(module)``), and ``torch._dynamo.reset()`` does not remove it. What lort
returns reaches its records, whose groups hold ORT sessions and frozen weights: every
dropped model's sessions and weights stayed (about 25 MB per 8 MB model). So a
compiled graph is tied to an owner (the module whose weights it reads, or an
ORTModule's schema entry): when the owner is collected, the graph's groups release
their sessions and weights (``OrtGroup.release``). What stays is the graphs' Python
objects, a small fraction of a model.
"""

from __future__ import annotations

import logging
import weakref

from ..runtime.memory import give_back_memory

logger = logging.getLogger("lort")


def release_with(owner, records: list) -> bool:
    """When ``owner`` is collected, release the ORT groups of ``records`` (a list the
    backend may still append to: a backward graph is compiled at the first backward).
    False where ``owner`` cannot be weakly referenced."""
    try:
        weakref.finalize(owner, release, records)
    except TypeError:
        return False
    return True


def release(records: list) -> None:
    """Release every ORT group of ``records``: their sessions and frozen weights."""
    count = 0
    for record in records:
        for group in record.group_modules.values():
            group.release()
            count += 1
    if count:
        give_back_memory()
    logger.debug("lort: released %d ORT group(s) of a collected model", count)
