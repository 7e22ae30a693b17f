"""draftsmith beside its peer engines: the checks users run against vLLM and llama.cpp (`draftsmith-peers`).

- `vllm_crosscheck.py` (`draftsmith-peers vllm`): exported drafters served by a real vLLM against draftsmith's engine
- `engines_crosscheck.py` (`draftsmith-peers engines`): one head's acceptance through draftsmith, vLLM and llama.cpp
- `vllm_concurrency.py` (`draftsmith-peers concurrency`): speculation's speedup through vLLM's server per concurrency
- `vllm_reload_versions.py` (`draftsmith-peers reload`): drafter versions loaded into one running vLLM

vLLM runs in its own Python: `vllm_client.py` starts the standalone `vllm_worker.py` (and the reload check its
`vllm_reload_worker.py`) there by path; those import no draftsmith. `llamacpp_peer.py` keeps a llama-server up;
`processes.py` holds what starting a server as a process needs (a free port, waiting for /health, stopping it).
The shell entry points in scripts/ (`vllm_crosscheck.sh`, `engines_crosscheck.sh`, `vllm_concurrency.sh`,
`vllm_reload_versions.sh`) make vLLM's venv first and pass its Python.
"""
