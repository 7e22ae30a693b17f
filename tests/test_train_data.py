"""Training data: conversation sources, the train / held-out split, and loss masks on real ShareGPT chats."""

import json

import pytest
from datasets import Dataset

from draftsmith.serve.models.target import load_tokenizer
from draftsmith.serve.shared.conversations import (
    Conversation,
    Skipped,
    heldout_conversations,
    is_heldout,
    iter_rows,
    json_array_rows,
    load_conversations,
    parse_row,
    split_key,
)
from draftsmith.train.answer_cap import cap_answers
from draftsmith.train.chat import encode, encode_all, render_chat
from draftsmith.train.data import DataConfig, RegenerateConfig, data_key

END = "<|im_end|>"  # SmolLM2's end-of-turn token


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def sharegpt():
    """The first 1,200 conversations of the packaged ShareGPT V3 (streamed: the file is not loaded whole)."""
    skipped, convs = Skipped(), []
    for i, row in enumerate(iter_rows("sharegpt", skipped)):
        if i == 1200:
            break
        conv = parse_row(row, i, skipped)
        if conv is not None:
            convs.append(conv)
    return convs, skipped


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + [cur] if cur else runs


def test_masks_on_real_sharegpt_cover_exactly_the_answers_and_their_end_marker(tokenizer, sharegpt):
    convs, _ = sharegpt
    picked = convs[:40] + [c for c in convs if c.messages[0]["role"] == "system"][:1]  # a system turn too
    assert picked[-1].messages[0]["role"] == "system"
    for conv in picked:
        ex = encode(tokenizer, conv, max_length=100_000)
        answers = [m["content"] + END for m in conv.messages if m["role"] == "assistant"]
        runs = masked_runs(ex.input_ids, ex.loss_mask)
        assert [tokenizer.decode(r) for r in runs] == answers, conv.id
        # off by one: the token before each answer is the header's newline, the one after is template glue
        header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        starts = [i for i in range(1, len(ex.loss_mask)) if ex.loss_mask[i] and not ex.loss_mask[i - 1]]
        for s in starts:
            assert ex.input_ids[s - len(header) : s] == header
        ends = [i for i in range(len(ex.loss_mask) - 1) if ex.loss_mask[i] and not ex.loss_mask[i + 1]]
        assert all(tokenizer.decode(ex.input_ids[e]) == END for e in ends)
        assert ex.input_ids == tokenizer(render_chat(tokenizer, conv.messages), add_special_tokens=False)["input_ids"]


def test_an_answer_cut_at_the_token_limit_leaves_its_end_marker_out_of_the_loss(tokenizer, sharegpt):
    """The target never said end-of-turn where regeneration stopped it at its budget."""
    conv = next(c for c in sharegpt[0] if sum(m["role"] == "assistant" for m in c.messages) >= 2)
    answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    cut = Conversation(conv.id, conv.messages, truncated=[1])
    ex = encode(tokenizer, cut, max_length=100_000)
    decoded = [tokenizer.decode(r) for r in masked_runs(ex.input_ids, ex.loss_mask)]
    assert decoded[:2] == [answers[0] + END, answers[1]]  # the second answer's marker is not trained
    assert ex.input_ids == encode(tokenizer, conv, max_length=100_000).input_ids


def test_truncation_keeps_the_first_tokens_and_their_mask(tokenizer, sharegpt):
    conv = max(sharegpt[0][:50], key=lambda c: sum(len(m["content"]) for m in c.messages))
    full = encode(tokenizer, conv, max_length=100_000)
    for n in (64, 300, 1024):
        cut = encode(tokenizer, conv, max_length=n)
        assert len(cut.input_ids) == min(n, len(full.input_ids))
        assert cut.input_ids == full.input_ids[:n] and cut.loss_mask == full.loss_mask[:n]


