"""What json.loads lets through and the rest of the server must not see: nesting deeper than any request of the
API needs (pydantic and the template would recurse into it), and lone surrogates ("\\ud800" is valid JSON, but no
UTF-8 text: the tokenizer and the response's own encoding fail on it)."""

from __future__ import annotations

import re

from draftsmith.serve.http.errors import invalid

MAX_DEPTH = 32  # a chat request is at most 5 deep (body, messages, message, content parts, part)
SURROGATE = re.compile("[\ud800-\udfff]")


def check_json(data: object) -> None:
    """Walks the parsed body without recursion; the first problem is a 400 naming where it is."""
    todo: list[tuple[object, str, int]] = [(data, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise invalid(
                f"The JSON body of your request is nested deeper than {MAX_DEPTH} levels (at '{where}'); "
                "a chat-completions request needs a handful.",
                where or None,
                "invalid_value",
            )
        if isinstance(value, str):
            check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                check_text(key, where)
                todo.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def check_text(text: str, where: str) -> None:
    if not text.isascii() and SURROGATE.search(text):
        raise invalid(
            f"Invalid '{where}': the string holds a lone UTF-16 surrogate (an escape such as \\ud800 without its "
            "pair), which is not text. Send valid Unicode.",
            where or None,
            "invalid_value",
        )
