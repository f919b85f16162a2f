"""LoRA math and the PEFT adapter format: torch only, no I/O beyond adapter files."""
