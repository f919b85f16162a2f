"""Base models: the embedded default, Hugging Face directories, tiny test models."""
