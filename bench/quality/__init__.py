"""Answers: constrained outputs and tool calls beside vLLM, dtypes and quantization."""
