"""Self-SD's offline plan search: which layers a draft skips, found once per model and saved as a plan file."""
