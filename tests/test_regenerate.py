"""Regeneration on a tiny chat target: the answers are the target's own (greedy = the engine's plain greedy),
turn by turn; sampling is reproducible; a killed run resumes without duplicates; bad input is a clear error; the
trainer keys its feature cache apart and reuses the file; head=draft_model turns it on."""

import json
import sys
import threading
from pathlib import Path

import pytest
import standin_head
from hydra import compose, initialize_config_module

from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import TargetConfig, encode_chat, eos_ids, load_target
from draftsmith.serve.shared.cli import typed
from draftsmith.serve.shared.conversations import Conversation, Skipped, load_conversations
from draftsmith.serve.shared.wandb_run import WandbConfig
from draftsmith.serve.spec import SpecConfig
from draftsmith.train import batch_decode, regenerate_backends, regenerate_vllm
from draftsmith.train import regenerate as regenerate_mod
from draftsmith.train.config import RunConfig, TrainConfig
from draftsmith.train.data import DataConfig, RegenerateConfig, data_key
from draftsmith.train.features import FeatureConfig, cache_key
from draftsmith.train.head import HeadConfig
from draftsmith.train.regenerate import LEGACY_GROUP, RegenerateRun, adopt_legacy, answers_path, regenerate, run
from draftsmith.train.regenerate_backends import Backend, in_rounds
from draftsmith.train.regenerate_file import merge_into, read_rows
from draftsmith.train.regenerate_vllm import VllmUnavailable
from draftsmith.train.trainer import train
from draftsmith.train.turns import answer_text, loops
from helpers import build_tiny_chat_target, command_line, said, user

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 6  # new tokens per answer


@pytest.fixture(scope="module")
def target_dir(smollm2_dir, tmp_path_factory) -> Path:
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(TargetConfig(path=str(target_dir)))


CONVS = [
    Conversation("a", [user("What is 2 plus 2?"), said("4."), user("And 3 plus 3?"), said("6.")]),
    Conversation("b", [{"role": "system", "content": "Be brief."}, user("Name a colour."), said("Red.")]),
    Conversation("c", [user("Hi"), said("Hello!")]),
    Conversation("d", [user("Count: 1 2 3"), said("4 5 6"), user("Again"), said("7 8 9"), user("Thanks")]),
    Conversation("e", [user("Why is the sky blue?"), said("Rayleigh scattering.")]),
]


def cfg(**kw) -> RegenerateConfig:
    return RegenerateConfig(**{"max_new_tokens": NEW, "batch_size": 3, "backend": "draftsmith", **kw})


def expected_greedy(target, conv: Conversation) -> list[dict]:
    """The target's answers by the engine's plain greedy decoding, each fed back before the next user turn."""
    engine = build_engine(target, SpecConfig("ar"), False, 512)
    messages = []
    for m in [*conv.messages, said("(end)")]:
        if m["role"] != "assistant":
            messages.append(m)
        elif messages[-1]["role"] == "user":
            ids = engine.generate(encode_chat(target.tokenizer, messages), NEW, SamplingParams()).output_ids
            messages.append(said(answer_text(target.tokenizer, ids, eos_ids(target))))
    return messages


def regenerate_said(convs: list[Conversation], target, c: RegenerateConfig, path: Path) -> tuple[list, list[str]]:
    """regenerate() into path at max_length 512, and the lines it said."""
    lines = []
    return regenerate(convs, target, c, path, 512, Skipped(), say=lines.append), lines


def as_dict(convs: list[Conversation]) -> dict:
    return {c.id: c.messages for c in convs}


def file_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("batch_size, spec", [(1, "ngram"), (1, "ar"), (3, "ngram"), (8, "ngram")])
def test_answers_are_the_targets_greedy_output_turn_by_turn(target, tmp_path, monkeypatch, batch_size, spec):
    reused = []  # batched: a later turn prefills only what follows the chat's KV so far
    original = batch_decode.common_prefix
    monkeypatch.setattr(batch_decode, "common_prefix", lambda a, b: reused.append(original(a, b)) or reused[-1])
    out = regenerate(CONVS, target, cfg(batch_size=batch_size, spec=spec), tmp_path / "d.jsonl", 512, Skipped())
    later = [n for n in reused if n]  # a first turn's slot holds nothing to reuse
    assert (len(later) == 3 and min(later) > 30) if batch_size > 1 else not reused  # a: 1, d: 2 later turns
    assert [c.id for c in out] == [c.id for c in CONVS]  # input order
    for conv in out:
        assert conv.messages == expected_greedy(target, next(c for c in CONVS if c.id == conv.id)), conv.id
    d = as_dict(out)
    assert [m["role"] for m in d["a"]] == ["user", "assistant"] * 2 and d["a"][2] == user("And 3 plus 3?")
    assert d["b"][0]["role"] == "system" and len(d["d"]) == 6  # the trailing user turn is answered too
    assert d["a"][1] != said("4.")  # not the source's answer
    assert sorted(file_ids(tmp_path / "d.jsonl")) == sorted(c.id for c in CONVS)


