"""Adapters to frameworks users already build with (each behind its own optional extra)."""
