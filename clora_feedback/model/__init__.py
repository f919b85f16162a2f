"""The base decoder, written once: its config, its frozen weights and its differentiable forward.

Llama/Qwen2-family decoders only. `config` reads an HF `config.json`, `base`
holds the frozen base tensors (fused q/k/v and gate/up, RoPE tables) loaded
from a safetensors directory, and `decoder` is the differentiable forward with
a pluggable per-row LoRA update. Both the serving engine's fast path
(`clora_feedback.engine.decoder`) and the trainer's policy
(`clora_feedback.train.policy`) read these same objects, so one set of base
tensors can serve and train at once.

Where base models come from is here too: `resolve` turns a model name or
directory into a checked safetensors directory, `default` caches the embedded
default (SmolLM2-135M-Instruct, shipped as a GGUF) as safetensors once, and
`tiny` writes the tiny random models the fast tests run on.

Not here: slot buffers, KV caches and the serving fast path (engine), trainable
LoRA state and losses (train).
"""
