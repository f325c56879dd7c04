"""Accuracy evaluation through a live SGLang server: RULER prompts, named systems, runner, report."""
