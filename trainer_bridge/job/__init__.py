"""A riptide-train job top to bottom (run.py) and what it reports (monitor.py)."""
