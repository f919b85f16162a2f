"""The vLLM engine: the `Engine` Protocol over vLLM OpenAI servers (`engine.kind: vllm`).

Public: `VLLMEngine` (see `engine`). Its parts: `client` (HTTP and error
translation), `names` (versioned adapter names), `guided` (constraints as vLLM
structured outputs), `checks` (start-up checks of the server). Never imports
vLLM: vLLM runs in its own environment (`scripts/install_vllm.sh`), reached
over HTTP.

Not here: starting a vLLM server (the tests' fixture does; see `tests/vllm_fixtures.py`).
"""

from clora_feedback.engine.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
