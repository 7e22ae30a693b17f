"""Admission off the event loop: parsing, validation, the chat template and tokenization of one request run in a
thread of their own, so a large or slow-to-tokenize body delays only its own answer, never /health or the text
streamed to other clients. One thread: the tokenizer is not safe to call from two at once (a fast tokenizer's
settings are changed per call), and admissions are short once the bounds have cut a body to the context's size."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from draftsmith.serve.http.admit import Admitted, Limits, admit, parse
from draftsmith.serve.http.chat_text import ChatEncoder


class Admission:
    def __init__(self, encoder: ChatEncoder, limits: Limits) -> None:
        self.encoder = encoder
        self.limits = limits
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="draftsmith-admit")

    async def __call__(self, body: bytes) -> Admitted:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.run, body)

    def run(self, body: bytes) -> Admitted:
        return admit(parse(body), self.encoder, self.limits)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