def test_sampling_is_reproducible_per_conversation_whatever_the_batch(target, tmp_path):
    hot = dict(temperature=1.0, seed=7)
    runs = [
        regenerate(CONVS, target, cfg(batch_size=b, **hot), tmp_path / f"{b}.jsonl", 512, Skipped()) for b in (2, 5)
    ]
    assert as_dict(runs[0]) == as_dict(runs[1])
    greedy = regenerate(CONVS, target, cfg(), tmp_path / "greedy.jsonl", 512, Skipped())
    other = regenerate(CONVS, target, cfg(temperature=1.0, seed=8), tmp_path / "other.jsonl", 512, Skipped())
    assert as_dict(runs[0]) != as_dict(greedy) and as_dict(runs[0]) != as_dict(other)


def test_several_draws_per_conversation_are_rows_of_their_own(target, tmp_path):
    """answers=3: each conversation answered three times, in a row, under <id>, <id>~1, <id>~2 with seeds of their
    own; the first draw is the one answers=1 makes, so the larger set extends the smaller one's file."""
    one = regenerate(CONVS, target, cfg(temperature=1.0), tmp_path / "one.jsonl", 512, Skipped())
    three = regenerate(CONVS, target, cfg(temperature=1.0, answers=3), tmp_path / "three.jsonl", 512, Skipped())
    assert [c.id for c in three] == [f"{c.id}{k}" for c in CONVS for k in ("", "~1", "~2")]
    assert as_dict(three[::3]) == as_dict(one)  # draw 0 under the plain id
    a = [c.messages for c in three[:3]]
    assert a[0][0] == a[1][0] == a[2][0] and len({str(m) for m in a}) == 3  # same prompt, three answers
    with pytest.raises(ValueError, match="answers=2.*needs sampling.*temperature"):
        RegenerateConfig(answers=2)


def test_every_draw_of_a_conversation_falls_on_its_side_of_the_split(tmp_path):
    """An answers file with draws <id>~k, read back as a source, splits by the conversation's id."""
    rows = [{"id": f"c{i}{k}", "messages": [user(f"q{i}"), said("a")]} for i in range(40) for k in ("", "~1", "~2")]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {c.id for c in load_conversations(str(path), 0.5, "train")[0]}
    held = {c.id for c in load_conversations(str(path), 0.5, "heldout")[0]}
    assert train and held and not train & held
    assert all({f"{i}", f"{i}~1", f"{i}~2"} <= side for side in (train, held) for i in {x.split("~")[0] for x in side})


def test_draws_without_regeneration_are_refused():
    with pytest.raises(ValueError, match="answers=3 draws answers by regeneration: set data.regenerated=true"):
        RunConfig(out="x", data=DataConfig(regenerate=RegenerateConfig(temperature=0.7, answers=3)))


def test_answers_that_repeat_themselves_are_counted():
    assert loops([1, 2, 3] * 20) and not loops(list(range(60)))
    assert not loops([7] * 11)  # under 2n tokens: too short to judge
    done = regenerate_mod.Regenerated(conversations=2, tokens=9, seconds=1.0, answers=4, truncated=1, looped=2)
    assert "of 4 answers 1 (25%) hit the token limit and 2 (50%) loop" in str(done)


