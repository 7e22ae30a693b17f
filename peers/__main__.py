"""draftsmith-peers CHECK [its flags]: the checks against vLLM and llama.cpp, one command; `CHECK --help` lists a
check's own flags."""

from __future__ import annotations

import argparse
import importlib
import sys

CHECKS = {  # the check's name -> its module in draftsmith.peers, each with cli(argv)
    "vllm": "vllm_crosscheck",
    "engines": "engines_crosscheck",
    "concurrency": "vllm_concurrency",
    "reload": "vllm_reload_versions",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftsmith-peers", description=__doc__.split(";")[0])
    p.add_argument("check", choices=list(CHECKS), help="vllm | engines | concurrency | reload")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the check's own flags")
    return p


def main(argv: list[str] | None = None) -> int | None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    sys.argv = [f"draftsmith-peers {args.check}", *args.args]  # its usage line, and the command a result records
    module = importlib.import_module(f"draftsmith.peers.{CHECKS[args.check]}")
    return module.cli(args.args)


if __name__ == "__main__":
    sys.exit(main())