def test_an_answer_cap_cuts_the_first_long_answer_and_ends_the_conversation_there(tokenizer, sharegpt):
    """data.answer_cap: what regenerating at max_new_tokens=N gives for the turns kept, from answers made longer."""
    tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    convs = [c for c in sharegpt[0][:300] if sum(m["role"] == "assistant" for m in c.messages) >= 3]
    lengths = lambda c: [len(tokens(m["content"])) for m in c.messages if m["role"] == "assistant"]  # noqa: E731
    conv = next(c for c in convs if lengths(c)[0] < 64 < lengths(c)[1])  # the second answer is the first long one
    short = next(c for c in convs if max(lengths(c)) < 64)
    capped, cut = cap_answers(tokenizer, [conv, short], 64)
    assert cut == 1 and capped[1] is short
    answers = [m["content"] for m in capped[0].messages if m["role"] == "assistant"]
    whole = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    assert capped[0].messages[-1]["role"] == "assistant" and len(answers) == 2  # later turns followed the whole one
    assert answers[0] == whole[0] and whole[1].startswith(answers[1]) and len(tokens(answers[1])) == 64
    assert capped[0].truncated == [1]
    ex = encode(tokenizer, capped[0], max_length=100_000)
    decoded = [tokenizer.decode(r) for r in masked_runs(ex.input_ids, ex.loss_mask)]
    assert decoded == [whole[0] + END, answers[1]]  # the cut answer's end marker is not trained
    assert DataConfig(answer_cap=64) != DataConfig() and "answer_cap" not in data_key(DataConfig())
    assert data_key(DataConfig(answer_cap=64))["answer_cap"] == 64
    with pytest.raises(ValueError, match="data.answer_cap must be >= 1"):
        DataConfig(answer_cap=0)
    # exactly the cap: at max_new_tokens=N its end-of-turn token would not have fitted, so it is cut too
    say = lambda role, text: {"role": role, "content": text}  # noqa: E731
    eight = tokenizer.decode(tokens(whole[0])[:8])
    exact = Conversation("x", [say("user", "Hi"), say("assistant", eight), say("user", "More"), say("assistant", "ok")])
    assert len(tokens(exact.messages[1]["content"])) == 8
    (capped,), cut = cap_answers(tokenizer, [exact], 8)
    assert cut == 1 and capped.truncated == [0] and capped.messages == exact.messages[:2]


def test_conversations_without_answers_are_skipped_and_counted(tokenizer, sharegpt):
    convs, skipped = sharegpt
    assert skipped.counts["without an assistant turn"] >= 1  # e.g. ZUkSe7V_0 has no turns at all
    assert all(c.messages[0]["role"] != "assistant" for c in convs)  # answers without a question dropped
    skipped = Skipped()
    examples = encode_all(tokenizer, convs[:30], 48, skipped)  # long first questions leave no answer token
    assert len(examples) + skipped.counts["without an assistant token in the first 48 tokens"] == 30
    assert all(sum(e.loss_mask) > 0 for e in examples)


ROWS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q"}]},
    {"id": "d", "conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]},
    {
        "id": "e",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "And 3+3?"},
            {"from": "gpt", "value": "6"},
        ],
    },
    {"id": "f", "text": "no conversation here"},
]


def as_messages(row: dict) -> dict:
    role = {"human": "user", "gpt": "assistant", "system": "system", "narrator": "narrator"}
    return {
        "id": row["id"],
        "messages": [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]],
    }


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sharegpt_jsonl_messages_jsonl_and_datasets_folder_parse_alike(tmp_path):
    rows = [r for r in ROWS if "conversations" in r]
    sources = {
        "sharegpt jsonl": write_jsonl(tmp_path / "sg.jsonl", ROWS),
        "messages jsonl": write_jsonl(tmp_path / "msg.jsonl", [as_messages(r) for r in rows] + [ROWS[-1]]),
    }
    Dataset.from_list([as_messages(r) for r in rows]).save_to_disk(str(tmp_path / "ds"))
    sources["datasets folder"] = str(tmp_path / "ds")
    for name, source in sources.items():
        convs, skipped = load_conversations(source, 0.0)
        assert [c.id for c in convs] == ["a", "e"], name
        assert convs[1].messages[0] == {"role": "system", "content": "Be brief."}
        counts = skipped.counts
        assert counts["without an assistant turn"] == 2, name  # b, and c once its orphan answer is dropped
        assert counts["with an unknown role or non-text content"] == 1, name  # d
        if name != "datasets folder":
            assert counts["without conversations/messages"] == 1, name  # f


