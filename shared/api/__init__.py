"""What crosses a process boundary as plain data: the OpenAI request types (protocol) and the
router <-> worker contract. Torch-free."""
