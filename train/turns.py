"""A conversation re-answered by the target turn by turn: each answer is fed back before the next user turn."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

from jinja2 import TemplateError

from draftsmith.serve.models.target import encode_chat
from draftsmith.serve.shared.conversations import Conversation, Skipped


@dataclass
class Chat:
    """A conversation being re-answered: the runs of messages still to answer, the messages so far, and which
    answers stopped at the token limit."""

    id: str
    segments: list[list[dict]]  # the non-assistant messages before each answer (each with a user turn)
    messages: list[dict] = field(default_factory=list)
    turn: int = 0
    truncated: list[int] = field(default_factory=list)  # answers (0 = the first) cut at the token limit
    looped: int = 0  # answers that repeat themselves (loops(): counted for the run's summary, not written)
    stopped: str = ""  # why it ended before its last user turn: "max_length", "template" or "cut" (empty: it did not)

    def next_messages(self) -> list[dict] | None:
        return self.messages + self.segments[self.turn] if self.turn < len(self.segments) else None

    def add(self, answer: str, cut: bool = False, looped: bool = False) -> None:
        if cut:
            self.truncated.append(self.turn)
        self.looped += looped
        messages = self.next_messages()
        assert messages is not None, "a turn is left to answer"
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.turn += 1


def user_segments(messages: list[dict]) -> list[list[dict]]:
    """Runs of non-assistant messages, each answered once. A run without a user turn (a system message between
    two answers) joins the next run; a trailing one is dropped."""
    segments, pending = [], []
    for m in [*messages, {"role": "assistant"}]:  # a closing answer ends the last run
        if m["role"] != "assistant":
            pending.append(m)
        elif any(p["role"] == "user" for p in pending):
            segments.append(pending)
            pending = []
    return segments


def draws(convs: list[Conversation], answers: int) -> list[Conversation]:
    """Each conversation `answers` times in a row, draw k > 0 as <id>~k: a row, and sampling seeds, of its own."""
    return [c if k == 0 else replace(c, id=f"{c.id}~{k}") for c in convs for k in range(answers)]


def loops(ids: list[int], n: int = 6) -> bool:
    """An answer that repeats itself: fewer than half of its n-grams unique (answers under 2n tokens never do)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) > n and len(set(grams)) < len(grams) / 2


def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    """A sampling seed per answer: a rerun (or a resume, in any batch) asks for the same draw; the same backend
    then draws the same answer (vLLM and draftsmith sample differently from one seed)."""
    return int.from_bytes(hashlib.sha256(f"{seed}|{conv_id}|{turn}".encode()).digest()[:8], "big") >> 1


def next_prompt(chat: Chat, tokenizer, limit: int) -> list[int] | None:
    """The chat-encoded prompt of the chat's next answer; None when no user turn is left or the prompt leaves
    no room under `limit` (data.max_length: what follows would be cut from the training example anyway)."""
    messages = chat.next_messages()
    if messages is None:
        return None
    ids = encode_chat(tokenizer, messages)
    return ids if len(ids) < limit else None


def prepare(convs: list[Conversation], tokenizer, limit: int, skipped: Skipped) -> list[tuple[Chat, list[int]]]:
    """Each answerable conversation with its first prompt; the others counted in `skipped`."""
    out, seen = [], set()
    for conv in convs:
        if conv.id in seen:  # ids key the output file: a second row with the same id would be lost
            skipped.add("with a duplicate id")
            continue
        seen.add(conv.id)
        chat = Chat(conv.id, user_segments(conv.messages))
        if not chat.segments:
            skipped.add("without a user turn to answer")
            continue
        try:
            ids = next_prompt(chat, tokenizer, limit)
        except TemplateError:
            skipped.add("rejected by the chat template")
            continue
        if ids is None:
            skipped.add(f"whose first prompt fills max_length ({limit} tokens)")
            continue
        out.append((chat, ids))
    return out


def finish_turn(chat: Chat, out: list[int], tokenizer, eos, limit: int, end_at_cut: bool = False) -> list[int] | None:
    """The chat takes its answer `out` (new tokens); returns its next prompt, or None when it is done (no user turn
    left, no room under `limit`, a later turn the chat template rejects, or with `end_at_cut` an answer cut at the
    token limit: the answers so far are kept)."""
    cut = not ended(out, eos)
    chat.add(answer_text(tokenizer, out, eos), cut=cut, looped=loops(out))
    try:
        ids = next_prompt(chat, tokenizer, limit)
    except TemplateError:
        ids, chat.stopped = None, "template"
    if ids is None and not chat.stopped and chat.turn < len(chat.segments):
        chat.stopped = "max_length"
    if ids is not None and cut and end_at_cut:  # a turn was left, and room for it: the cut ends the conversation
        ids, chat.stopped = None, "cut"
    return ids


def answer_text(tokenizer, out: list[int], eos) -> str:
    return tokenizer.decode(out[:-1] if ended(out, eos) else out, skip_special_tokens=True)


def ended(out: list[int], eos) -> bool:
    """Did the answer stop at an end-of-turn token (not at the token limit)?"""
    return bool(out) and out[-1] in eos