@pytest.mark.parametrize(("batch_size", "draws"), [(1, 1), (2, 1), (2, 2)])
def test_a_killed_run_resumes_without_duplicates(target, tmp_path, monkeypatch, batch_size, draws):
    """A kill loses no finished answer, also with several draws per conversation (each a row of its own)."""
    run = cfg(batch_size=batch_size, **({"answers": draws, "temperature": 1.0} if draws > 1 else {}))
    whole = regenerate(CONVS, target, run, tmp_path / "whole.jsonl", 512, Skipped())
    path, original, written = tmp_path / "killed.jsonl", regenerate_mod.append_row, []

    def killed_after_two(f, row):
        if len(written) == 2:
            f.write(b'{"id": "' + row["id"].encode() + b'", "messages": [{"ro')  # torn mid-row by the kill
            f.flush()
            raise KeyboardInterrupt("simulated kill")
        written.append(row["id"])
        original(f, row)

    monkeypatch.setattr(regenerate_mod, "append_row", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        regenerate(CONVS, target, run, path, 512, Skipped())
    assert len(path.read_bytes().splitlines()) == 3  # two rows and a torn one
    monkeypatch.setattr(regenerate_mod, "append_row", original)
    resumed = regenerate(CONVS, target, run, path, 512, Skipped())
    ids = file_ids(path)  # every line parses: the torn one was cut
    assert len(ids) == len(set(ids)) == len(CONVS) * draws and ids[:2] == written
    assert as_dict(resumed) == as_dict(whole) and [c.id for c in resumed] == [c.id for c in whole]
    before = path.read_bytes()
    regenerate(CONVS, target, run, path, 512, Skipped())  # all done: nothing appended
    assert path.read_bytes() == before


def test_empty_input_and_foreign_files_are_clear_errors(target, tmp_path):
    with pytest.raises(ValueError, match="regeneration got no conversations"):
        regenerate([], target, cfg(), tmp_path / "x.jsonl", 512, Skipped())
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "a", "messages": []}\nnot json\n{"id": "b", "messages": []}\n')
    before = foreign.read_bytes()
    with pytest.raises(ValueError, match=r"foreign.jsonl:2 is not a row of regenerated answers"):
        regenerate(CONVS, target, cfg(), foreign, 512, Skipped())
    assert foreign.read_bytes() == before
    for text in ('[{"conversations": []}, {"conversations": []}]', '{"id": "a", "conversations": []}'):
        foreign.write_text(text)  # one line, no newline: not a row cut off mid-write, so nothing is cut
        with pytest.raises(ValueError, match=r"foreign.jsonl:1 is not a row of regenerated answers"):
            regenerate(CONVS, target, cfg(), foreign, 512, Skipped())
        assert foreign.read_text() == text


def test_a_file_made_with_other_answer_settings_is_refused_naming_them(target, tmp_path):
    """data.regenerate.out names the file, not its settings: a rerun asking for other answers is told, and loses
    nothing; one asking for the same answers with another batch size reuses them."""
    path = tmp_path / "answers.jsonl"
    regenerate(CONVS[:2], target, cfg(), path, 512, Skipped())
    before = path.read_bytes()
    for other, named in ((cfg(max_new_tokens=NEW + 1), "max_new_tokens"), (cfg(end_at_cut=True), "end_at_cut")):
        with pytest.raises(ValueError, match=rf"answers.jsonl holds answers made with \{{'{named}'.*another file"):
            regenerate(CONVS, target, other, path, 512, Skipped())
        assert path.read_bytes() == before
    out = regenerate(CONVS, target, cfg(batch_size=1), path, 512, Skipped())
    assert len(out) == len(CONVS) and path.read_bytes().startswith(before)
    sharded = tmp_path / "sharded.jsonl"
    regenerate(CONVS, target, cfg(shard="0/2"), sharded, 512, Skipped())  # a machine's own shard, resumed
    shard = tmp_path / "sharded.shard0-of-2.jsonl"
    with pytest.raises(ValueError, match=r"sharded.shard0-of-2.jsonl holds answers made with \{'max_new_tokens'"):
        regenerate(CONVS, target, cfg(shard="0/2", max_new_tokens=NEW + 1), sharded, 512, Skipped())
    unrecorded = tmp_path / "unrecorded.jsonl"  # rows that record no generator: nothing to judge them by
    unrecorded.write_text(json.dumps({"id": "a", "messages": [user("Hi"), said("Hello!")]}) + "\n")
    assert [c.id for c in regenerate(CONVS[:1], target, cfg(end_at_cut=True), unrecorded, 512, Skipped())] == ["a"]
    assert shard.is_file()


def test_a_last_row_without_its_newline_is_kept(target, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [user("Hi"), said("Hello.")]}))  # as a "\n".join writes
    out = regenerate(CONVS, target, cfg(), path, 512, Skipped())
    assert as_dict(out)["a"] == [user("Hi"), said("Hello.")] and sorted(file_ids(path)) == ["a", "b", "c", "d", "e"]


