"""docs/RESULTS.md: the runs that feed it (``compare_trained_vs_free.sh``) and the page written from them."""
