"""The Env seam (see base.py) and its real implementation (real.py)."""
