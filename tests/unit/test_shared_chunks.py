"""A round's broadcast is encoded once for every subscription that sends it (issue 16), and the table forgets it
with the message."""

from __future__ import annotations

import asyncio
import gc

import torch

from ddiloco.messages import FragmentState
from ddiloco.transport.shared_chunks import SharedChunks
from ddiloco.transport.syncer_stream import encode_syncer_message


def test_a_broadcast_is_encoded_once_for_every_subscriber_even_when_the_first_goes_away():
    calls = []

    async def scenario() -> None:
        release = asyncio.Event()

        async def encode(message):
            calls.append(message.version)
            await release.wait()  # the first subscriber's stream is cancelled meanwhile
            return list(encode_syncer_message(message))

        shared = SharedChunks(encode)
        state = FragmentState(0, 1, {"w": torch.arange(6, dtype=torch.float32)})
        first = asyncio.ensure_future(shared.chunks(state))
        others = [asyncio.ensure_future(shared.chunks(state)) for _ in range(3)]
        await asyncio.sleep(0)
        first.cancel()
        release.set()
        results = await asyncio.gather(*others)
        assert all(r is results[0] for r in results) and len(results[0]) == 1  # the same chunk objects
        assert shared.encoded == 1 and len(shared) == 1
        newer = FragmentState(0, 2, {"w": torch.zeros(6)})
        await shared.chunks(newer)
        assert calls == [1, 2]
        del state, newer, first, others, results
        gc.collect()
        assert len(shared) == 0  # freed with their messages

    asyncio.run(scenario())
