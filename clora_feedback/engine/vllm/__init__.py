"""The vLLM engine: the `Engine` Protocol over vLLM OpenAI servers (`engine.kind: vllm`).

Public: `VLLMEngine` (see `engine`). Its parts: `client` (HTTP and error
translation), `names` (versioned adapter names), `replicas` (placement by
rendezvous hashing, loaded names per replica, health), `supervisor` (a local
vLLM server started and watched for `clora serve --engine vllm`), `chunks`
(stream chunks as token events), `guided` (constraints as vLLM structured
outputs), `checks` (start-up checks of a server). Never imports vLLM: vLLM
runs in its own environment (`scripts/install_vllm.sh`), reached over HTTP.
See docs/vllm.md.

Not here: installing vLLM (`scripts/install_vllm.sh`), which version an agent serves (the deployer).
"""

from clora_feedback.engine.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
