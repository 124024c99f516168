"""The pin table a decode on the owner's host maps (transfer.prefill.pins)."""

import msgspec
import pytest

from pdkv import PeerLostError
from transfer.prefill.pins import PinWords, map_pins


def test_a_mapped_table_shows_the_owners_words_as_they_change():
    owner = PinWords(64)
    try:
        mapped = map_pins(owner.wire())
        assert mapped is not None and mapped.word(5) == 0
        owner.words[5] = 1234567
        assert mapped.word(5) == 1234567  # the same memory, no message
        owner.words[5] = 0
        assert mapped.word(5) == 0
        mapped.close()
        with pytest.raises(PeerLostError):
            mapped.word(5)
    finally:
        owner.close()


def test_a_table_of_another_host_or_tag_is_not_mapped():
    owner = PinWords(8)
    try:
        wire = owner.wire()
        assert map_pins(msgspec.structs.replace(wire, host_id="elsewhere:0")) is None
        assert map_pins(msgspec.structs.replace(wire, tag=wire.tag ^ 1)) is None  # a reused pid or fd
        assert map_pins(msgspec.structs.replace(wire, slots=9)) is None  # not the size published
        assert map_pins(msgspec.structs.replace(wire, fd=wire.fd + 1000)) is None
    finally:
        owner.close()


def test_a_closed_table_proves_nothing_to_a_decode_that_still_maps_it():
    owner = PinWords(16)
    mapped = map_pins(owner.wire())
    assert mapped is not None
    try:
        owner.words[3] = 987654321
        owner.close()  # its rooms are no longer kept: their words must not pass any more
        assert mapped.word(3) == 0
    finally:
        mapped.close()
