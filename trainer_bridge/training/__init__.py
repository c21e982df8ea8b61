"""The built-in GRPO trainer (grpo.py the math, trainer.py) and its k ranks (ranks.py, rank_entry.py)."""
