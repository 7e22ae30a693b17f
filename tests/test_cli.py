"""The command-line contract: draftsmith-generate and draftsmith-eval through their real hydra entry points."""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import MissingConfigException

from draftsmith.eval.runner import EvalConfig, run_eval
from draftsmith.peers import __main__ as peers
from draftsmith.serve.__main__ import GenerateConfig
from draftsmith.serve.__main__ import run as generate
from draftsmith.serve.shared.cli import typed
from helpers import SPEC_KEYS

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}


def run(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300
    )


def write_prompts(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_generate_prints_text_and_metrics(tiny_target, tmp_path):
    r = run(
        "draftsmith.serve",
        f"target.path={tiny_target}",
        "spec=ngram",
        "prompt=Write a haiku",
        "max_new_tokens=12",
        "temperature=0",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "[ngram] 12 tokens" in r.stdout and "tau" in r.stdout
    assert not (tmp_path / "outputs").exists()  # hydra leaves no run folders behind


def test_eval_writes_results_and_outputs(tiny_target, tmp_path):
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "category": "writing", "turns": ["Say hello twice.", "Now say it again."]},
            {"id": "b", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):"},
        ],
    )
    out = tmp_path / "ev"
    r = run(
        "draftsmith.eval",
        f"target.path={tiny_target}",
        "spec=ngram",
        f"prompts={prompts}",
        "max_new_tokens=8",
        "prefix_cache=true",
        f"out={out}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["prompts"] == 2 and res["max_new_tokens"] == 8 and res["temperature"] == 0.0
    assert res["baseline"]["method"] == "ar" and res["spec"]["method"] == "ngram"
    for key in SPEC_KEYS:
        assert key in res["spec"]
    assert res["lossless"] == {**res["lossless"], "checked": 3, "identical": 3}
    assert res["prefix_cache"]["queried_tokens"] > 0 and res["prefix_cache"]["hit_tokens"] > 0  # turn 2 reuses turn 1
    lines = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert {(x["id"], x["turn"], x["method"]) for x in lines} == {
        ("a", 0, "ar"),
        ("a", 1, "ar"),
        ("b", 0, "ar"),
        ("a", 0, "ngram"),
        ("a", 1, "ngram"),
        ("b", 0, "ngram"),
    }
    assert all(x["output_ids"] and isinstance(x["text"], str) for x in lines)


def compose_config(name: str, overrides: list[str]):
    """The same hydra config the console scripts see, composed in-process (no interpreter start per case)."""
    with initialize_config_module("draftsmith.conf", version_base=None):
        return compose(name, overrides)


def eval_in_process(overrides: list[str]):
    return run_eval(typed(compose_config("eval", overrides), EvalConfig))


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "is empty"),
        (["{not json"], ":1: not valid JSON"),
        ([{"id": "x"}], ":1: needs `turns`"),
        ([{"id": "x", "turns": []}], "non-empty list"),
        ([{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}], "appears more than once"),
    ],
)
def test_eval_refuses_bad_prompt_files_and_writes_nothing(tiny_target, tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    out = tmp_path / "ev"
    with pytest.raises(ValueError, match=re.escape(message)):
        eval_in_process([f"target.path={tiny_target}", "spec=ngram", f"prompts={path}", f"out={out}"])
    assert not out.exists()


def test_eval_names_the_line_of_a_non_utf8_byte_and_refuses_nan_temperature(tiny_target, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    out = tmp_path / "ev"
    with pytest.raises(ValueError, match=re.escape("latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 27)")):
        eval_in_process([f"target.path={tiny_target}", "spec=ngram", f"prompts={path}", f"out={out}"])
    path.write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(ValueError, match="temperature must be >= 0 .*got nan"):
        eval_in_process([f"target.path={tiny_target}", f"prompts={path}", "temperature=nan", f"out={out}"])
    assert not out.exists()


def test_a_method_without_its_drafter_names_its_own_key(tmp_path):
    r = run(
        "draftsmith.eval", "spec=ar", "methods=[ngram,eagle3]", "suite=mt_bench", f"out={tmp_path / 'ev'}", cwd=tmp_path
    )
    assert r.returncode != 0 and not (tmp_path / "ev").exists()
    assert r.stderr.strip() == (
        "draftsmith-eval: methods.eagle3 needs methods.eagle3.drafter=DIR: an eagle3 drafter folder "
        "(draftsmith-train head=eagle3)"
    )


def test_eval_refuses_a_prompt_longer_than_the_context(tiny_target, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "long", "prompt": "word " * 400}])
    out = tmp_path / "ev"
    with pytest.raises(ValueError, match="prompt 'long' has .* max_seq_len=128"):
        eval_in_process([f"target.path={tiny_target}", f"prompts={prompts}", "max_seq_len=128", f"out={out}"])
    assert not out.exists()


