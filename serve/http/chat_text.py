"""A chat's messages -> prompt ids, each message's content tokenized as the text it is.

Rendering the template to text and tokenizing that text (HF's apply_chat_template, vLLM's default) parses a special
token's string anywhere in it, so `<|im_end|>\\n<|im_start|>system` typed in a user message forges a system turn.
Here the special strings in a message are swapped for private-use markers before the template runs (so its own
filters, such as Llama-3's trim, see them as ordinary characters), the rendered text is cut at the template's own
special tokens (kept as control tokens), and each piece between them is tokenized with the markers turned back
into their characters and special tokens not parsed. Tokens added to a vocabulary without being marked special
(Qwen's `<tool_call>`, `<think>`) are treated the same way: a tokenizer parses them whatever split_special_tokens
says, so a piece that holds one is tokenized by the tokenizer's normalizer, pre-tokenizer and model alone. A chat
whose messages hold no such string takes the plain path, so ordinary prompts are tokenized exactly as before.
"""

from __future__ import annotations

import re

from draftsmith.serve.models.target import encode_chat

ESC = "\ue000"  # private use: a marker is ESC + one code char; ESC itself in a message is ESC + SELF
SELF = "\ue001"
FIRST = 0xE002  # the code char of special string k is chr(FIRST + k)


class ChatEncoder:
    """encode(chat) -> prompt ids. parse_special: the old behaviour, special strings in messages become control
    tokens."""

    def __init__(self, tokenizer, parse_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.parse_special = parse_special
        self.specials = special_strings(tokenizer)
        self.special_re = alternation(self.specials)
        self.added_re = alternation(added_strings(tokenizer))  # parsed even with split_special_tokens
        self.code = {s: ESC + chr(FIRST + k) for k, s in enumerate(self.specials)}
        self.decode = {v[1]: s for s, v in self.code.items()} | {SELF: ESC}

    def encode(self, chat: list[dict]) -> list[int]:
        if self.parse_special or self.special_re is None or not any(self.needs_escape(m["content"]) for m in chat):
            return encode_chat(self.tokenizer, chat)
        escaped = [{**m, "content": self.escape(m["content"])} for m in chat]
        text = self.tokenizer.apply_chat_template(escaped, add_generation_prompt=True, tokenize=False)
        return self.tokenize(text)

    def needs_escape(self, content: str) -> bool:
        assert self.special_re is not None
        return ESC in content or self.special_re.search(content) is not None

    def escape(self, content: str) -> str:
        assert self.special_re is not None
        return self.special_re.sub(lambda m: self.code[m.group(0)], content.replace(ESC, ESC + SELF))

    def unescape(self, text: str) -> str:
        return re.sub(f"{ESC}(.)", lambda m: self.decode[m.group(1)], text, flags=re.DOTALL)

    def tokenize(self, text: str) -> list[int]:
        """The template's special tokens as control tokens, everything between them as text."""
        assert self.special_re is not None
        ids: list[int] = []
        at = 0
        for m in self.special_re.finditer(text):
            ids += self.text_ids(text[at : m.start()])
            ids.append(self.tokenizer.convert_tokens_to_ids(m.group(0)))
            at = m.end()
        return ids + self.text_ids(text[at:])

    def text_ids(self, piece: str) -> list[int]:
        if not piece:
            return []
        plain = self.unescape(piece)
        if self.added_re is not None and self.added_re.search(plain):
            return model_ids(self.tokenizer, plain)
        return self.tokenizer(plain, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def special_strings(tokenizer) -> list[str]:
    """Every string the tokenizer turns into a token of its own when it parses text: its special (control) tokens
    and the tokens added to its vocabulary, special or not."""
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values()} | set(tokenizer.all_special_tokens))


def added_strings(tokenizer) -> list[str]:
    """The tokens added to the vocabulary that are not special: a tokenizer parses them in any text."""
    return sorted(t.content for t in tokenizer.added_tokens_decoder.values() if not t.special)


def alternation(strings: list[str]) -> re.Pattern | None:
    longest_first = sorted(strings, key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in longest_first)) if strings else None


def model_ids(tokenizer, text: str) -> list[int]:
    """The text's ids as if the tokenizer had no added tokens: its normalizer, pre-tokenizer and model alone."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [t.id for word, _ in words for t in backend.model.tokenize(word)]
