import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ["DRAFTSMITH_COMPILE"] = "0"  # cuda_graphs=auto runs eagerly: compiling every test's engine would take hours;
# tests/test_compiled_step.py and the lossless module ask for the compiled step by name

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from draftsmith.files import DEFAULT_CACHE  # noqa: E402
from draftsmith.serve.models.target import TargetConfig, resolve_target  # noqa: E402
from helpers import build_tiny, build_tiny_chat_target  # noqa: E402

workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if workers:  # pytest-xdist's workers share the cores
    torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory) -> Path:
    """The answers and features the tests make go to a cache of their own: one a past run left in ~/.cache would
    stand in for the work a test means to check. Converted targets stay shared with the machine's cache."""
    root, machine = tmp_path_factory.mktemp("cache"), Path(DEFAULT_CACHE).expanduser() / "targets"
    machine.mkdir(parents=True, exist_ok=True)
    (root / "targets").symlink_to(machine, target_is_directory=True)
    os.environ["DRAFTSMITH_CACHE"] = str(root)
    return root


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M target, converted once per machine into the default cache dir."""
    return resolve_target(TargetConfig())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Factory: tiny_llama_dir(model_type, **config_overrides) -> saved HF folder, cached per args."""
    made: dict[tuple, Path] = {}

    def make(model_type: str = "llama", **overrides) -> Path:
        key = (model_type, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = build_tiny(tmp_path_factory.mktemp(f"tiny-{model_type}"), model_type, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose a lot to them on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_target(smollm2_dir, tmp_path_factory) -> Path:
    """A tiny random chat target with SmolLM2's tokenizer and ChatML template (one per test module)."""
    return build_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)
