"""A riptide-train job top to bottom (run.py), what it reports (monitor.py), and the process entry of
trainer ranks k > 0 (rank_entry.py: the same job, started by training/ranks.py)."""
