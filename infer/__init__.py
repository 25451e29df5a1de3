"""Self-speculative decoding with layer skipping: one draft-verify engine, interchangeable drafters."""
