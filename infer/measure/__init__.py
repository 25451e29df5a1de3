"""What measures the engine, kept apart from it: the benchmark and its peers, summaries, plots, exactness
verdicts, step timing, token counting for draft vocabularies, and a generation's verdict."""
