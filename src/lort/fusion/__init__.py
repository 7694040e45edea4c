"""Fusion: which nodes ORT may run (support) and how they are grouped (fuser)."""
