"""Conversations -> token ids with the target's chat template, and a loss mask on assistant tokens.

The mask is 1 on each assistant turn's content and its end-of-turn marker, 0 on the role header,
on user and system turns and on template glue. Spans come from rendering the template on growing
prefixes of the conversation (character offsets), mapped to tokens through the fast tokenizer's
offsets: this works for any template, {% generation %} markers or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from draftsmith.serve.shared.conversations import Conversation, Skipped


class NotPrefixStable(ValueError):
    """The template renders an earlier turn differently once later turns follow (e.g. it drops reasoning)."""


@dataclass
class Example:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str, upto: int, cut: tuple[int, ...] = ()
) -> list[tuple[int, int]]:
    """The [start, end) character span in `text` (the rendered conversation) of each assistant turn
    starting before `upto`: from the end of its header to the end of its end-of-turn marker. Answers in `cut`
    (0 = the first answer) stopped at a token limit: their span ends with their content, since the marker the
    template adds there is not what the target said."""
    spans, answer = [], -1
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        answer += 1
        head = render_chat(tokenizer, messages[:i], True)
        if len(head) >= upto:
            break
        through = render_chat(tokenizer, messages[: i + 1])
        if not (through.startswith(head) and text.startswith(through)):
            raise NotPrefixStable(f"{tokenizer.name_or_path}'s chat template renders turn {i} differently in context")
        body = through[len(head) :].rstrip()  # trailing glue dropped
        at = body.find(m["content"]) if answer in cut else -1
        spans.append((len(head), len(head) + (at + len(m["content"]) if at >= 0 else len(body))))
    return spans


def encode(tokenizer: PreTrainedTokenizerBase, conv: Conversation, max_length: int) -> Example:
    text = render_chat(tokenizer, conv.messages)
    ids, offsets = tokenize_head(tokenizer, text, max_length)
    spans = assistant_spans(tokenizer, conv.messages, text, offsets[-1][1] if offsets else 0, tuple(conv.truncated))
    return Example(conv.id, ids, span_mask(offsets, spans))


def tokenize_head(tokenizer: PreTrainedTokenizerBase, text: str, max_length: int) -> tuple[list, list]:
    """The first max_length tokens and their character offsets. Long chats are cut at a character bound
    first (tokenizing 100k characters to keep 1k tokens is the slow part), with a token to spare."""
    for cut in (max_length * 5, max_length * 20, len(text)):
        enc = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) > max_length or cut >= len(text):
            return enc["input_ids"][:max_length], enc["offset_mapping"][:max_length]
    raise AssertionError("unreachable")


def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (spans sorted, disjoint)."""
    mask, j = [], 0
    for a, b in offsets:
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        mask.append(int(j < len(spans) and spans[j][0] < b))
    return mask


def encode_all(
    tokenizer: PreTrainedTokenizerBase, convs: list[Conversation], max_length: int, skipped: Skipped
) -> list[Example]:
    """Examples with at least one assistant token within max_length; the rest counted in `skipped`."""
    check_tokenizer(tokenizer)
    out = []
    for conv in convs:
        try:
            ex = encode(tokenizer, conv, max_length)
        except TemplateError:  # e.g. a template that insists on alternating user/assistant turns
            skipped.add("rejected by the chat template")
            continue
        except NotPrefixStable:  # the mask could not be placed exactly: leave the conversation out
            skipped.add("whose turns the chat template renders differently in context")
            continue
        if sum(ex.loss_mask) == 0:
            skipped.add(f"without an assistant token in the first {max_length} tokens")
            continue
        out.append(ex)
    if not out:
        raise ValueError(f"no conversation left to train on after tokenization (skipped: {skipped})")
    return out


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer.name_or_path} has no chat template: training needs one to format conversations")
    if not tokenizer.is_fast:
        raise ValueError(f"{tokenizer.name_or_path} has no fast tokenizer (tokenizer.json): loss masks need offsets")
