"""Decoding: acceptance rules, statistics, and one loop per strategy."""
