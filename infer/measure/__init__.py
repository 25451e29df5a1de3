"""What measures the engine, kept apart from it: the benchmark and its peers, summaries, plots, exactness
verdicts, host-sync counts, token counting for draft vocabularies, and seeded random-init models."""
