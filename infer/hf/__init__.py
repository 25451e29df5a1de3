"""The transformers integration: our engine and drafters as generate(custom_generate=...), and its contract."""
