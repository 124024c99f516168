"""The decode side: fetch a request's full KV from every CP owner into local pages.

    async with DecodeFetcher(pool, registry_url) as fetcher:
        result = await fetcher.fetch(engine_id, room, dst_pages, ticket=ticket)

`fetcher` is the public face; `owners` looks engines up and picks each owner's lane;
`claims` and `tickets` are the two protocols a fetch reads a room by; `lease` holds a
claim across reads.
"""

from transfer.decode.fetcher import DecodeFetcher
from transfer.decode.landing import StreamFetch
from transfer.decode.lease import RoomLease
from transfer.results import FetchResult, OwnerStats

__all__ = ["DecodeFetcher", "FetchResult", "OwnerStats", "RoomLease", "StreamFetch"]
