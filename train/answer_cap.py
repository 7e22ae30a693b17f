"""data.answer_cap: answers cut to their first N tokens, each conversation ending at its first cut answer.

That is what regenerating with max_new_tokens=N gives for the turns kept: a sampled answer's first N tokens are a
draw of the shorter answer, and a later turn, which followed the whole answer, is dropped. An answer of exactly N
tokens is cut too: its end-of-turn token would have been the (N+1)-th. So answers made once at a long cap measure a
shorter cap over more conversations without regenerating them. The cut falls at a token's last character, so text
tokenized again can read one token fewer (a newline pair merges) or more (a character split across byte tokens is
kept whole); about 3% of cut answers on ShareGPT.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from draftsmith.serve.shared.conversations import Conversation


def cap_answers(
    tokenizer: PreTrainedTokenizerBase, convs: list[Conversation], cap: int
) -> tuple[list[Conversation], int]:
    """Each conversation with its answers cut to `cap` tokens, and how many answers were cut."""
    out, cut = [], 0
    for conv in convs:
        capped = cap_conversation(tokenizer, conv, cap)
        cut += capped is not conv
        out.append(capped)
    return out, cut


def cap_conversation(tokenizer: PreTrainedTokenizerBase, conv: Conversation, cap: int) -> Conversation:
    """conv itself where every answer is shorter than `cap` tokens, else the conversation through its first answer
    that is not, cut to its first `cap` tokens and marked truncated (its end-of-turn marker is not the target's)."""
    answer = -1
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        answer += 1
        enc = tokenizer(m["content"], add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) < cap:
            continue
        head = {**m, "content": m["content"][: enc["offset_mapping"][cap - 1][1]]}
        truncated = [a for a in conv.truncated if a < answer] + [answer]
        return replace(conv, messages=[*conv.messages[:i], head], truncated=truncated)
    return conv
