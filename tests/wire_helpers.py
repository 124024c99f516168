"""Wire messages for tests: a valid rank descriptor of a small layout, a claim token."""

from pdkv import BufferKind, tiny
from transfer.metadata import LayoutSpec, MemoryDescriptor, RankDescriptor

LAYOUT = tiny(layer_num=7)
TOKEN = "0123456789abcdef0123456789abcdef"


def rank_descriptor(rank=1, size=3, **over):
    start, end = {0: (0, 3), 1: (3, 5), 2: (5, 7)}[rank]
    fields = dict(
        engine_id="e0",
        cp_rank=rank,
        cp_size=size,
        layer_start=start,
        layer_end=end,
        fingerprint=LAYOUT.fingerprint,
        layout=LayoutSpec.of(LAYOUT),
        buffers=[
            MemoryDescriptor(kind=k, layer_id=layer, addr=4096 * (1 + layer), length=192 * 65, item_len=192)
            for k in BufferKind
            for layer in range(start, end)
        ],
        agent_name="e0.cp1.abc",
        agent_metadata=b"\x00blob",
        control_url="http://127.0.0.1:1",
        incarnation="abc",
    )
    fields.update(over)
    return RankDescriptor(**fields)
