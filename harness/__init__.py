"""What tests and benchmarks both drive a served stallfree with: a local Ray cluster running
serve_config.yaml, an SSE client, request pacing, the engines' exported metrics, replica kills,
the soak load, and the Pydantic schemas structured outputs are tested and measured on. Installed
with the project, so tests need nothing from bench/."""
