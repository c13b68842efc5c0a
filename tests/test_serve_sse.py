"""The stream's hot path in kerncc.serve.http: plain chunks written from a template (the bytes
json.dumps writes of the chunk's dict) and the engine thread's hand-over to the event loop."""

from __future__ import annotations

import asyncio
import json
import threading

from hypothesis import given
from hypothesis import strategies as st

from kerncc.serve import http


def _dumped(head: dict, chat: bool, index: int, piece: http._Piece) -> bytes:
    """The chunk as `_sse` builds it without the template: a dict, json.dumps."""
    choice: dict = {"index": index, "finish_reason": piece.finish, "token_ids": piece.token_ids}
    if chat:
        choice["delta"] = {"content": piece.text} if piece.text or piece.token_ids else {}
        choice["logprobs"] = None
    else:
        choice.update(text=piece.text, logprobs=None)
    return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode()


@given(text=st.text(), ids=st.lists(st.integers(0, 1 << 40), max_size=8),
       finish=st.sampled_from([None, "stop", "length"]), index=st.integers(0, 64),
       chat=st.booleans(), model=st.text(min_size=1), created=st.integers(0, 1 << 40))
def test_a_plain_chunk_is_the_bytes_json_dumps_writes(text, ids, finish, index, chat, model,
                                                      created):
    head = {"id": "cmpl-ab12", "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": "fp_\u00e9\"x"}
    piece = http._Piece(text, ids, finish)
    assert http._Plain(head, chat).chunk(index, piece) == _dumped(head, chat, index, piece)


def test_tokens_from_another_thread_reach_every_queue_in_order():
    async def run() -> list[list[int | None]]:
        loop = asyncio.get_running_loop()
        post = http._Post(loop)
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(3)]

        def engine() -> None:
            for step in range(200):
                for k, queue in enumerate(queues):
                    post.put(queue, [step * 10 + k, step * 10 + k + 1] if k else [step])
            for queue in queues:
                post.put(queue, [None])

        thread = threading.Thread(target=engine)
        thread.start()
        got: list[list[int | None]] = []
        for queue in queues:
            items: list[int | None] = []
            async with asyncio.timeout(30):
                while (item := await queue.get()) is not None:
                    items.append(item)
            got.append(items)
        thread.join(30)
        return got

    first, second, third = asyncio.run(run())
    assert first == list(range(200))
    assert second == [x for s in range(200) for x in (s * 10 + 1, s * 10 + 2)]
    assert third == [x for s in range(200) for x in (s * 10 + 2, s * 10 + 3)]
