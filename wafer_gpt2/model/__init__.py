"""GPT-2 itself: configs, parameters, checkpoint formats, the tokenizer, the NumPy reference forward
pass, and the embedded demo model and vocabulary (`data/`)."""
