"""TextStream: output tokens -> text as it becomes final, cut at the first stop string.

Text is held back while it could still change or end in a stop string: an incomplete UTF-8 character (the
tokenizer decodes it as U+FFFD) or a tail that begins a stop string. The pieces it returns, joined, are the
decoded output up to (not including) the first stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False  # a stop string was found: the text ends before it

    def push(self, new_ids: list[int]) -> str:
        """The text these tokens make final."""
        if self.stopped:
            return ""
        self.ids += new_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        # only what was not returned yet is searched: the new text and the held-back tail, which is shorter than the
        # longest stop string (a stop string cannot start inside the text already returned)
        fresh = text[self.sent :]
        cut = self.first_stop(fresh)
        if cut is not None:
            self.stopped = True
            return self.take(text, self.sent + cut)
        settled = fresh.rstrip(REPLACEMENT) if fresh.endswith(REPLACEMENT) else fresh
        return self.take(text, self.sent + len(settled) - self.held(settled))

    def flush(self) -> str:
        """The rest, once the output is complete."""
        if self.stopped:
            return ""
        return self.take(self.tokenizer.decode(self.ids, skip_special_tokens=True), None)

    def first_stop(self, fresh: str) -> int | None:
        found = [i for i in (fresh.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def held(self, text: str) -> int:
        """How many characters at text's end begin a stop string (held back until the next tokens settle it).
        admit.py caps the stop strings' length, which bounds this loop."""
        for k in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0

    def take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else max(end, self.sent)
        piece, self.sent = text[self.sent : end], end
        return piece
