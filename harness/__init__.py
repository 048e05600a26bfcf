"""What tests and benchmarks both drive a served stallfree with: a local Ray cluster running
serve_config.yaml, an SSE client, request pacing, latency records, the engines' exported metrics,
replica kills, and the soak load. Installed with the project, so tests need nothing from bench/."""
