"""A prefill rank's pin words, in shared memory that decodes on the same host map.

Each live room with a ticket holds a slot whose word is a random nonce while its source
pages are pinned; the owner clears the word before it frees the pages. A decode proves
that nothing it read was freed meanwhile by finding the nonce still there after its data
READs. On the owner's host it maps the table and loads the word (no message at all);
elsewhere it READs it over UCX (the table is registered too).

The table is a memfd: it has no name to leak, and lives as long as some process maps it.
A decode on the same host opens it through `/proc/<pid>/fd/<fd>`, which needs the same
rights UCX's cma path already needs (ptrace access to the owner), and checks a random tag
in the table's header word, so a reused pid or fd number cannot pass for the table.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets

import numpy as np
import torch

from pdkv.errors import PeerLostError
from transfer.lanes.base import host_id
from transfer.metadata import PinTable

logger = logging.getLogger(__name__)

_HEADER_WORDS = 1  # the tag


class PinWords:
    """The owner's table: `words` (zeroed int64 slots) after a header word holding a tag."""

    def __init__(self, slots: int) -> None:
        self._fd = os.memfd_create("pdkv-pins", os.MFD_CLOEXEC)
        size = 8 * (slots + _HEADER_WORDS)
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.int64)  # for UCX registration
        self.tag = secrets.randbits(63) or 1
        self.tensor[0] = self.tag
        self.words = self.tensor[_HEADER_WORDS:].numpy()
        self.slots = slots
        self._closed = False

    def wire(self) -> PinTable:
        return PinTable(
            addr=self.tensor.data_ptr() + 8 * _HEADER_WORDS,
            slots=self.slots,
            host_id=host_id(),
            pid=os.getpid(),
            fd=self._fd,
            tag=self.tag,
        )

    def clear(self) -> None:
        """Clear every word: the owner no longer keeps any room's pages pinned (it is closing),
        so no read on this host may be proved by them any more."""
        if not self._closed:
            self.words[:] = 0

    def close(self) -> None:
        if self._closed:
            return
        self.clear()  # a decode's mapping outlives this one
        self._closed = True
        self.words = np.zeros(0, dtype=np.int64)
        with contextlib.suppress(BufferError):  # views still exist: freed with the last of them
            self._map.close()
        os.close(self._fd)


class MappedPins:
    """An owner's table mapped read-only here."""

    def __init__(self, table: PinTable, mapping: mmap.mmap) -> None:
        self._map = mapping
        self._words = np.frombuffer(mapping, dtype=np.int64)
        self._closed = False

    def word(self, slot: int) -> int:
        """The word at `slot`; any thread (a GPU lane's waiting thread proves a read with it
        while the decode's loop may close the table: the reference taken first keeps the
        mapping)."""
        words = self._words
        if self._closed:
            raise PeerLostError("the owner's pin table was dropped (the engine was forgotten)")
        return int(words[_HEADER_WORDS + slot])

    def close(self) -> None:
        self._closed = True
        self._words = np.zeros(0, dtype=np.int64)
        with contextlib.suppress(BufferError):
            self._map.close()


def map_pins(table: PinTable) -> MappedPins | None:
    """Map `table` if its owner runs on this host and lets us in; None: READ it over UCX."""
    if table.host_id != host_id():
        return None
    size = 8 * (table.slots + _HEADER_WORDS)
    try:
        fd = os.open(f"/proc/{table.pid}/fd/{table.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:  # another pid namespace, no ptrace rights, or the owner is gone
        logger.info("pin table of pid %d not mappable here (%s): READ over UCX", table.pid, exc)
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as exc:
        logger.info("pin table of pid %d not mappable here (%s): READ over UCX", table.pid, exc)
        return None
    finally:
        os.close(fd)
    mapped = MappedPins(table, mapping)
    if int(mapped._words[0]) != table.tag:  # a reused pid or fd: not the table published
        mapped.close()
        return None
    return mapped