def test_empty_dataset_after_filtering_is_a_clear_error(tmp_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [ROWS[1], ROWS[3]])
    with pytest.raises(ValueError, match=r"no usable train conversations .*1 without an assistant turn"):
        load_conversations(source, 0.02)
    with pytest.raises(FileNotFoundError, match="neither `sharegpt`"):
        load_conversations(str(tmp_path / "missing.jsonl"), 0.02)
    (tmp_path / "broken.jsonl").write_text('{"id": 1}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        load_conversations(str(tmp_path / "broken.jsonl"), 0.02)


def test_a_non_utf8_byte_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + '{"id": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 12\)"):
        load_conversations(str(path), 0.02)


def test_self_distillation_refuses_a_nan_temperature_and_engine_args_it_sets_itself():
    with pytest.raises(ValueError, match="data.regenerate.temperature must be >= 0 and top_p in .*got nan"):
        RegenerateConfig(temperature=float("nan"))
    with pytest.raises(ValueError, match="engine_args sets dtype, max_model_len, which regeneration sets itself"):
        RegenerateConfig(engine_args={"max_model_len": 8, "dtype": "half", "enforce_eager": True})
    with pytest.raises(ValueError, match="data.regenerate.backend must be auto, vllm or draftsmith"):
        RegenerateConfig(backend="hf")


def test_a_truncated_json_array_is_read_up_to_the_cut_and_counted(tmp_path):
    text = json.dumps([ROWS[0], ROWS[4]], indent=1)
    (tmp_path / "cut.json").write_text(text[: text.index('"e"') + 40])
    skipped = Skipped()
    rows = list(json_array_rows(tmp_path / "cut.json", skipped, chunk=16))
    assert [r["id"] for r in rows] == ["a"] and skipped.counts == {"truncated at the end of the file": 1}


def test_split_is_deterministic_disjoint_and_independent_of_limits(tmp_path):
    rows = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        for i in range(400)
    ]
    source = write_jsonl(tmp_path / "many.jsonl", rows)
    train = [c.id for c in load_conversations(source, 0.1)[0]]
    held = [c.id for c in heldout_conversations(source, 0.1)]
    assert not set(train) & set(held) and len(train) + len(held) == 400
    assert 20 <= len(held) <= 60
    assert held == [c.id for c in heldout_conversations(source, 0.1)]  # the same on every call
    assert [c.id for c in load_conversations(source, 0.1, limit=50)[0]] == train[:50]
    assert [c.id for c in heldout_conversations(source, 0.1, limit=5)] == held[:5]
    # ShareGPT's parts of one long chat (id_0, id_1, ...) land on the same side
    assert {is_heldout(split_key(f"xyz_{i}", "sharegpt"), 0.5) for i in range(10)} in ({True}, {False})


def test_sharegpt_source_streams_with_a_limit():
    convs, skipped = load_conversations("sharegpt", 0.02, limit=30)
    assert len(convs) == 30 and all(any(m["role"] == "assistant" for m in c.messages) for c in convs)
    assert "truncated" not in str(skipped)  # stopped long before the end of the file


def test_conversations_a_template_rejects_or_renders_differently_in_context_are_skipped(tokenizer):
    convs = [parse_row(r, i, Skipped()) for i, r in enumerate(ROWS) if r["id"] in ("a", "e")]  # 1 and 2 answers
    turn = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    tail = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    strict = tokenizer.chat_template
    try:
        tokenizer.chat_template = (
            "{% if messages|length > 3 %}{{ raise_exception('only one question') }}{% endif %}"
            "{% for m in messages %}" + turn + "{% endfor %}" + tail
        )
        skipped = Skipped()
        assert [e.id for e in encode_all(tokenizer, convs, 512, skipped)] == ["a"]
        assert skipped.counts == {"rejected by the chat template": 1}
        old = "{% if m.role == 'assistant' and not loop.last %}(earlier) {% endif %}"  # as Qwen3 drops old reasoning
        tokenizer.chat_template = "{% for m in messages %}" + old + turn + "{% endfor %}" + tail
        skipped = Skipped()
        assert [e.id for e in encode_all(tokenizer, convs, 512, skipped)] == ["a"]
        assert skipped.counts == {"whose turns the chat template renders differently in context": 1}
    finally:
        tokenizer.chat_template = strict


def test_nothing_held_out_gives_no_acceptance_prompts_instead_of_an_error(tmp_path, tokenizer):
    from draftsmith.train.acceptance import heldout_prompts

    rows = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        for i in range(3)
    ]
    cfg = DataConfig(source=write_jsonl(tmp_path / "few.jsonl", rows), heldout_fraction=0.0)
    assert heldout_prompts(cfg, tokenizer, 4, 64) == []
    with pytest.raises(ValueError, match="no usable heldout conversations"):
        heldout_conversations(cfg.source, cfg.heldout_fraction)  # an eval suite drawn from it still needs some
