"""Riptide inside trainers people already run: `trl.py` (TRL's GRPOTrainer and its async
protocols). Each module imports its trainer, so each needs its extra (`pip install 'riptide[trl]'`)."""
