"""The built-in GRPO trainer (grpo.py the math, trainer.py) and its k ranks (ranks.py; rank k's process entry is job/rank_entry.py)."""
