"""kvlab: an interactive lab for LLM KV-cache compression."""