def test_conversations_without_a_user_turn_or_room_are_skipped_and_counted(target, tmp_path):
    convs = [
        Conversation("no-user", [{"role": "system", "content": "You are kind."}, said("Hello there.")]),
        Conversation("too-long", [user("word " * 200), said("ok")]),
        Conversation("c", [user("Hi"), said("Hello!")]),
        Conversation("c", [user("Hi again"), said("Hello!")]),
    ]
    skipped = Skipped()
    out = regenerate(convs, target, cfg(), tmp_path / "d.jsonl", 64, skipped)
    assert [c.id for c in out] == ["c"]
    assert skipped.counts == {
        "without a user turn to answer": 1,
        "whose first prompt fills max_length (64 tokens)": 1,
        "with a duplicate id": 1,
    }
    with pytest.raises(ValueError, match=r"left no conversation to train on \(skipped: 1 without a user turn"):
        regenerate(convs[:1], target, cfg(), tmp_path / "e.jsonl", 64, Skipped())


def test_answers_stop_at_max_length(target, tmp_path):
    """Tokens past max_length would be cut from the training example: they are not generated, and the
    conversation is counted as cut short."""
    conv = Conversation("long", [user("Tell me a story."), said("..."), user("More."), said("...")])
    first = len(encode_chat(target.tokenizer, conv.messages[:1]))
    lines = []
    out = regenerate(
        [conv], target, cfg(max_new_tokens=50), tmp_path / "d.jsonl", first + 4, Skipped(), say=lines.append
    )
    (out,) = out
    assert len(out.messages) == 2  # the second user turn would start past max_length
    assert any("of 1 answers 1 (100%) hit the token limit" in line for line in lines)
    assert any("1 conversations filled max_length" in line for line in lines)
    ids = target.tokenizer(out.messages[1]["content"], add_special_tokens=False)["input_ids"]
    assert 0 < len(ids) <= 4


@pytest.mark.parametrize("backend", ["draftsmith", "auto"], ids=["own", "auto-without-vllm"])
def test_processes_share_the_work_and_merge_into_one_file(target, tmp_path, monkeypatch, backend):
    """Without vLLM, auto splits the work between the processes as the own decoder does."""
    single = regenerate(CONVS, target, cfg(), tmp_path / "one.jsonl", 512, Skipped())
    path, barrier, results = tmp_path / "two.jsonl", threading.Barrier(2, timeout=120), {}
    c = cfg(backend=backend, vllm_python=str(tmp_path / "no-python") if backend == "auto" else None)
    parts = []
    monkeypatch.setattr(regenerate_mod, "merge_into", lambda p, ps, o: parts.extend(ps) or merge_into(p, ps, o))

    def rank(r: int) -> None:
        results[r] = regenerate(CONVS, target, c, path, 512, Skipped(), r, 2, barrier.wait)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert as_dict(results[0]) == as_dict(results[1]) == as_dict(single)
    assert file_ids(path) == [c.id for c in CONVS] and list(tmp_path.glob("two.part*")) == []
    assert sorted(p.name for p in parts) == ["two.part0-of-2.jsonl", "two.part1-of-2.jsonl"]  # both ranks wrote


