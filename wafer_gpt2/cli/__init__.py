"""The `wafer-gpt2` command line: `main.py` (the parser), one `*_command.py` per command, `runner.py`
(one line per user error, shared with the tools)."""