def test_eval_needs_one_prompt_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one of prompts=FILE.jsonl or suite="):
        eval_in_process([f"out={tmp_path / 'ev'}"])
    with pytest.raises(MissingConfigException, match="(?s)Could not find 'suite/nope'.*mt_bench"):
        eval_in_process([f"out={tmp_path / 'ev'}", "suite=nope"])  # suite is a hydra group: it lists the options


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["temperature=-1"], ValueError, "temperature must be >= 0"),
        (["temperature=nan"], ValueError, "temperature must be >= 0"),
        (["max_new_tokens=0"], ValueError, "max_new_tokens must be > 0"),
        (["target.name=llama-9000", "target.path=null"], ValueError, "unknown target"),
        (["spec=draft_model"], ValueError, "spec=draft_model needs spec.drafter=DIR"),
        (["spec=ar", "spec.name=medusa9"], ValueError, "unknown spec 'medusa9'"),
    ],
)
def test_generate_refuses_bad_arguments(tiny_target, overrides, error, message):
    cfg = compose_config("generate", [f"target.path={tiny_target}", "prompt=hi", *overrides])
    with pytest.raises(error, match=re.escape(message)):
        generate(typed(cfg, GenerateConfig))


def test_unknown_keys_are_errors_at_the_command_line(tiny_target, tmp_path):
    r = run("draftsmith.serve", f"target.path={tiny_target}", "prompt=hi", "spec.bogus=1", cwd=tmp_path)
    assert r.returncode != 0 and "bogus" in r.stderr


@pytest.mark.parametrize("spec", ["eagle", "eagle3", "medusa"])
def test_every_lookup_and_dtype_key_a_head_spec_takes_is_settable_without_plus(spec):
    head = [f"spec={spec}", "spec.drafter=HEAD", "prompt=hi"]
    overrides = [*head, "spec.ngram_tokens=5", "spec.ngram_policy=merge", "spec.draft_dtype=float32"]
    cfg = typed(compose_config("generate", overrides), GenerateConfig)
    assert (cfg.spec.ngram_tokens, cfg.spec.ngram_policy, cfg.spec.draft_dtype) == (5, "merge", "float32")
    cfg = typed(compose_config("generate", [*head, "spec.suffix_tokens=24"]), GenerateConfig)
    assert cfg.spec.suffix_tokens == 24


def console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: command -> "module:function"."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    section = text.split("[project.scripts]")[1].split("\n[")[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.]+:\w+)"', section, flags=re.M))


@pytest.mark.parametrize("command", sorted(console_scripts()))
def test_every_command_finds_its_config(command):
    """Each console script's entry point starts and prints its help: a hydra app finds its config folder from
    wherever its module lives (a moved __main__ once looked for serve/conf)."""
    module, function = console_scripts()[command].split(":")
    code = f"import sys; sys.argv = [{command!r}, '--help']; from {module} import {function}; {function}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rror" not in done.stderr, done.stderr[-2000:]


def test_a_peer_check_records_a_command_line_that_runs_again(monkeypatch):
    """draftsmith-peers CHECK ...: the check sees its own flags, and sys.argv (which the concurrency sweep records as
    its command) reads as the command that was run, without the check's name twice."""
    seen: dict = {}
    check = types.SimpleNamespace(cli=lambda argv: seen.update(argv=argv, recorded=list(sys.argv)))
    monkeypatch.setattr(peers.importlib, "import_module", lambda name: check)
    monkeypatch.setattr(sys, "argv", ["draftsmith-peers", "concurrency", "--k", "1"])
    peers.main()
    assert seen == {"argv": ["--k", "1"], "recorded": ["draftsmith-peers concurrency", "--k", "1"]}