def test_data_keys_change_only_with_self_distillation():
    plain, on = DataConfig(), DataConfig(regenerated=True)
    assert data_key(plain)["self_distill"] is None and "regenerate" not in data_key(plain)
    assert data_key(DataConfig(regenerate=RegenerateConfig(temperature=0.5))) == data_key(plain)
    assert data_key(on)["self_distill"] == {"max_new_tokens": 512, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    assert data_key(DataConfig(regenerated=True, regenerate=RegenerateConfig(batch_size=1))) == data_key(
        on
    )  # speed only
    draws = DataConfig(regenerated=True, regenerate=RegenerateConfig(temperature=0.7, answers=2))
    assert data_key(draws)["self_distill"]["answers"] == 2  # more examples: other features
    assert cache_key("t", plain, (), "bfloat16", "", "float32") != cache_key("t", on, (), "bfloat16", "", "float32")


def test_both_recipes_train_every_head_on_the_targets_own_answers(tmp_path):
    """train=quick and train=full regenerate the answers (through vLLM where installed) for every head;
    data.regenerated=false trains on the source's answers."""
    with initialize_config_module("draftsmith.conf", version_base=None):
        for recipe in ("quick", "full"):
            for head in ("draft_model", "eagle3", "eagle", "medusa", "peagle", "dflash"):
                overrides = [f"out={tmp_path}", f"head={head}", f"train={recipe}"]
                c = typed(compose("train", overrides=overrides), RunConfig)
                assert c.data.regenerated is True and c.data.regenerate.fidelity == 8 and c.head.kind == head
                assert (c.data.regenerate.temperature, c.data.regenerate.top_p) == (0.7, 0.8)  # sampled: the data arms
        off = [f"out={tmp_path}", "head=draft_model", "train=quick", "data.regenerated=false"]
        c = typed(compose("train", overrides=off), RunConfig)
        assert not c.data.regenerated and c.head.num_layers == 2


def test_the_trainer_distills_once_and_reuses_the_file(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "home"))
    source = tmp_path / "chats.jsonl"
    turns = [{"from": "human", "value": "What is {}?"}, {"from": "gpt", "value": "I do not know."}]
    rows = [{"id": f"q{i}", "conversations": [{**turns[0], "value": f"What is {i}?"}, turns[1]]} for i in range(12)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(source=str(source), max_conversations=None, max_length=48, heldout_fraction=0.0, regenerated=True)
    data.regenerate = RegenerateConfig(max_new_tokens=NEW, batch_size=4, backend="draftsmith")

    def config(out: str, mode: str) -> RunConfig:
        tc = TrainConfig(max_steps=1, batch_size=4, log_every=1, features=FeatureConfig(mode=mode))
        return RunConfig(
            out=str(tmp_path / out),
            target=TargetConfig(path=str(target_dir)),
            head=HeadConfig(kind=standin_head.KIND),
            data=data,
            train=tc,
            wandb=WandbConfig(enabled=False),
        )

    train(config("a", "cached"))
    (made,) = (tmp_path / "home" / "regenerate").glob("*.jsonl")
    assert made == answers_path(data, load_target(TargetConfig(path=str(target_dir))), None)  # None: $DRAFTSMITH_CACHE
    assert len(file_ids(made)) == 12
    (features,) = (tmp_path / "home" / "features").iterdir()
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["key"]["data"]["self_distill"]["max_new_tokens"] == NEW
    assert "answers by the target" in manifest["data_info"]

    def no_generation(*args, **kwargs):
        raise AssertionError("the answers were generated again")

    monkeypatch.setattr(regenerate_mod, "generate_into", no_generation)
    train(config("b", "online"))
    recipe = json.loads((tmp_path / "b" / "final" / "config.json").read_text())["recipe"]
    assert "(regenerated)" in recipe["data"]
    assert "answers by the target (draftsmith " in recipe["extra"]["data_info"]  # the card names who wrote them

    rows = [json.loads(line) for line in made.read_text().splitlines()]
    rows[0]["messages"][1]["content"] = "Other answers (another backend, say) make other features."
    made.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(config("c", "cached"))
    assert len(list((tmp_path / "home" / "features").iterdir())) == 2  # not the cache of the earlier answers


def test_the_command_line_writes_the_file(target_dir, tmp_path, capsys):
    overrides, out = command_line(target_dir, tmp_path, CONVS, "draftsmith", NEW)
    with initialize_config_module("draftsmith.conf", version_base=None):
        assert run(typed(compose("regenerate", overrides=overrides), RegenerateRun)) == out
    assert sorted(file_ids(out)) == sorted(c.id for c in CONVS)
    assert f"5 conversations (8 answers by {target_dir.name}" in capsys.readouterr().out


def scripted(outputs: dict, eos: int):
    """A backend whose answers are scripted per (conversation, turn): `cut` answers fill their budget, the others
    end with an end-of-turn token."""
    record = {"engine": "scripted", "version": "1", "target": "t"}

    def generate(chats, prompts, budgets):
        return [
            [7] * n if outputs.get((c.id, c.turn)) == "cut" else [7, eos] for c, n in zip(chats, budgets, strict=True)
        ]

    return lambda target, cfg, limit, *args, **kw: Backend(in_rounds(generate, 2, target, cfg, limit), record, 2)


def test_rows_record_their_generator_and_which_answers_hit_the_token_limit(target, tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    out = regenerate(CONVS, target, cfg(), path, 512, Skipped())
    rows = read_rows(path)
    dtype = str(target.model.dtype).removeprefix("torch.")
    expected = {"engine": "draftsmith", "dtype": dtype, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    for conv in out:
        generator = rows[conv.id]["generator"]
        assert {k: generator[k] for k in expected} == expected and generator["max_new_tokens"] == NEW
        assert generator["target"] == target.target_id and conv.generator == generator
    eos = eos_ids(target)[0]
    monkeypatch.setattr(regenerate_mod, "open_backend", scripted({("a", 1): "cut", ("d", 0): "cut"}, eos))
    regenerate(CONVS, target, cfg(), tmp_path / "s.jsonl", 512, Skipped())
    rows = read_rows(tmp_path / "s.jsonl")
    assert rows["a"]["truncated"] == [1] and rows["d"]["truncated"] == [0] and "truncated" not in rows["c"]
    assert len(rows["a"]["messages"]) == 4 and rows["a"]["messages"][3]["role"] == "assistant"  # kept


@pytest.mark.parametrize("batch_size", [1, 3], ids=["rounds", "slots"])
def test_end_at_cut_ends_a_conversation_at_its_first_cut_answer(target, tmp_path, monkeypatch, batch_size):
    """A later turn is not asked after an answer cut at max_new_tokens; the answers before it are as without the
    setting, and the answers are keyed apart (end_at_cut is recorded only where it is on, so older keys match)."""
    eos = eos_ids(target)[0]
    script = {("a", 1): "cut", ("d", 0): "cut"}
    monkeypatch.setattr(regenerate_mod, "open_backend", scripted(script, eos))
    lines = []
    out = regenerate(CONVS, target, cfg(end_at_cut=True), tmp_path / "s.jsonl", 512, Skipped(), say=lines.append)
    d, rows = as_dict(out), read_rows(tmp_path / "s.jsonl")
    assert [m["role"] for m in d["a"]] == ["user", "assistant"] * 2 and rows["a"]["truncated"] == [1]
    assert [m["role"] for m in d["d"]] == ["user", "assistant"] and rows["d"]["truncated"] == [0]  # 2 turns dropped
    assert len(d["b"]) == 3 and len(d["c"]) == 2
    assert any("1 ended at a cut answer before their last user turn" in line for line in lines)  # a was at its last
    monkeypatch.undo()
    real = regenerate(CONVS, target, cfg(batch_size=batch_size, end_at_cut=True), tmp_path / "r.jsonl", 512, Skipped())
    whole = as_dict(regenerate(CONVS, target, cfg(batch_size=batch_size), tmp_path / "w.jsonl", 512, Skipped()))
    for conv in real:
        assert conv.messages == whole[conv.id][: len(conv.messages)] and conv.messages[-1]["role"] == "assistant"
        if len(conv.messages) < len(whole[conv.id]):
            assert conv.truncated == [sum(m["role"] == "assistant" for m in conv.messages) - 1]
    assert sum(map(len, as_dict(real).values())) < sum(map(len, whole.values()))  # the tiny target's answers run long
    assert all(c.generator["end_at_cut"] is True for c in real)
    a = CONVS[0]  # its first answer fills the context: a cut, but one that no later turn could follow anyway
    room = len(encode_chat(target.tokenizer, a.messages[:1])) + 3
    lines = []
    regenerate(
        [a],
        target,
        cfg(batch_size=batch_size, end_at_cut=True),
        tmp_path / "m.jsonl",
        room,
        Skipped(),
        say=lines.append,
    )
    assert any("1 conversations filled max_length" in line and "ended at a cut" not in line for line in lines)
    on, off = (DataConfig(regenerated=True, regenerate=cfg(end_at_cut=e)) for e in (True, False))
    assert data_key(on)["self_distill"] == data_key(off)["self_distill"] | {"end_at_cut": True}
    assert "end_at_cut" not in data_key(off)["self_distill"]
    assert answers_path(on, target, str(tmp_path)) != answers_path(off, target, str(tmp_path))


def test_shards_by_id_range_merge_into_the_whole_when_training(target, tmp_path, monkeypatch):
    whole = regenerate(CONVS, target, cfg(), tmp_path / "whole.jsonl", 512, Skipped())
    path = tmp_path / "answers.jsonl"
    shards = [regenerate(CONVS, target, cfg(shard=f"{i}/3"), path, 512, Skipped()) for i in range(3)]
    assert [[c.id for c in s] for s in shards] == [["a"], ["b", "c"], ["d", "e"]]  # contiguous, input order
    assert not path.exists() and len(list(tmp_path.glob("answers.shard*-of-3.jsonl"))) == 3
    monkeypatch.setattr(regenerate_mod, "generate_into", lambda *a, **k: pytest.fail("generated again"))
    merged = regenerate(CONVS, target, cfg(), path, 512, Skipped())
    assert as_dict(merged) == as_dict(whole) and file_ids(path) == [c.id for c in CONVS]
    again = regenerate(CONVS, target, cfg(shard="1/3"), path, 512, Skipped())  # its ids are in the file by now
    assert [c.id for c in again] == ["b", "c"]
    with pytest.raises(ValueError, match="data.regenerate.shard must be i/n"):
        regenerate(CONVS, target, cfg(shard="3/3"), path, 512, Skipped())
    monkeypatch.undo()
    other = tmp_path / "other.jsonl"
    regenerate(CONVS, target, cfg(shard="0/2", temperature=1.0), other, 512, Skipped())
    with pytest.raises(ValueError, match=r"other.shard0-of-2.jsonl holds answers made with \{'temperature': 1.0\}"):
        regenerate(CONVS, target, cfg(), other, 512, Skipped())
    assert not other.exists()  # nothing merged


def fake_vllm_python(tmp_path: Path, package_body: str) -> str:
    """A Python that finds a `vllm` package whose import runs package_body (vLLM installed but broken)."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(package_body)
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def vllm_first(monkeypatch):
    """auto as on a device with native bf16, where it asks vLLM first (elsewhere it runs the own decoder)."""
    monkeypatch.setattr(regenerate_backends, "native_bf16", lambda device: True)


def test_auto_runs_the_own_decoder_first_without_native_bf16(target, tmp_path, monkeypatch):
    monkeypatch.setattr(regenerate_backends, "native_bf16", lambda device: False)
    broken = fake_vllm_python(tmp_path, "raise RuntimeError('vLLM was started')")
    out, said = regenerate_said(CONVS[:2], target, cfg(backend="auto", vllm_python=broken), tmp_path / "a.jsonl")
    assert [c.generator["engine"] for c in out] == ["draftsmith", "draftsmith"]
    assert any("own batched decoder: no native bf16" in s for s in said) and not any("vLLM was" in s for s in said)


@pytest.mark.usefixtures("vllm_first")
def test_vllm_missing_or_failing_falls_back_in_one_line_or_is_an_error(target, tmp_path):
    missing = cfg(backend="auto", vllm_python=str(tmp_path / "no-python"))
    out, said = regenerate_said(CONVS[:2], target, missing, tmp_path / "a.jsonl")
    assert [c.generator["engine"] for c in out] == ["draftsmith", "draftsmith"]
    (line,) = [s for s in said if "falls back" in s]
    assert "no-python cannot import vllm" in line and "bash scripts/setup.sh" in line
    broken = fake_vllm_python(tmp_path, "raise RuntimeError('this vLLM has no CPU backend')")
    _, said = regenerate_said(CONVS[:2], target, cfg(backend="auto", vllm_python=broken), tmp_path / "b.jsonl")
    assert any("falls back" in s and "this vLLM has no CPU backend" in s for s in said)
    with pytest.raises(VllmUnavailable, match="failed to start"):
        regenerate(CONVS[:2], target, cfg(backend="vllm", vllm_python=broken), tmp_path / "c.jsonl", 512, Skipped())
    assert read_rows(tmp_path / "c.jsonl") == {}


@pytest.mark.usefixtures("vllm_first")
def test_a_failed_vllm_leaves_no_process_behind_and_a_hung_one_times_out(target, tmp_path, monkeypatch):
    pid_file = tmp_path / "engine.pid"
    spawns = (
        f"import subprocess\np = subprocess.Popen(['sleep', '300'])\nopen({str(pid_file)!r}, 'w').write(str(p.pid))\n"
    )
    broken = fake_vllm_python(tmp_path / "a", spawns + "raise RuntimeError('engine core died')")
    _, lines = regenerate_said(CONVS[:1], target, cfg(backend="auto", vllm_python=broken), tmp_path / "a.jsonl")
    assert any("engine core died" in line for line in lines)
    engine = int(pid_file.read_text())
    assert not Path(f"/proc/{engine}").exists() or "Z" in Path(f"/proc/{engine}/stat").read_text().split()[2]
    hung = fake_vllm_python(tmp_path / "b", "import time\ntime.sleep(300)")
    monkeypatch.setattr(regenerate_vllm, "START_TIMEOUT_S", 3)
    _, lines = regenerate_said(CONVS[:1], target, cfg(backend="auto", vllm_python=hung), tmp_path / "b.jsonl")
    assert any("did not start within 3 s" in line for line in lines)


# A vLLM that answers zeros and logs each engine it starts: its dtype, context, and the engines still running then
COUNTING_VLLM = """
import json, os
__version__ = "0.0-counting"
LOG = {log!r}


def started():
    with open(LOG) as f:
        return [json.loads(line) for line in f]


class SamplingParams:
    def __init__(self, max_tokens=16, **kw):
        self.max_tokens = max_tokens


class Out:
    def __init__(self, n):
        self.token_ids, self.finish_reason = [0] * n, "length"


class Request:
    def __init__(self, n):
        self.outputs = [Out(n)]


class LLM:
    def __init__(self, model, dtype, max_model_len, **kw):
        alive = [e["pid"] for e in started() if os.path.exists(f"/proc/{{e['pid']}}")]
        with open(LOG, "a") as f:
            f.write(json.dumps({{"pid": os.getpid(), "dtype": dtype, "context": max_model_len, "alive": alive}}))
            f.write("\\n")

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [Request(p.max_tokens) for p in params]
"""


@pytest.mark.parametrize(
    "dtype, max_length, fidelity_tokens, engines",
    [
        ("float32", 512, 8, ["float32"]),  # the fp32 worker that regenerated answers the check too
        ("bfloat16", 512, 8, ["bfloat16", "float32"]),  # an fp32 one, started once the bf16 one has ended
        ("float32", 96, 80, ["float32", "float32"]),  # no first turn fits its context with 80 tokens to answer
    ],
)
def test_the_fidelity_check_asks_the_vllm_that_regenerated_where_it_can(
    target, tmp_path, dtype, max_length, fidelity_tokens, engines
):
    log = tmp_path / "engines.jsonl"
    log.touch()
    python = fake_vllm_python(tmp_path, COUNTING_VLLM.format(log=str(log)))
    (tmp_path / "fake" / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {}\n")
    platform = "class Platform:\n    def is_cpu(self):\n        return False\n\n\ncurrent_platform = Platform()\n"
    (tmp_path / "fake" / "vllm" / "platforms.py").write_text(platform)  # not a CPU: vLLM's own top-p
    c = cfg(backend="vllm", vllm_python=python, dtype=dtype, fidelity=3, fidelity_tokens=fidelity_tokens)
    lines = []
    regenerate(CONVS, target, c, tmp_path / "a.jsonl", max_length, Skipped(), say=lines.append)
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["dtype"] for e in starts] == engines
    assert all(e["alive"] == [] for e in starts)  # never two engines at once
    assert any(line.startswith("fidelity (fp32 greedy, 3 first turns") for line in lines), lines
    assert json.loads((tmp_path / "a.fidelity.json").read_text())["reused_worker"] == (len(engines) == 1)


def test_answers_generated_by_another_target_are_refused_naming_both(target_dir, tmp_path):
    source = tmp_path / "theirs.jsonl"
    row = {"id": "x", "messages": [user("Hi"), said("Hello!")], "generator": {"engine": "vllm", "target": "big@1"}}
    source.write_text(json.dumps(row) + "\n")
    run = RunConfig(
        out=str(tmp_path / "out"),
        target=TargetConfig(path=str(target_dir)),
        head=HeadConfig(kind=standin_head.KIND),
        data=DataConfig(source=str(source), heldout_fraction=0.0),
        train=TrainConfig(max_steps=1, features=FeatureConfig(mode="online")),
        wandb=WandbConfig(enabled=False),
    )
    with pytest.raises(ValueError, match=rf"generated by big@1, but this run's target is {target_dir.name}@"):
        train(run)


def test_answers_kept_under_the_legacy_group_are_moved_over_once(tmp_path):
    """An older draftsmith kept answers under <cache>/distill/: the first lookup moves every file of the key (whole,
    sharded, logs) beside the new path, leaves other keys' files, and never replaces a file the new group has."""
    new = tmp_path / "regenerate" / "t-abc.jsonl"
    legacy = tmp_path / LEGACY_GROUP
    legacy.mkdir()
    for name in ("t-abc.shard1-of-2.jsonl", "t-abc.vllm.log", "t-other.jsonl"):
        (legacy / name).write_text(name)
    assert adopt_legacy(new) == new
    assert sorted(p.name for p in new.parent.iterdir()) == ["t-abc.shard1-of-2.jsonl", "t-abc.vllm.log"]
    assert (new.parent / "t-abc.vllm.log").read_text() == "t-abc.vllm.log"
    assert [p.name for p in legacy.iterdir()] == ["t-other.jsonl"]
    (legacy / "t-abc.jsonl").write_text("older")  # the new group has this key's files now: nothing moves
    adopt_legacy(new)
    assert (legacy / "t-abc.jsonl").read_text() == "older" and not new.exists()
    assert adopt_legacy(tmp_path / "none" / "x.jsonl") == tmp_path / "none" / "x.jsonl"
    assert not (tmp_path / "none").exists()
