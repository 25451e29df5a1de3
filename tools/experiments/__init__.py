"""One-off studies behind docs/RESULTS.md: exit adapters by kind of text, the three drafting families compared."""
