"""clora-feedback: agents that keep learning from the people who use them.

An OpenAI-compatible gateway serves many agents, each through its own LoRA
adapter on one shared warm base model, and captures every completion as a
trajectory for training.
"""

__version__ = "0.1.0"
