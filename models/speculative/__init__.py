"""Speculative decoding: drafters, one round's accept and rollback arithmetic, resumable sessions."""
